"""``moe_experts``: SwiGLU experts whose output rows are batch invariant, per top-k slot.

Custom ops: ``rl_engine::moe_experts(x, ids, w13, w2, expert_map, provider) -> y [T, k, H]``
and ``rl_engine::moe_experts_backward(grad, x, ids, w13, w2, expert_map, provider) -> (dx,
dw13, dw2)``. Every output row is bitwise the ``det_gemm`` / ``silu_and_mul`` expert MLP of that
row alone (the launch never depends on how many tokens an expert receives); see
:mod:`rl_engine.ops.moe_experts.reference`.

The grouped form (``moe_experts(..., groups=G)``: the down product through the TP-invariant K
reduction, family ``moe_experts_tp/g<G>[...]``, :mod:`rl_engine.ops.moe_experts.tp`):
``rl_engine::moe_experts_grouped(x, ids, w13, w2, expert_map, groups, provider) -> y`` (with
autograd) and ``rl_engine::moe_experts_subtree(x, ids, w13, w2, groups, expert_map, provider)
-> fp32 [T, k, H]`` (a rank's subtrees; a provider serves them through its ``"subtree"`` extra).
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops._common import (
    check_tensor,
    provider_op,
    register_op,
    register_triton,
    registry_entry,
)
from rl_engine.ops.moe_experts import reference
from rl_engine.registry import KernelRegistry, RLEngineError, resolve_provider

__all__ = ["TokenDroppingError", "UnsupportedMoEError", "moe_experts", "moe_experts_subtree"]

_OP = "moe_experts"


class UnsupportedMoEError(RLEngineError, ValueError):
    """An MoE configuration rl_engine cannot compute invariantly (the message says why)."""


class TokenDroppingError(UnsupportedMoEError):
    """Capacity factors / token dropping: whether a token is dropped depends on the whole
    batch (how many other tokens chose its expert first), so no per-token invariance exists."""


def refuse_token_dropping(where: str, capacity_factor: Any) -> None:
    """Raise :class:`TokenDroppingError` when ``capacity_factor`` is set (``where`` names the
    setting, e.g. ``"moe_expert_capacity_factor"``)."""
    if capacity_factor is not None:
        raise TokenDroppingError(
            f"{where}={capacity_factor!r}: capacity-based token dropping depends on the whole "
            "batch (which other tokens chose the expert first), so a token's output could not "
            "be batch invariant; rl_engine routes every token (set it to None)"
        )


def _fake(x, ids, w13, w2, expert_map):
    reference._check(x, ids, w13, w2, expert_map, values=False)
    return x.new_empty((ids.shape[0], ids.shape[1], x.shape[1]))


_experts_op = provider_op(_OP, "moe_experts", reference.moe_experts, _fake)


def _backward_fake(grad, x, ids, w13, w2, expert_map):
    return torch.empty_like(x), torch.empty_like(w13), torch.empty_like(w2)


_experts_backward_op = provider_op(
    _OP, "moe_experts_backward", reference.moe_experts_backward, _backward_fake, "backward"
)


def _setup_context(ctx, inputs, output):
    x, ids, w13, w2, expert_map, provider = inputs
    ctx.save_for_backward(x, ids, w13, w2, expert_map)
    ctx.provider = provider


def _backward(ctx, grad):
    x, ids, w13, w2, expert_map = ctx.saved_tensors
    dx, dw13, dw2 = _experts_backward_op(grad, x, ids, w13, w2, expert_map, ctx.provider)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, None, dw13 if need[2] else None,
            dw2 if need[3] else None, None, None)  # fmt: skip


_experts_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------ grouped form
def _subtree_fake(x, ids, w13, w2, groups, expert_map):
    reference._check(x, ids, w13, w2, expert_map, values=False)
    return x.new_empty((ids.shape[0], ids.shape[1], x.shape[1]), dtype=torch.float32)


_subtree_op = provider_op(
    _OP, "moe_experts_subtree", reference.moe_experts_subtree, _subtree_fake, "subtree"
)


@torch.library.custom_op("rl_engine::moe_experts_grouped", mutates_args=())
def _grouped_op(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor | None,
    groups: int,
    provider: str,
) -> torch.Tensor:
    from rl_engine.ops.det_gemm.tp import finish

    sub = KernelRegistry.provider(_OP, provider).extras["subtree"]
    return finish(sub(x, ids, w13, w2, groups, expert_map), None, x.dtype)


@_grouped_op.register_fake
def _(x, ids, w13, w2, expert_map, groups, provider):
    return _fake(x, ids, w13, w2, expert_map)


def _grouped_setup_context(ctx, inputs, output):
    x, ids, w13, w2, expert_map, _, provider = inputs
    ctx.save_for_backward(x, ids, w13, w2, expert_map)
    ctx.provider = provider


def _grouped_backward(ctx, grad):
    return (*_backward(ctx, grad)[:4], None, None, None)


# backward: the plain form's (the grouped K reduction changes the forward down product only)
_grouped_op.register_autograd(_grouped_backward, setup_context=_grouped_setup_context)


def _run(x: Any, ids: Any, w13: Any, w2: Any, expert_map: Any, groups: Any,
         provider: str) -> torch.Tensor:  # fmt: skip
    reference._check(
        x, ids, w13, w2, expert_map, groups=groups, values=not torch.compiler.is_compiling()
    )
    if groups is None:
        return _experts_op(x, ids, w13, w2, expert_map, provider)
    provider = tp.resolve(x.device.type, provider)
    return _grouped_op(x, ids, w13, w2, expert_map, groups, provider)


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    groups: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Batch-invariant SwiGLU experts: ``y[t, s]`` = expert ``ids[t, s]``'s MLP of ``x[t]``.

    Args:
        x: [T, H] token rows (float32 / bfloat16 / float16).
        ids: [T, k] global expert ids.
        w13: [E_local, 2 * I, H] gate rows then up rows; w2: [E_local, H, I].
        expert_map: [E_global] global id -> local index or -1 (expert parallelism).
        groups: ``None``: the down product is a plain ``det_gemm`` (family
            ``moe_experts/<provider>``). ``G`` (a power of two dividing ``I``): the grouped form,
            ``finish(moe_experts_subtree(x, ids, w13, w2, G), None, x.dtype)`` (family
            ``moe_experts_tp/g<G>[...]``): the bits of the same experts TP-sharded over any
            degree dividing ``G`` (:mod:`rl_engine.ops.moe_experts.tp`). An engine passes
            ``rl_engine.ops.det_gemm.tp.groups_for(its TP degree)``. The backward is the plain
            form's (``dx``, ``dw13``, ``dw2``: det_gemm's rule; the grouped K reduction changes
            only the forward down product). Raises when the provider has no ``"subtree"``.
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        [T, k, H] in ``x.dtype``; differentiable wrt ``x``, ``w13`` and ``w2``. Combine with
        :func:`rl_engine.ops.moe_combine`.
    """
    check_tensor("x", x)
    provider = resolve_provider(_OP, x.device.type, backend)
    return _run(x, ids, w13, w2, expert_map, groups, provider)


