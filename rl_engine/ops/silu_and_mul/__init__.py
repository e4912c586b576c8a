"""``silu_and_mul``: batch-invariant SwiGLU activation ``silu(x[..., :D]) * x[..., D:]``.

Custom ops: ``rl_engine::silu_and_mul(x, provider) -> y`` and
``rl_engine::silu_and_mul_backward(grad, x, provider) -> dx`` (elementwise, row invariant).
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import check_tensor, register_op, register_triton, registry_entry
from rl_engine.ops.silu_and_mul import reference, stock
from rl_engine.registry import KernelRegistry, resolve_provider

__all__ = ["silu_and_mul"]


def _out_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("rl_engine::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: torch.Tensor, provider: str) -> torch.Tensor:
    return KernelRegistry.provider("silu_and_mul", provider).fn(x).contiguous()


@_silu_and_mul_op.register_fake
def _(x, provider):
    return torch.empty(_out_shape(x), dtype=x.dtype, device=x.device)


@torch.library.custom_op("rl_engine::silu_and_mul_backward", mutates_args=())
def _silu_and_mul_backward_op(grad: torch.Tensor, x: torch.Tensor, provider: str) -> torch.Tensor:
    prov = KernelRegistry.provider("silu_and_mul", provider)
    return prov.extras["backward"](grad, x).contiguous()


@_silu_and_mul_backward_op.register_fake
def _(grad, x, provider):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


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
    provider = resolve_provider("silu_and_mul", x.device.type, backend)
    return _run(x, provider)


register_op(
    "silu_and_mul",
    entry=registry_entry(silu_and_mul, _run),
    native=(
        "silu_and_mul/native-f64",
        reference.silu_and_mul,
        {"backward": reference.silu_and_mul_backward},
    ),
    stock=(
        "silu_and_mul/stock-torch",
        stock.silu_and_mul,
        {"backward": stock.silu_and_mul_backward},
    ),
)


# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
