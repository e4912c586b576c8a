"""``rms_norm``: batch-invariant RMSNorm, optionally with the residual add fused in front.

Custom ops:

* ``rl_engine::rms_norm(x, weight, eps, provider) -> y``
* ``rl_engine::fused_add_rms_norm(x, residual, weight, eps, provider) -> (y, x + residual)``
* ``rl_engine::rms_norm_dx(grad, r, weight, eps, provider) -> dr`` (row invariant)
* ``rl_engine::rms_norm_wgrad(grad, r, eps, provider) -> dweight`` (fp32, fixed row order)
* ``rl_engine::rms_norm_backward(grad, r, weight, grad_sum, eps, provider) -> (dr, dweight)``:
  both gradients from one pass (``dr`` includes ``+ grad_sum`` when given), for providers with
  the ``"backward"`` extra; bitwise equal to the two separate ops.

Backward of the fused op: ``ds = rms_norm_dx(grad_y, s) + grad_s`` (the add in ``x.dtype``, as
autograd accumulates the unfused composition), ``dx = dresidual = ds``; so the fused op and
``(rms_norm(x + residual), x + residual)`` agree bitwise forward and backward.

Which backward ops the autograd runs is a capability of the provider, not a numerics choice:
when both the input and the weight need a gradient and the provider has the ``"backward"``
extra (triton), one fused op; otherwise (``native``, or one gradient only) ``rms_norm_dx`` and /
or ``rms_norm_wgrad``. The provider promises equal bits either way (tested).
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _dtensor
from rl_engine.ops._common import (
    check_tensor,
    provider_op,
    register_op,
    register_triton,
    registry_entry,
)
from rl_engine.ops.rms_norm import reference, stock
from rl_engine.registry import KernelRegistry, Provider, resolve_provider

__all__ = ["rms_norm"]

_OP = "rms_norm"


def _prov(name: str) -> Provider:
    return KernelRegistry.provider(_OP, name)


# The ops' bodies (provider_op's ``call``; the eager path below calls them directly, _direct):
# the providers' functions take the residual and the second gradient last, optional, and have
# the fused backward only where they say so.
def _norm(p: Provider, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return p.fn(x, weight, eps).contiguous()


def _add_norm(
    p: Provider, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = p.fn(x, weight, eps, residual)
    return y.contiguous(), s.contiguous()


def _dx(
    p: Provider, grad: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return p.extras["dx"](grad, r, weight, eps).contiguous()


def _wgrad(p: Provider, grad: torch.Tensor, r: torch.Tensor, eps: float) -> torch.Tensor:
    return p.extras["wgrad"](grad, r, eps)


def _dx_and_wgrad(
    p: Provider,
    grad: torch.Tensor,
    r: torch.Tensor,
    weight: torch.Tensor,
    grad_sum: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if "backward" not in p.extras:
        raise NotImplementedError(
            f"rms_norm: provider {p.name!r} has no fused backward; use rms_norm_dx and "
            "rms_norm_wgrad"
        )
    dx, dw = p.extras["backward"](grad, r, weight, eps, grad_sum)
    return dx.contiguous(), dw


def _like_x(x, *args):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _like_r(grad, r, *args):
    return torch.empty(r.shape, dtype=r.dtype, device=r.device)


def _wgrad_like(grad, r, *args):
    return torch.empty((r.shape[-1],), dtype=torch.float32, device=r.device)


def _add_norm_fake(x, *args):
    return _like_x(x), _like_x(x)


def _backward_fake(grad, r, *args):
    return _like_r(grad, r), _wgrad_like(grad, r)


_rms_norm_op = provider_op(_OP, "rms_norm", None, _like_x, call=_norm)
_fused_add_rms_norm_op = provider_op(
    _OP, "fused_add_rms_norm", None, _add_norm_fake, call=_add_norm
)
_rms_norm_dx_op = provider_op(_OP, "rms_norm_dx", None, _like_r, call=_dx)
_rms_norm_wgrad_op = provider_op(_OP, "rms_norm_wgrad", None, _wgrad_like, call=_wgrad)
_rms_norm_backward_op = provider_op(
    _OP, "rms_norm_backward", None, _backward_fake, call=_dx_and_wgrad
)


def _has_fused_backward(provider: str) -> bool:
    return "backward" in _prov(provider).extras


def _direct(call: Any) -> Any:
    """An op's body called directly, with the op's arguments (the provider's name last)."""

    def run(*args: Any) -> Any:
        return call(_prov(args[-1]), *args[:-1])

    return run


# The backward ops, as custom ops (traced by torch.compile) or as direct provider calls (eager:
# the same functions without the custom-op dispatch; see _RmsNormFn). Equal bits either way.
_OPS = (_rms_norm_dx_op, _rms_norm_wgrad_op, _rms_norm_backward_op)
_DIRECT = (_direct(_dx), _direct(_wgrad), _direct(_dx_and_wgrad))


def _setup_context(ctx, inputs, output):
    x, weight, eps, provider = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.provider = provider


def _backward(ctx, grad, ops=_OPS):
    dx_op, wgrad_op, backward_op = ops
    x, weight = ctx.saved_tensors
    grad = grad.to(x.dtype)
    # one fused pass when the provider has it; not for DTensors, whose input gradient stays
    # sharded through rms_norm_dx while the weight gradient gathers the rows
    fused = _has_fused_backward(ctx.provider) and not _dtensor.any_dtensor(grad, x)
    if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and fused:
        dx, dw = backward_op(grad, x, weight, None, ctx.eps, ctx.provider)
        return dx, dw.to(weight.dtype), None, None
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = dx_op(grad, x, weight, ctx.eps, ctx.provider)
    if ctx.needs_input_grad[1]:
        dw = wgrad_op(grad, x, ctx.eps, ctx.provider).to(weight.dtype)
    return dx, dw, None, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def _fused_setup_context(ctx, inputs, output):
    x, residual, weight, eps, provider = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps
    ctx.provider = provider


def _fused_backward(ctx, grad_y, grad_s, ops=_OPS):
    dx_op, wgrad_op, backward_op = ops
    s, weight = ctx.saved_tensors
    ds = dw = None
    need_ds = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
    fused = _has_fused_backward(ctx.provider) and not _dtensor.any_dtensor(grad_y, s)
    if need_ds and ctx.needs_input_grad[2] and fused:
        gs = grad_s.to(s.dtype) if grad_s is not None else None
        ds, dw = backward_op(grad_y.to(s.dtype), s, weight, gs, ctx.eps, ctx.provider)
        dw = dw.to(weight.dtype)
    elif need_ds:
        ds = dx_op(grad_y.to(s.dtype), s, weight, ctx.eps, ctx.provider)
        if grad_s is not None:
            ds = ds + grad_s.to(s.dtype)
    if ctx.needs_input_grad[2] and dw is None:
        dw = wgrad_op(grad_y.to(s.dtype), s, ctx.eps, ctx.provider).to(weight.dtype)
    dx = ds if ctx.needs_input_grad[0] else None
    dres = ds if ctx.needs_input_grad[1] else None
    if dx is not None and dres is not None and _dtensor.any_dtensor(ds):
        # one gradient object for two leaves: autograd copies it for the first through
        # ``new_empty_strided(...).copy_``, which on DTensors (torch 2.11) comes out Replicate
        # instead of the input's Shard. Two objects, each stored as is (what autograd's copy
        # costs for plain tensors too)
        dres = ds.clone()
    return dx, dres, dw, None, None


_fused_add_rms_norm_op.register_autograd(_fused_backward, setup_context=_fused_setup_context)


class _RmsNormFn(torch.autograd.Function):
    """Eager path: the provider's functions under a plain autograd function.

    The custom ops above are what ``torch.compile`` traces; in eager mode their dispatch (and the
    autograd wrapper ``register_autograd`` builds) costs ~200 us of host time per forward +
    backward on an H200, more than the GPU time of a 16384 x 8192 norm. The same provider
    functions, the same backward rules: the bits are equal (tested).
    """

    @staticmethod
    def forward(ctx, x, weight, eps, provider):
        y = _norm(_prov(provider), x, weight, eps)
        _setup_context(ctx, (x, weight, eps, provider), y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad, _DIRECT)


class _FusedAddRmsNormFn(torch.autograd.Function):
    """Eager path of the fused residual op (see :class:`_RmsNormFn`)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, provider):
        y, s = _add_norm(_prov(provider), x, residual, weight, eps)
        _fused_setup_context(ctx, (x, residual, weight, eps, provider), (y, s))
        return y, s

    @staticmethod
    def backward(ctx, grad_y, grad_s):
        return _fused_backward(ctx, grad_y, grad_s, _DIRECT)


def _run(
    x, weight, eps, residual, provider: str
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The op through ``provider`` on :func:`rms_norm`'s arguments (checked here, once)."""
    reference._check(x, weight, eps, residual)
    sharded = _dtensor.any_dtensor(x, weight, residual)
    if sharded:  # the custom ops carry the DTensor sharding strategies (see ops/_dtensor.py)
        _dtensor.ensure()
    if torch.compiler.is_compiling() or sharded:
        if residual is None:
            return _rms_norm_op(x, weight, float(eps), provider)
        return _fused_add_rms_norm_op(x, residual, weight, float(eps), provider)
    if residual is None:
        return _RmsNormFn.apply(x, weight, float(eps), provider)
    return _FusedAddRmsNormFn.apply(x, residual, weight, float(eps), provider)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant RMSNorm through the provider the registry resolves.

    Args:
        x: [..., H] float32 / bfloat16 / float16.
        weight: [H].
        eps: added to the mean square.
        residual: optional [..., H], same dtype as ``x``: fused ``x + residual`` in front.
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        ``y`` [..., H] in ``x.dtype``, or ``(y, x + residual)`` when ``residual`` is given.
        See :func:`rl_engine.ops.rms_norm.reference.rms_norm` for the contract.
    """
    check_tensor("x", x)  # the full check runs once, in _run
    provider = resolve_provider(_OP, x.device.type, backend)
    return _run(x, weight, eps, residual, provider)


register_op(
    _OP,
    entry=registry_entry(rms_norm, _run),
    native=("rms_norm/native-tree", reference),
    stock=("rms_norm/stock-torch", stock),
    extras=("dx", "wgrad"),
)


# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
