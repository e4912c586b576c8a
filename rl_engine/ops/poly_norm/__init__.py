"""``poly_norm`` / ``fused_mul_poly_norm``: batch-invariant PolyNorm (Motif's MLP activation).

Custom ops: ``rl_engine::poly_norm(x, mul, weight, bias, eps, provider) -> y`` (``mul`` is
``None`` for ``poly_norm``; given, the result is ``poly_norm(x) * mul``) and
``rl_engine::poly_norm_backward(grad, x, mul, weight, bias, eps, provider) -> (dx, dmul,
dweight, dbias)`` (``dmul`` empty without ``mul``; dweight / dbias fp32, cast to the parameters'
dtypes by the autograd). The fused op and ``poly_norm(x) * mul`` agree bitwise, forward and
backward.
"""

from __future__ import annotations

import torch

from rl_engine.ops import _dtensor
from rl_engine.ops._common import check_tensor, provider_op, register_op, register_triton
from rl_engine.ops.poly_norm import reference
from rl_engine.registry import Provider, resolve_provider

__all__ = ["fused_mul_poly_norm", "poly_norm"]

_OP = "poly_norm"


# The ops' bodies (provider_op's ``call``): one op for both forms, the provider's ``fn`` or its
# ``fused_mul``; the backward takes ``mul`` last, optional, and ``dmul`` comes back empty
# without it.
def _forward(
    p: Provider,
    x: torch.Tensor,
    mul: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    if mul is None:
        return p.fn(x, weight, bias, eps)
    return p.extras["fused_mul"](x, mul, weight, bias, eps)


def _backward_call(
    p: Provider,
    grad: torch.Tensor,
    x: torch.Tensor,
    mul: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dmul, dw, db = p.extras["backward"](grad, x, weight, bias, eps, mul)
    if dmul is None:
        dmul = x.new_empty(0)
    return dx.contiguous(), dmul.contiguous(), dw.clone(), db.clone()  # (views of one sum)


def _fake(x, mul, weight, bias, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _backward_fake(grad, x, mul, weight, bias, eps):
    dmul_shape = x.shape if mul is not None else (0,)
    f32 = torch.float32
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(dmul_shape, dtype=x.dtype, device=x.device),
        torch.empty((reference.ORDER,), dtype=f32, device=x.device),
        torch.empty((1,), dtype=f32, device=x.device),
    )


_poly_norm_op = provider_op(_OP, "poly_norm", None, _fake, call=_forward, contiguous=True)
_poly_norm_backward_op = provider_op(
    _OP, "poly_norm_backward", None, _backward_fake, call=_backward_call
)


def _setup_context(ctx, inputs, output):
    x, mul, weight, bias, eps, provider = inputs
    ctx.save_for_backward(x, mul, weight, bias)
    ctx.eps, ctx.provider = eps, provider


def _backward(ctx, grad):
    x, mul, weight, bias = ctx.saved_tensors
    dx, dmul, dw, db = _poly_norm_backward_op(
        grad.to(x.dtype), x, mul, weight, bias, ctx.eps, ctx.provider
    )
    need = ctx.needs_input_grad
    # DTensors: the op ran on gathered rows (ops/_dtensor.py); the input gradients go back in
    # the inputs' placements
    dx, dmul = _dtensor.like(dx, x), _dtensor.like(dmul, mul)
    return (
        dx if need[0] else None,
        dmul if (mul is not None and need[1]) else None,
        dw.to(weight.dtype) if need[2] else None,
        db.to(bias.dtype) if need[3] else None,
        None,
        None,
    )


_poly_norm_op.register_autograd(_backward, setup_context=_setup_context)


def _entry(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
    *,
    provider: str,
    mul: torch.Tensor | None = None,
) -> torch.Tensor:
    reference._check(x, weight, bias, eps, mul)
    if _dtensor.any_dtensor(x, mul, weight, bias):
        _dtensor.ensure()
    return _poly_norm_op(x, mul, weight, bias, float(eps), provider)


def poly_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Batch-invariant ``w0 n(x^3) + w1 n(x^2) + w2 n(x) + b``, ``n(z) = z / rms(z)`` over the
    last dim.

    Args:
        x: [..., H] float32 / bfloat16 / float16.
        weight: [3] (``w0, w1, w2``); bias: [1]; any float dtype.
        eps: added to each mean square.
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        [..., H] in ``x.dtype``; differentiable wrt ``x``, ``weight`` and ``bias`` (the input
        gradient row invariant, the parameter gradients deterministic).
    """
    check_tensor("x", x)
    provider = resolve_provider(_OP, x.device.type, backend)
    return _entry(x, weight, bias, eps, provider=provider)


def fused_mul_poly_norm(
    x: torch.Tensor,
    mul: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``poly_norm(x, weight, bias, eps) * mul`` in one pass: bitwise the unfused composition,
    forward and backward. ``mul``: x's shape and dtype."""
    check_tensor("x", x)
    provider = resolve_provider(_OP, x.device.type, backend)
    return _entry(x, weight, bias, eps, provider=provider, mul=mul)


register_op(
    _OP,
    entry=_entry,
    native=("poly_norm/native", reference),
    extras={"fused_mul": "fused_mul_poly_norm", "backward": "poly_norm_backward"},
)

# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
