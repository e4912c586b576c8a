"""``rope``: batch-invariant rotary position embedding with tables computed inside the op.

Custom ops (the scaling dict travels as its canonical scalars):

* ``rl_engine::rope(x, positions, theta, rotary_dim, is_neox, rope_type, factor,
  low_freq_factor, high_freq_factor, original_max_position_embeddings, provider) -> y``
* ``rl_engine::rope_backward(grad, positions, ...same..., provider) -> dx`` (inverse rotation;
  ``positions`` gets no gradient).
* ``rl_engine::rope_qk(q, k, positions, ...same...) -> (q_out, k_out)`` and
  ``rl_engine::rope_qk_backward``: both tensors of an attention layer in one op (bitwise the
  one-tensor op on each).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl_engine.ops._common import check_tensor, register_op, register_triton
from rl_engine.ops.rope import reference, stock
from rl_engine.registry import KernelRegistry, resolve_provider

__all__ = ["rope", "rope_qk"]


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


def _call_qk(extra, q, k, positions, theta, rotary_dim, is_neox, canon, provider):
    fn = KernelRegistry.provider("rope", provider).extras[extra]
    yq, yk = fn(q, k, positions, theta, rotary_dim, is_neox, reference.scaling_dict(canon))
    return yq.contiguous(), yk.contiguous()


@torch.library.custom_op("rl_engine::rope_qk", mutates_args=())
def _rope_qk_op(
    q: torch.Tensor,
    k: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    canon = (rope_type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    return _call_qk("qk", q, k, positions, theta, rotary_dim, is_neox, canon, provider)


@_rope_qk_op.register_fake
def _(q, k, positions, theta, rotary_dim, is_neox, rope_type, factor, low, high, orig, provider):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
    )


@torch.library.custom_op("rl_engine::rope_qk_backward", mutates_args=())
def _rope_qk_backward_op(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    canon = (rope_type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    return _call_qk(
        "qk_backward", grad_q, grad_k, positions, theta, rotary_dim, is_neox, canon, provider
    )


@_rope_qk_backward_op.register_fake
def _(gq, gk, positions, theta, rotary_dim, is_neox, rope_type, factor, low, high, orig, provider):
    return (
        torch.empty(gq.shape, dtype=gq.dtype, device=gq.device),
        torch.empty(gk.shape, dtype=gk.dtype, device=gk.device),
    )


def _setup_context_qk(ctx, inputs, output):
    q, k, positions, *params = inputs
    ctx.save_for_backward(positions)
    ctx.params = params
    ctx.dtype = q.dtype


def _backward_qk(ctx, grad_q, grad_k):
    # (autograd materialises the gradient of an unused output as zeros)
    (positions,) = ctx.saved_tensors
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return (None,) * 12
    dq, dk = _rope_qk_backward_op(
        grad_q.to(ctx.dtype), grad_k.to(ctx.dtype), positions, *ctx.params
    )
    return (dq, dk) + (None,) * 10


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
_rope_qk_op.register_autograd(_backward_qk, setup_context=_setup_context_qk)


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


def _entry_qk(
    q, k, positions, theta=10000.0, rotary_dim=None, is_neox=True, scaling=None, *, provider
):
    rotary_dim, canon = reference._check(q, positions, theta, rotary_dim, is_neox, scaling)
    if k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or k.dtype != q.dtype:
        raise ValueError(
            f"rope_qk: k {tuple(k.shape)} {k.dtype} does not go with q {tuple(q.shape)} "
            f"{q.dtype} (same tokens, head dim and dtype)"
        )
    reference._check(k, positions, theta, rotary_dim, is_neox, scaling)
    return _rope_qk_op(q, k, positions, float(theta), rotary_dim, is_neox, *canon, provider)


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    is_neox: bool = True,
    scaling: Mapping[str, Any] | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope` of the queries and the keys of the same tokens in one op.

    Bitwise ``(rope(q, ...), rope(k, ...))`` (same provider); the Triton provider rotates both in
    one launch and evaluates the cos / sin tables once per token.

    Args:
        q: [T, Hq, D]; k: [T, Hk, D] (same T, D and dtype).
        positions, theta, rotary_dim, is_neox, scaling, backend: as :func:`rope`.

    Returns:
        ``(q_rotated, k_rotated)``, each in the input's shape and dtype.
    """
    check_tensor("q", q)
    check_tensor("k", k)
    provider = resolve_provider("rope", q.device.type, backend)
    return _entry_qk(q, k, positions, theta, rotary_dim, is_neox, scaling, provider=provider)


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


register_op(
    "rope",
    entry=_entry,
    native=(
        "rope/native-f64table",
        reference.rope,
        {
            "backward": reference.rope_backward,
            "qk": reference.rope_qk,
            "qk_backward": reference.rope_qk_backward,
        },
    ),
    stock=(
        "rope/stock-torch",
        stock.rope,
        {
            "backward": stock.rope_backward,
            "qk": reference.on_q_and_k(stock.rope),
            "qk_backward": reference.on_q_and_k(stock.rope_backward),
        },
    ),
)


# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)


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
