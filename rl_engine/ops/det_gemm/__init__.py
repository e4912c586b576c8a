"""``det_gemm``: batch- and column-invariant ``a @ b (+ bias)`` with deterministic backward.

Custom ops: ``rl_engine::det_gemm(a, b, bias, provider)`` and
``rl_engine::det_gemm_wgrad(a, grad, provider)`` (fp32 ``a.t() @ grad``, fixed row-chunk order).
Backward: ``da = det_gemm(grad, b.t())`` (row invariant), ``db = det_gemm_wgrad(a, grad)``,
``dbias = det_gemm_wgrad(ones[M, 1], grad)`` (the same fixed row order).
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import check_tensor, provider_op, register_op, register_triton
from rl_engine.ops.det_gemm import reference, stock
from rl_engine.registry import KernelRegistry, resolve_provider

__all__ = ["det_gemm", "det_gemm_cat"]


def _det_gemm_fake(a, b, bias):
    reference._check(a, b, bias)
    return a.new_empty((a.shape[0], b.shape[1]))


_det_gemm_op = provider_op("det_gemm", "det_gemm", reference.det_gemm, _det_gemm_fake)


def _det_gemm_wgrad_fake(a, grad):
    return a.new_empty((a.shape[1], grad.shape[1]), dtype=torch.float32)


_det_gemm_wgrad_op = provider_op(
    "det_gemm", "det_gemm_wgrad", reference.det_gemm_wgrad, _det_gemm_wgrad_fake, "wgrad"
)


def _setup_context(ctx, inputs, output):
    a, b, bias, provider = inputs
    ctx.save_for_backward(a, b)
    ctx.provider = provider
    ctx.has_bias = bias is not None


def _direct_fwd(a, b, bias, provider):
    return KernelRegistry.provider("det_gemm", provider).fn(a, b, bias)


def _direct_wgrad(a, grad, provider):
    return KernelRegistry.provider("det_gemm", provider).extras["wgrad"](a, grad)


# The forward and weight-gradient ops as custom ops (what torch.compile traces) or as direct
# provider calls (eager: the same functions without the custom-op dispatch). Equal bits.
_OPS = (_det_gemm_op, _det_gemm_wgrad_op)
_DIRECT = (_direct_fwd, _direct_wgrad)


def _backward(ctx, grad, ops=_OPS):
    fwd_op, wgrad_op = ops
    a, b = ctx.saved_tensors
    grad = grad.to(a.dtype)
    da = db = dbias = None
    if ctx.needs_input_grad[0]:
        da = fwd_op(grad, b.t(), None, ctx.provider)
    if ctx.needs_input_grad[1]:
        db = wgrad_op(a, grad, ctx.provider).to(b.dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        ones = grad.new_ones((grad.shape[0], 1))
        dbias = wgrad_op(ones, grad, ctx.provider)[0].to(grad.dtype)
    return da, db, dbias, None


_det_gemm_op.register_autograd(_backward, setup_context=_setup_context)


class _DetGemmFn(torch.autograd.Function):
    """Eager path: the provider's functions under a plain autograd function.

    The custom ops above are what ``torch.compile`` traces; in eager mode their dispatch (and
    the autograd wrapper ``register_autograd`` builds) adds tens of microseconds of host time to
    every call, the GPU time of a decode-sized GEMM. Same provider functions, same backward
    rule: equal bits (tested).
    """

    @staticmethod
    def forward(ctx, a, b, bias, provider):
        out = _direct_fwd(a, b, bias, provider)
        _setup_context(ctx, (a, b, bias, provider), out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad, _DIRECT)


def _entry(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *, provider: str
) -> torch.Tensor:
    reference._check(a, b, bias)
    if torch.compiler.is_compiling():
        return _det_gemm_op(a, b, bias, provider)
    if torch.is_grad_enabled() and (
        a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _DetGemmFn.apply(a, b, bias, provider)
    return _direct_fwd(a, b, bias, provider)  # no graph to record


def det_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Batch-invariant ``a @ b (+ bias)`` through the provider the registry resolves.

    See :func:`rl_engine.ops.det_gemm.reference.det_gemm` for the contract.
    """
    check_tensor("a", a)  # the full check runs once, in _entry
    provider = resolve_provider("det_gemm", a.device.type, backend)
    return _entry(a, b, bias, provider=provider)