def moe_experts_subtree(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    groups: int,
    *,
    expert_map: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """A rank's fp32 subtrees of the grouped experts (no autograd: the inference form).

    For each (token, slot) routed to a local expert ``e``: ``det_gemm_tp``'s
    ``subtree(silu_and_mul(det_gemm(x[t], w13[e].t())), w2[e].t(), groups)`` in fp32, through
    the ``det_gemm`` provider of the experts provider's family; other slots ``+0``.

    Args:
        x: [T, H] token rows, as :func:`moe_experts`.
        ids: [T, k] global expert ids, as :func:`moe_experts`.
        w13: [E_local, 2 * I_r, H] this rank's shard ``[gate_r; up_r]`` (TP 1: the whole).
        w2: [E_local, H, I_r].
        groups: this rank's group count, ``G / t`` at TP degree ``t``.
        expert_map: as :func:`moe_experts`.
        backend: pin the experts provider (it must have a ``"subtree"`` extra).

    Returns:
        [T, k, H] float32. ``finish(combine([rank subtrees]), None, x.dtype)``
        (:mod:`rl_engine.ops.det_gemm.tp`) == ``moe_experts(..., groups=G)`` on the whole
        weights, bitwise.
    """
    check_tensor("x", x)
    provider = tp.resolve(x.device.type, backend)
    reference._check(
        x, ids, w13, w2, expert_map, groups=groups, values=not torch.compiler.is_compiling()
    )
    return _subtree_op(x, ids, w13, w2, groups, expert_map, provider)


register_op(
    _OP,
    entry=registry_entry(moe_experts, _run),
    native=(
        "moe_experts/native",
        reference.moe_experts,
        {"backward": reference.moe_experts_backward, "subtree": reference.moe_experts_subtree},
    ),
)

# The Triton provider (grouped GEMMs; cuda, cpu through the Triton interpreter).
register_triton(__name__)

# The grouped family (op moe_experts_tp: one provider per moe_experts provider) and the TP
# exchange op; imported last: it mirrors the providers registered above.
from rl_engine.ops.moe_experts import tp  # noqa: E402
