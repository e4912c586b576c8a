"""PyTorch reference of ``grouped_poly_norm`` (the ``native`` provider): PolyNorm-activated
experts (Motif's MoE), ``poly_norm(gate) * up`` with each row's expert's weights.

Numerics (family ``grouped_poly_norm/native``): row ``n`` with expert ``e = expert_ids[n]`` is
bitwise ``fused_mul_poly_norm(gate[n], up[n], weight[e], bias[e], eps)`` of the ``poly_norm``
``native`` provider (:mod:`rl_engine.ops.poly_norm.reference`), forward and input gradients.
The parameter gradients of expert ``e`` are that op's ``dweight`` / ``dbias`` over the rows of
expert ``e`` in row order (its fixed pairwise ``sum_rows``): deterministic, and zero rows of
an expert add exact zeros. Rows are usually grouped by expert (tokens sorted by expert, as the
grouped GEMMs produce them), but any order gives every row the same bits.
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import check_float, check_same_device, check_tensor, check_tensors
from rl_engine.ops.poly_norm import reference as poly


def _check(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    expert_ids: torch.Tensor,
    eps: float,
    *,
    values: bool = True,
) -> None:
    check_tensors(2, gate=gate, up=up, weight=weight, bias=bias)
    check_tensor("expert_ids", expert_ids, dims=1)
    check_float("gate", gate)
    check_float("weight", weight)
    check_float("bias", bias)
    check_same_device(gate=gate, up=up, weight=weight, bias=bias, expert_ids=expert_ids)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(
            f"grouped_poly_norm: up {tuple(up.shape)} {up.dtype} must match gate "
            f"{tuple(gate.shape)} {gate.dtype}"
        )
    if gate.shape[1] == 0:
        raise ValueError("grouped_poly_norm: the hidden size (last dim of gate) must be > 0")
    n_experts = weight.shape[0]
    if weight.shape[1] != 3 or tuple(bias.shape) != (n_experts, 1):
        raise ValueError(
            f"grouped_poly_norm: weight {tuple(weight.shape)} / bias {tuple(bias.shape)} must be "
            f"[E, 3] / [E, 1]"
        )
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"grouped_poly_norm: expert_ids must be int32 / int64, got {expert_ids.dtype}"
        )
    if expert_ids.shape[0] != gate.shape[0]:
        raise ValueError(
            f"grouped_poly_norm: expert_ids has {expert_ids.shape[0]} rows, gate {gate.shape[0]}"
        )
    if not eps > 0:
        raise ValueError(f"grouped_poly_norm: eps must be > 0, got {eps}")
    if values and expert_ids.numel() and expert_ids.device.type == "cpu":
        ok = (expert_ids >= 0) & (expert_ids < n_experts)
        if not bool(ok.all()):
            raise ValueError(
                f"grouped_poly_norm: expert ids must be in [0, {n_experts}); found "
                f"{expert_ids[~ok][:3].tolist()}"
            )


def _groups(expert_ids: torch.Tensor, n_experts: int):
    for e in range(n_experts):
        rows = (expert_ids == e).nonzero().flatten()
        if rows.numel():
            yield e, rows


def grouped_poly_norm(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    expert_ids: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``poly_norm(gate[n], weight[e], bias[e], eps) * up[n]``, ``e = expert_ids[n]``.

    Args:
        gate, up: [N, D] float32 / bfloat16 / float16 rows (the expert's fused gate/up GEMM
            output, split).
        weight: [E, 3] per-expert PolyNorm weights; bias: [E, 1].
        expert_ids: [N] int32 / int64, each row's expert.
        eps: added to each mean square.

    Returns:
        [N, D] in ``gate.dtype``.
    """
    _check(gate, up, weight, bias, expert_ids, eps)
    out = torch.empty_like(gate)
    for e, rows in _groups(expert_ids, weight.shape[0]):
        out[rows] = poly.fused_mul_poly_norm(gate[rows], up[rows], weight[e], bias[e], eps)
    return out


def grouped_poly_norm_backward(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    expert_ids: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dgate, dup, dweight [E, 3] fp32, dbias [E, 1] fp32)`` (module docstring)."""
    dgate = torch.zeros_like(gate)
    dup = torch.zeros_like(up)
    dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    dbias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    for e, rows in _groups(expert_ids, weight.shape[0]):
        dx, dmul, dw, db = poly.poly_norm_backward(
            grad[rows], gate[rows], weight[e], bias[e], eps, up[rows]
        )
        dgate[rows], dup[rows], dweight[e], dbias[e] = dx, dmul, dw, db
    return dgate, dup, dweight, dbias