class _DetGemmCatFn(torch.autograd.Function):
    """``a @ cat(weights).t() (+ cat(biases))`` that keeps no concatenated weight for the
    backward: it saves the weights themselves and concatenates them again there (a copy of
    the weights, which is cheap next to the GEMMs). Forward, weight and bias gradients are
    ``_DetGemmFn``'s on the concatenated operands; the input gradient is one GEMM over the
    concatenated N."""

    @staticmethod
    def forward(ctx, a, provider, n_weights, *tensors):
        weights, biases = tensors[:n_weights], tensors[n_weights:]
        w = torch.cat(weights)
        bias = torch.cat(biases) if biases else None
        out = _direct_fwd(a, w.t(), bias, provider)
        ctx.save_for_backward(a, *weights)
        ctx.provider = provider
        ctx.sizes = [t.shape[0] for t in weights]
        ctx.has_bias = bool(biases)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, *weights = ctx.saved_tensors
        grad = grad.to(a.dtype)
        n = len(weights)
        da = None
        if ctx.needs_input_grad[0]:
            da = _direct_fwd(grad, torch.cat(weights), None, ctx.provider)
        dws = [None] * n
        if any(ctx.needs_input_grad[3 : 3 + n]):
            db = _direct_wgrad(a, grad, ctx.provider)
            dws = [p.t().to(w.dtype) for p, w in zip(db.split(ctx.sizes, 1), weights, strict=True)]
        dbs = []
        if ctx.has_bias:
            ones = grad.new_ones((grad.shape[0], 1))
            dbias = _direct_wgrad(ones, grad, ctx.provider)[0].to(grad.dtype)
            dbs = list(dbias.split(ctx.sizes))
        return (da, None, None, *dws, *dbs)


def det_gemm_cat(
    a: torch.Tensor,
    weights: list[torch.Tensor] | tuple[torch.Tensor, ...],
    biases: list[torch.Tensor] | tuple[torch.Tensor, ...] | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Several ``Linear`` layers that read the same input, as one GEMM:
    ``det_gemm(a, cat(weights).t(), cat(biases))``, [M, sum of the weights' rows].

    Column invariance makes every output column (and its weight / bias gradient) bitwise the one
    its layer alone computes; only the gradient of ``a`` differs from separate layers (one
    reduction over the concatenated N instead of a sum of per-layer products). In eager mode the
    concatenated weight is not kept for the backward (see ``_DetGemmCatFn``).

    Args:
        a: [M, K] input.
        weights: ``nn.Linear`` weights [N_i, K], same dtype and device as ``a``.
        biases: one per weight, or ``None`` for no bias at all.
    """
    if not weights:
        raise ValueError("det_gemm_cat: no weights")
    biases = list(biases) if biases is not None else []
    if biases and len(biases) != len(weights):
        raise ValueError(
            f"det_gemm_cat: {len(biases)} biases for {len(weights)} weights (one each, or None)"
        )
    for i, w in enumerate(weights):  # each layer's operands, checked as det_gemm checks them
        reference._check(a, w.t(), biases[i] if biases else None)
    provider = resolve_provider("det_gemm", a.device.type, backend)
    if torch.compiler.is_compiling() or not (
        torch.is_grad_enabled()
        and (a.requires_grad or any(t.requires_grad for t in (*weights, *biases)))
    ):
        bias = torch.cat(biases) if biases else None
        return _entry(a, torch.cat(list(weights)).t(), bias, provider=provider)
    return _DetGemmCatFn.apply(a, provider, len(weights), *weights, *biases)


register_op(
    "det_gemm",
    entry=_entry,
    native=("det_gemm/native-k16", reference),
    stock=("det_gemm/stock-torch", stock),
    extras=("wgrad",),
)

# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)

# The CUDA C++ provider (SM90, family det_gemm/cuda-sm90): opt-in only, never chosen by default
# (RL_ENGINE_BACKEND_DET_GEMM=cuda on every side). Registered before the TP reduction below,
# which makes one det_gemm_tp provider per det_gemm provider.
from rl_engine.ops.det_gemm import cuda as _cuda  # noqa: E402

KernelRegistry.register_provider(_cuda.PROVIDER)


# the TP-invariant reduction (op det_gemm_tp: one provider per invariant det_gemm provider)
from rl_engine.ops.det_gemm import tp as _tp  # noqa: E402,F401
