"""``grouped_poly_norm``: PolyNorm-activated experts, ``poly_norm(gate) * up`` per expert.

Custom ops: ``rl_engine::grouped_poly_norm(gate, up, weight, bias, expert_ids, eps, provider)``
and ``rl_engine::grouped_poly_norm_backward(grad, gate, up, weight, bias, expert_ids, eps,
provider) -> (dgate, dup, dweight, dbias)``. Each row is bitwise ``fused_mul_poly_norm`` with its
expert's weights (:mod:`rl_engine.ops.grouped_poly_norm.reference`).
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
from rl_engine.ops.grouped_poly_norm import reference
from rl_engine.registry import resolve_provider

__all__ = ["grouped_poly_norm"]

_OP = "grouped_poly_norm"


def _fake(gate, up, weight, bias, expert_ids, eps):
    reference._check(gate, up, weight, bias, expert_ids, eps, values=False)
    return torch.empty_like(gate)


_op = provider_op(_OP, _OP, reference.grouped_poly_norm, _fake)


def _backward_fake(grad, gate, up, weight, bias, expert_ids, eps):
    return (torch.empty_like(gate), torch.empty_like(up),
            torch.empty_like(weight, dtype=torch.float32),
            torch.empty_like(bias, dtype=torch.float32))  # fmt: skip


_backward_op = provider_op(
    _OP, f"{_OP}_backward", reference.grouped_poly_norm_backward, _backward_fake, "backward"
)


def _setup_context(ctx, inputs, output):
    gate, up, weight, bias, expert_ids, eps, provider = inputs
    ctx.save_for_backward(gate, up, weight, bias, expert_ids)
    ctx.eps, ctx.provider = eps, provider


def _backward(ctx, grad):
    gate, up, weight, bias, expert_ids = ctx.saved_tensors
    dg, du, dw, db = _backward_op(grad, gate, up, weight, bias, expert_ids, ctx.eps, ctx.provider)
    return dg, du, dw.to(weight.dtype), db.to(bias.dtype), None, None, None


_op.register_autograd(_backward, setup_context=_setup_context)


def _run(gate: Any, up: Any, weight: Any, bias: Any, expert_ids: Any, eps: Any,
         provider: str) -> torch.Tensor:  # fmt: skip
    reference._check(gate, up, weight, bias, expert_ids, eps,
                     values=not torch.compiler.is_compiling())  # fmt: skip
    return _op(gate, up, weight, bias, expert_ids, float(eps), provider)


def grouped_poly_norm(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    expert_ids: torch.Tensor,
    eps: float = 1e-6,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``poly_norm(gate[n]) * up[n]`` with the weights of row ``n``'s expert.

    Args:
        gate: [N, D] rows.
        up: [N, D] rows (the same N, D and dtype as ``gate``).
        weight: [E, 3], one row per expert.
        bias: [E, 1].
        expert_ids: [N] int, the expert of each row.
        eps: added to each mean square.
        backend: pin a provider for this call (raises when it cannot run).

    Returns:
        [N, D] in ``gate.dtype``; differentiable wrt gate, up, weight, bias (the parameter
        gradients per expert, deterministic).
    """
    check_tensor("gate", gate)
    provider = resolve_provider(_OP, gate.device.type, backend)
    return _run(gate, up, weight, bias, expert_ids, eps, provider)


register_op(
    _OP,
    entry=registry_entry(grouped_poly_norm, _run),
    native=("grouped_poly_norm/native", reference),
    extras=("backward",),
)

# The Triton provider (cuda; cpu through the Triton interpreter): first choice on the GPU.
register_triton(__name__)
