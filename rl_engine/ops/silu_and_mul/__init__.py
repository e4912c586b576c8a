"""``silu_and_mul``: batch-invariant SwiGLU activation ``silu(x[..., :D]) * x[..., D:]``.

Custom ops: ``rl_engine::silu_and_mul(x, provider) -> y`` and
``rl_engine::silu_and_mul_backward(grad, x, provider) -> dx`` (elementwise, row invariant).
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import (
    check_tensor,
    provider_op,
    register_op,
    register_triton,
    registry_entry,
)
from rl_engine.ops.silu_and_mul import reference, stock
from rl_engine.registry import resolve_provider

__all__ = ["silu_and_mul"]

_OP = "silu_and_mul"


def _fake(x):
    return torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)


def _backward_fake(grad, x):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_silu_and_mul_op = provider_op(_OP, _OP, reference.silu_and_mul, _fake, contiguous=True)
_silu_and_mul_backward_op = provider_op(
    _OP,
    "silu_and_mul_backward",
    reference.silu_and_mul_backward,
    _backward_fake,
    "backward",
    contiguous=True,
)


def _setup_context(ctx, inputs, output):
    x, provider = inputs
    ctx.save_for_backward(x)
    ctx.provider = provider


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return _silu_and_mul_backward_op(grad.to(x.dtype), x, ctx.provider), None


_silu_and_mul_op.register_autograd(_backward, setup_context=_setup_context)


def _run(x: torch.Tensor, provider: str) -> torch.Tensor:
    """The op through ``provider`` on :func:`silu_and_mul`'s arguments (checked here, once)."""
    reference._check(x)
    return _silu_and_mul_op(x, provider)


def silu_and_mul(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``silu(x[..., :D]) * x[..., D:]`` through the resolved provider.

    Args:
        x: [..., 2D] float32 / bfloat16 / float16.
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        [..., D] in ``x.dtype``. See :func:`rl_engine.ops.silu_and_mul.reference.silu_and_mul`.
    """
    check_tensor("x", x)  # the full check runs once, in _run
    provider = resolve_provider(_OP, x.device.type, backend)
    return _run(x, provider)


register_op(
    _OP,
    entry=registry_entry(silu_and_mul, _run),
    native=("silu_and_mul/native-f64", reference),
    stock=("silu_and_mul/stock-torch", stock),
    extras=("backward",),
)


# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
