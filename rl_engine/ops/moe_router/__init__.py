"""``moe_router``: a token's top-k experts and their fp32 weights, batch invariant.

Custom ops: ``rl_engine::moe_topk(logits, top_k, scoring, renormalize, provider) ->
(weights, ids)`` and ``rl_engine::moe_topk_backward(grad, logits, weights, ids, scoring,
renormalize, provider) -> dlogits``. The router GEMM is ``det_gemm`` (its own op):
:func:`moe_router` = ``det_gemm(hidden, gate.t())`` then :func:`moe_topk`.
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
from rl_engine.ops.det_gemm import det_gemm
from rl_engine.ops.moe_router import reference
from rl_engine.registry import resolve_provider

__all__ = ["moe_router", "moe_topk"]

_OP = "moe_router"


def _topk_fake(logits, top_k, scoring, renormalize):
    reference._check(logits, top_k, scoring, renormalize)
    t = logits.shape[0]
    return (
        logits.new_empty((t, top_k), dtype=torch.float32),
        logits.new_empty((t, top_k), dtype=torch.int64),
    )


_topk_op = provider_op(_OP, "moe_topk", reference.moe_topk, _topk_fake)


def _topk_backward_fake(grad, logits, weights, ids, scoring, renormalize):
    return torch.empty_like(logits)


_topk_backward_op = provider_op(
    _OP, "moe_topk_backward", reference.moe_topk_backward, _topk_backward_fake, "backward"
)


def _setup_context(ctx, inputs, output):
    logits, _top_k, scoring, renormalize, provider = inputs
    weights, ids = output
    ctx.save_for_backward(logits, weights, ids)
    ctx.scoring, ctx.renormalize, ctx.provider = scoring, renormalize, provider
    ctx.mark_non_differentiable(ids)


def _backward(ctx, grad, _grad_ids):
    logits, weights, ids = ctx.saved_tensors
    if grad is None or not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    dl = _topk_backward_op(grad, logits, weights, ids, ctx.scoring, ctx.renormalize, ctx.provider)
    return dl, None, None, None, None


_topk_op.register_autograd(_backward, setup_context=_setup_context)


def _run(logits: Any, top_k: Any, scoring: Any, renormalize: Any, provider: str) -> Any:
    reference._check(logits, top_k, scoring, renormalize)
    return _topk_op(logits, top_k, scoring, bool(renormalize), provider)


def moe_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token's top-k experts from its router logits (see
    :func:`rl_engine.ops.moe_router.reference.moe_topk` for the exact numerics and the tie rule).

    Args:
        logits: [T, E] router logits (model dtype).
        top_k: experts per token (1 <= top_k <= E).
        scoring: ``"softmax"`` (Qwen3-MoE, Qwen2-MoE) or ``"topk_softmax"`` (Mixtral).
        renormalize: with ``"softmax"``: the k weights divided by their sum (``norm_topk_prob``).
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        ``(weights, ids)``: [T, top_k] fp32 (differentiable wrt ``logits``) and [T, top_k] int64.
    """
    check_tensor("logits", logits)
    provider = resolve_provider(_OP, logits.device.type, backend)
    return _run(logits, top_k, scoring, renormalize, provider)


def moe_router(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits through ``det_gemm`` (model dtype), then :func:`moe_topk`.

    Args:
        hidden: [T, H] hidden rows.
        gate_weight: [E, H] router weight (``nn.Linear`` layout).
        top_k: as :func:`moe_topk`.
        scoring: as :func:`moe_topk`.
        renormalize: as :func:`moe_topk`.
        backend: pins the top-k provider (as :func:`moe_topk`); the GEMM resolves
            ``det_gemm``'s own.

    Returns:
        ``(weights [T, k] fp32, ids [T, k] int64, logits [T, E] in hidden.dtype)``.
    """
    check_tensor("hidden", hidden, dims=2)
    check_tensor("gate_weight", gate_weight, dims=2)
    if gate_weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"moe_router: gate_weight {tuple(gate_weight.shape)} does not match hidden "
            f"{tuple(hidden.shape)} (expected [E, {hidden.shape[1]}])"
        )
    logits = det_gemm(hidden, gate_weight.t())
    weights, ids = moe_topk(
        logits, top_k, scoring=scoring, renormalize=renormalize, backend=backend
    )
    return weights, ids, logits


register_op(
    _OP,
    entry=registry_entry(moe_topk, _run),
    native=("moe_router/native", reference),
    extras=("backward",),
    fn="moe_topk",
)

# The Triton provider (one launch; the reference's bits; cuda, cpu through the interpreter).
register_triton(__name__)
