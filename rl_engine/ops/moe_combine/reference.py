"""PyTorch reference of ``moe_combine`` (the ``native`` provider): a token's expert outputs,
weighted and added.

Numerics (family ``moe_combine/native``), per token row, in fp32, one rounding at the end::

    acc = 0
    for s in 0 .. k-1:                         # top-k slot order, never arrival order
        acc = acc + weights[:, s] * y[:, s].float()
    if shared is not None:                     # the shared expert joins last, in the same sum
        g = sigmoid(shared_gate.float()) if shared_gate is not None else 1
        acc = acc + g * shared.float()
    out = acc.to(y.dtype)

``sigmoid`` is :func:`rl_engine.ops._math.sigmoid`. The order of the additions is fixed by the
slot index, so the result does not depend on where an expert ran (expert parallelism) or when
its rows arrived. Backward (fp32, one rounding each)::

    dy[:, s]     = (weights[:, s] * g).to(y.dtype)          g = grad.float()
    dweights[:, s] = tree_sum(g * y[:, s].float())           # fp32
    dshared      = (gate * g).to(shared.dtype)
    dshared_gate = (tree_sum(g * shared.float()) * gate * (1 - gate)).to(shared_gate.dtype)
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import check_float, check_same_device, check_tensor, tree_sum
from rl_engine.ops._math import sigmoid


def _check(
    y: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None,
    shared_gate: torch.Tensor | None,
) -> None:
    check_tensor("y", y, dims=3)
    check_tensor("weights", weights, dims=2)
    check_float("y", y)
    check_same_device(y=y, weights=weights, shared=shared, shared_gate=shared_gate)
    if weights.dtype != torch.float32:
        raise TypeError(f"moe_combine: weights must be float32 (moe_topk's), got {weights.dtype}")
    t, k, h = y.shape
    if tuple(weights.shape) != (t, k):
        raise ValueError(f"moe_combine: weights {tuple(weights.shape)} must be [T={t}, k={k}]")
    if shared is not None:
        check_tensor("shared", shared, dims=2)
        if tuple(shared.shape) != (t, h) or shared.dtype != y.dtype:
            raise ValueError(
                f"moe_combine: shared {tuple(shared.shape)} {shared.dtype} must be "
                f"[T={t}, H={h}] {y.dtype}"
            )
    if shared_gate is not None:
        if shared is None:
            raise ValueError("moe_combine: shared_gate given without shared")
        check_tensor("shared_gate", shared_gate, dims=2)
        check_float("shared_gate", shared_gate)
        if tuple(shared_gate.shape) != (t, 1):
            raise ValueError(
                f"moe_combine: shared_gate {tuple(shared_gate.shape)} must be [T={t}, 1]"
            )


def moe_combine(
    y: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_s weights[:, s] * y[:, s] (+ gate * shared)`` in fp32, slot order, one rounding.

    Equivalent to ``(weights[..., None] * y.float()).sum(1) + sigmoid(shared_gate) * shared``
    rounded to ``y.dtype`` (HF Qwen2-MoE's shared expert: ``sigmoid(gate(x)) * mlp(x)``).

    Args:
        y: [T, k, H] expert outputs per top-k slot (``moe_experts``'), float32 / bf16 / fp16.
        weights: [T, k] float32 routing weights (``moe_topk``'s).
        shared: optional [T, H] shared-expert output, ``y.dtype``.
        shared_gate: optional [T, 1] shared-expert gate logits (sigmoid applied here).

    Returns:
        [T, H] in ``y.dtype``.
    """
    _check(y, weights, shared, shared_gate)
    acc = torch.zeros((y.shape[0], y.shape[2]), dtype=torch.float32, device=y.device)
    for s in range(y.shape[1]):
        acc = acc + weights[:, s : s + 1] * y[:, s].float()
    if shared is not None:
        if shared_gate is not None:
            acc = acc + sigmoid(shared_gate) * shared.float()
        else:
            acc = acc + shared.float()
    return acc.to(y.dtype)


def moe_combine_backward(
    grad: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dy, dweights, dshared, dshared_gate)`` (module docstring); ``dshared`` /
    ``dshared_gate`` are empty tensors where the input was not given."""
    g = grad.float()
    dy = (weights.unsqueeze(-1) * g.unsqueeze(1)).to(y.dtype)
    dw = tree_sum(g.unsqueeze(1) * y.float(), dim=-1)
    dshared, dgate = y.new_empty(0), y.new_empty(0)
    if shared is not None:
        if shared_gate is not None:
            gate = sigmoid(shared_gate)
            dshared = (gate * g).to(shared.dtype)
            ds = tree_sum(g * shared.float(), dim=-1).unsqueeze(-1)
            dgate = (ds * (gate * (1.0 - gate))).to(shared_gate.dtype)
        else:
            dshared = g.to(shared.dtype, copy=True)
    return dy, dw, dshared, dgate
