"""``rope``: batch-invariant rotary position embedding with tables computed inside the op.

Custom ops (the scaling dict travels as its canonical scalars):

* ``rl_engine::rope(x, positions, theta, rotary_dim, is_neox, rope_type, factor,
  low_freq_factor, high_freq_factor, original_max_position_embeddings, provider) -> y``
* ``rl_engine::rope_backward(grad, positions, ...same..., provider) -> dx`` (inverse rotation;
  ``positions`` gets no gradient).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl_engine.ops._common import FLOAT_DTYPES, check_tensor
from rl_engine.ops.rope import reference, stock
from rl_engine.registry import KernelRegistry, Provider, resolve_provider

__all__ = ["rope"]


def _call(extra: str | None, t, positions, theta, rotary_dim, is_neox, canon, provider):
    prov = KernelRegistry.provider("rope", provider)
    fn = prov.fn if extra is None else prov.extras[extra]
    return fn(t, positions, theta, rotary_dim, is_neox, reference.scaling_dict(canon)).contiguous()


@torch.library.custom_op("rl_engine::rope", mutates_args=())
def _rope_op(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    rotary_dim: int,
    is_neox: bool,
    rope_type: str,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
    provider: str,
) -> torch.Tensor:
    canon = (rope_type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    return _call(None, x, positions, theta, rotary_dim, is_neox, canon, provider)


@_rope_op.register_fake
def _(x, positions, theta, rotary_dim, is_neox, rope_type, factor, low, high, orig, provider):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("rl_engine::rope_backward", mutates_args=())
def _rope_backward_op(
    grad: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    rotary_dim: int,
    is_neox: bool,
    rope_type: str,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
    provider: str,
) -> torch.Tensor:
    canon = (rope_type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    return _call("backward", grad, positions, theta, rotary_dim, is_neox, canon, provider)


@_rope_backward_op.register_fake
def _(grad, positions, theta, rotary_dim, is_neox, rope_type, factor, low, high, orig, provider):
    return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)


def _setup_context(ctx, inputs, output):
    x, positions, *params = inputs
    ctx.save_for_backward(positions)
    ctx.params = params
    ctx.dtype = x.dtype


def _backward(ctx, grad):
    (positions,) = ctx.saved_tensors
    dx = None
    if ctx.needs_input_grad[0]:
        dx = _rope_backward_op(grad.to(ctx.dtype), positions, *ctx.params)
    return (dx,) + (None,) * 10


_rope_op.register_autograd(_backward, setup_context=_setup_context)


def _entry(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    is_neox: bool = True,
    scaling: Mapping[str, Any] | None = None,
    *,
    provider: str,
) -> torch.Tensor:
    rotary_dim, canon = reference._check(x, positions, theta, rotary_dim, is_neox, scaling)
    return _rope_op(x, positions, float(theta), rotary_dim, is_neox, *canon, provider)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    is_neox: bool = True,
    scaling: Mapping[str, Any] | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Batch-invariant RoPE of ``q`` or ``k`` through the provider the registry resolves.

    Args:
        x: [T, heads, head_dim] float32 / bfloat16 / float16.
        positions: [T] int32 / int64.
        theta: the RoPE base.
        rotary_dim: rotated channels (even, <= head_dim; default head_dim); the rest pass through.
        is_neox: rotate-half layout (True: Llama / Qwen) or GPT-J interleaved pairs (False).
        scaling: None or a Hugging Face ``rope_scaling`` dict (``default``, ``linear``,
            ``llama3``); other types raise.
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        [T, heads, head_dim] in ``x.dtype``. See :func:`rl_engine.ops.rope.reference.rope`.
    """
    check_tensor("x", x)  # the full check runs once, in _entry
    provider = resolve_provider("rope", x.device.type, backend)
    return _entry(x, positions, theta, rotary_dim, is_neox, scaling, provider=provider)


KernelRegistry.register_op("rope", entry=_entry, reference=reference.rope)
KernelRegistry.register_provider(
    Provider(
        op="rope",
        name="native",
        devices=("cpu", "cuda", "rocm"),
        dtypes=FLOAT_DTYPES,
        invariant=True,
        numerics="rope/native-f64table",
        fn=reference.rope,
        extras={"backward": reference.rope_backward},
    )
)
KernelRegistry.register_provider(
    Provider(
        op="rope",
        name="stock",
        devices=("cpu", "cuda", "rocm"),
        dtypes=FLOAT_DTYPES,
        invariant=False,
        numerics="rope/stock-torch",
        fn=stock.rope,
        extras={"backward": stock.rope_backward},
    )
)


# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
from rl_engine.ops.rope import triton as _triton_provider  # noqa: E402

KernelRegistry.register_provider(_triton_provider.PROVIDER, first=True)


def self_test(device: str) -> None:
    """Bitwise row invariance of forward and dX, both layouts (used by ``rl-engine check``)."""
    from rl_engine.testing.invariance import check_row_invariance

    g = torch.Generator(device="cpu").manual_seed(0)
    n = 67
    pos = torch.randint(0, 4096, (n,), generator=g).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, 3, 24, generator=g).to(device=device, dtype=dtype)
        gy = torch.randn(n, 3, 24, generator=g).to(device=device, dtype=dtype)
        for neox in (True, False):
            # rows are addressed by index so that x and positions are sliced together
            def fwd(idx, x=x, neox=neox):
                i = idx.long()
                return rope(x[i], pos[i], rotary_dim=16, is_neox=neox)

            def dx(idx, x=x, gy=gy, neox=neox):
                i = idx.long()
                xi = x[i].clone().requires_grad_(True)
                rope(xi, pos[i], rotary_dim=16, is_neox=neox).backward(gy[i])
                return xi.grad

            idx = torch.arange(float(n), device=device)
            check_row_invariance(fwd, idx, counts=(1, 17, 33), what=f"rope neox={neox}")
            check_row_invariance(dx, idx, counts=(1, 17, 33), what=f"rope dX neox={neox}")
