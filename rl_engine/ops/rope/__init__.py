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

from rl_engine.ops._common import (
    check_tensor,
    provider_op,
    register_op,
    register_triton,
    registry_entry,
)
from rl_engine.ops.rope import reference, stock
from rl_engine.registry import Provider, resolve_provider

__all__ = ["rope", "rope_qk"]


_OP = "rope"

# The scaling dict travels as its canonical scalars (:func:`reference.canonical_scaling`), last
# before the provider name; the ops' bodies rebuild the dict for the providers.
_SCALING = (
    "str rope_type, float factor, float low_freq_factor, float high_freq_factor, "
    "SymInt original_max_position_embeddings"
)
_N_SCALING = len(_SCALING.split(","))
_ARG_TYPES = {"rotary_dim": "SymInt", "scaling": _SCALING}


def _op(name: str, spec: Any, extra: str | None, n: int, backward: Any = None) -> Any:
    """The custom op ``rl_engine::<name>`` (:func:`provider_op`) of ``spec``, a reference function
    of ``n`` rotated tensors, ``positions`` and the parameters (the scaling dict as its scalars).

    Its body runs the provider's ``fn`` (``extra=None``) or ``extras[extra]`` with the scaling
    dict rebuilt and returns the rotated tensors contiguous (one tensor, or a tuple of them); the
    fake gives outputs shaped like the inputs. With ``backward`` (the op of the inverse rotation,
    same arguments), the op is differentiable in its tensors: their gradients are ``backward`` of
    the incoming ones in the input dtype (``positions`` and the scalars get none).
    """

    def call(p: Provider, *args: Any) -> Any:
        fn = p.fn if extra is None else p.extras[extra]
        return fn(*args[:-_N_SCALING], reference.scaling_dict(args[-_N_SCALING:]))

    def fake(*args: Any) -> Any:
        outs = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in args[:n])
        return outs[0] if n == 1 else outs

    op = provider_op(_OP, name, spec, fake, call=call, contiguous=True, arg_types=_ARG_TYPES)
    if backward is None:
        return op
    n_params = 3 + _N_SCALING + 1  # theta, rotary_dim, is_neox, the scaling, the provider

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[n])  # positions
        ctx.params = inputs[n + 1 :]
        ctx.dtype = inputs[0].dtype

    def grad_fn(ctx, *grads):
        # (autograd materialises the gradient of an unused output as zeros)
        (positions,) = ctx.saved_tensors
        if not any(ctx.needs_input_grad[:n]):
            return (None,) * (n + 1 + n_params)
        d = backward(*(g.to(ctx.dtype) for g in grads), positions, *ctx.params)
        return ((d,) if n == 1 else tuple(d)) + (None,) * (1 + n_params)

    op.register_autograd(grad_fn, setup_context=setup_context)
    return op


_rope_backward_op = _op("rope_backward", reference.rope_backward, "backward", 1)
_rope_op = _op("rope", reference.rope, None, 1, _rope_backward_op)
_rope_qk_backward_op = _op("rope_qk_backward", reference.rope_qk_backward, "qk_backward", 2)
_rope_qk_op = _op("rope_qk", reference.rope_qk, "qk", 2, _rope_qk_backward_op)


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
        q: [T, Hq, D].
        k: [T, Hk, D] (the same T, D and dtype as ``q``).
        positions: as :func:`rope`.
        theta: as :func:`rope`.
        rotary_dim: as :func:`rope`.
        is_neox: as :func:`rope`.
        scaling: as :func:`rope`.
        backend: as :func:`rope`.

    Returns:
        ``(q_rotated, k_rotated)``, each in the input's shape and dtype.
    """
    check_tensor("q", q)
    check_tensor("k", k)
    provider = resolve_provider(_OP, q.device.type, backend)
    rotary_dim, canon = reference._check(q, positions, theta, rotary_dim, is_neox, scaling)
    if k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or k.dtype != q.dtype:
        raise ValueError(
            f"rope_qk: k {tuple(k.shape)} {k.dtype} does not go with q {tuple(q.shape)} "
            f"{q.dtype} (same tokens, head dim and dtype)"
        )
    reference._check(k, positions, theta, rotary_dim, is_neox, scaling)
    reference.check_positions(positions)
    return _rope_qk_op(q, k, positions, float(theta), rotary_dim, is_neox, *canon, provider)


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
        positions: [T] int32 / int64, each >= 0 (a negative one is refused: at once for CPU
            tensors, by a device-side assert with ``RL_ENGINE_DEVICE_CHECKS=1`` on a GPU; see
            :func:`rl_engine.ops.rope.reference.check_positions`).
        theta: the RoPE base.
        rotary_dim: rotated channels (even, <= head_dim; default head_dim); the rest pass through.
        is_neox: rotate-half layout (True: Llama / Qwen) or GPT-J interleaved pairs (False).
        scaling: None or a Hugging Face ``rope_scaling`` dict (``default``, ``linear``,
            ``llama3``); other types raise.
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        [T, heads, head_dim] in ``x.dtype``. See :func:`rl_engine.ops.rope.reference.rope`.
    """
    check_tensor("x", x)  # the full check runs once, in _run
    provider = resolve_provider(_OP, x.device.type, backend)
    return _run(x, positions, theta, rotary_dim, is_neox, scaling, provider)


def _run(x, positions, theta, rotary_dim, is_neox, scaling, provider: str) -> torch.Tensor:
    """The op through ``provider`` on :func:`rope`'s arguments (checked here, once)."""
    rotary_dim, canon = reference._check(x, positions, theta, rotary_dim, is_neox, scaling)
    reference.check_positions(positions)
    return _rope_op(x, positions, float(theta), rotary_dim, is_neox, *canon, provider)


register_op(
    _OP,
    entry=registry_entry(rope, _run),
    native=("rope/native-f64table", reference),
    stock=("rope/stock-torch", stock),
    extras=("backward", "qk", "qk_backward"),
)


# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
