"""``moe_combine``: a token's k expert outputs (and shared experts) added in slot order.

Custom ops: ``rl_engine::moe_combine(y, weights, shared, shared_gate, provider) -> out`` and
``rl_engine::moe_combine_backward(grad, y, weights, shared, shared_gate, provider)``; see
:mod:`rl_engine.ops.moe_combine.reference` for the exact order of the sum.
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
from rl_engine.ops.moe_combine import reference
from rl_engine.registry import resolve_provider

__all__ = ["moe_combine"]

_OP = "moe_combine"


def _fake(y, weights, shared, shared_gate):
    reference._check(y, weights, shared, shared_gate)
    return y.new_empty((y.shape[0], y.shape[2]))


_combine_op = provider_op(_OP, "moe_combine", reference.moe_combine, _fake)


def _backward_fake(grad, y, weights, shared, shared_gate):
    empty = y.new_empty(0)
    return (
        torch.empty_like(y),
        torch.empty_like(weights),
        torch.empty_like(shared) if shared is not None else empty,
        torch.empty_like(shared_gate) if shared_gate is not None else empty,
    )


_combine_backward_op = provider_op(
    _OP, "moe_combine_backward", reference.moe_combine_backward, _backward_fake, "backward"
)


def _setup_context(ctx, inputs, output):
    y, weights, shared, shared_gate, provider = inputs
    ctx.save_for_backward(y, weights, shared, shared_gate)
    ctx.provider = provider


def _backward(ctx, grad):
    y, weights, shared, shared_gate = ctx.saved_tensors
    dy, dw, dshared, dgate = _combine_backward_op(
        grad, y, weights, shared, shared_gate, ctx.provider
    )
    need = ctx.needs_input_grad
    return (
        dy if need[0] else None,
        dw if need[1] else None,
        dshared if shared is not None and need[2] else None,
        dgate if shared_gate is not None and need[3] else None,
        None,
    )


_combine_op.register_autograd(_backward, setup_context=_setup_context)


def _run(y: Any, weights: Any, shared: Any, shared_gate: Any, provider: str) -> torch.Tensor:
    reference._check(y, weights, shared, shared_gate)
    return _combine_op(y, weights, shared, shared_gate, provider)


def moe_combine(
    y: torch.Tensor,
    weights: torch.Tensor,
    *,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``sum_s weights[:, s] * y[:, s]`` (+ the shared expert, sigmoid-gated when
    ``shared_gate`` is given) in fp32, top-k slot order, one rounding.

    Args:
        y: [T, k, H] expert outputs (``moe_experts``').
        weights: [T, k] fp32 routing weights (``moe_topk``'s).
        shared: optional [T, H] shared-expert output; shared_gate: optional [T, 1] its gate
            logits (Qwen2-MoE).
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        [T, H] in ``y.dtype``; differentiable wrt every tensor input.
    """
    check_tensor("y", y)
    provider = resolve_provider(_OP, y.device.type, backend)
    return _run(y, weights, shared, shared_gate, provider)


register_op(
    _OP,
    entry=registry_entry(moe_combine, _run),
    native=("moe_combine/native", reference),
    extras=("backward",),
)

# The Triton provider (one launch; the reference's bits; cuda, cpu through the interpreter).
register_triton(__name__)
