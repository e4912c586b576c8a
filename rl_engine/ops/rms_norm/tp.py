"""A weight gradient of ``rms_norm`` that sequence parallelism cannot change: row groups.

With sequence parallelism a norm runs on each tensor-parallel rank's block of the token rows,
so each rank holds a partial weight gradient over its rows, and Megatron's finalize step adds the
ranks' partials with an all-reduce (an order NCCL picks, and never the single-GPU order: the
provider's weight gradient is a chain over its row chunks, which has no rank-sized subtrees).

Numerics (family ``rms_norm_tp/g<G>[<rms_norm family>]``), under ``RL_ENGINE_TP_GROUPS`` like
the grouped GEMM reduction of :mod:`rl_engine.ops.det_gemm.tp`:

* the ``M`` rows are cut into ``G`` contiguous **row groups** of ``ceil(M / G)`` rows (the last
  ones shorter or empty; ``G = 8``, fixed, never derived from the TP degree);
* each group's fp32 weight gradient is the provider's own (``rms_norm_wgrad`` of the group's
  rows: the family's fixed chunk order, starting at the group's first row);
* the ``G`` partials are added by the adjacent-pair tree
  (:func:`rl_engine.ops.det_gemm.tp.pair_tree`), then rounded once to the weight's dtype.

Rank ``r`` of ``t`` (``t`` dividing ``G``) holds rows ``[r M / t, (r + 1) M / t)``: exactly
groups ``[r G / t, (r + 1) G / t)`` when ``G`` divides ``M``. It computes that subtree; the ranks
all-gather their fp32 ``[H]`` subtrees (``t - 1`` vectors of ``H`` floats received per norm: a
few KiB) and every rank adds them with the tree's top levels: the TP = 1 bits on every rank, so
no later all-reduce is needed (the Megatron norm then unmarks its weight as
``sequence_parallel``). The input gradient is the op's own (row invariant: exact under any row
split).
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import tree_sum
from rl_engine.ops.det_gemm.tp import Exchange, allowed_degrees, pair_tree
from rl_engine.registry import KernelRegistry, resolve_provider

__all__ = ["head_wgrad", "rms_norm_heads_tp", "row_group_wgrad", "rms_norm_tp"]


def row_group_wgrad(grad: torch.Tensor, r: torch.Tensor, eps: float, groups: int,
                    provider: str) -> torch.Tensor:  # fmt: skip
    """fp32 [H] pair-tree sum of the weight gradients of ``groups`` row groups of ``r`` [..., H]
    (``ceil(M / groups)`` rows each). A rank passes its rows and its number of groups."""
    if groups < 1 or groups & (groups - 1):
        raise ValueError(f"rms_norm_tp: the group count must be a power of two, got {groups}")
    h = r.shape[-1]
    r2, g2 = r.reshape(-1, h), grad.reshape(-1, h)
    size = -(-r2.shape[0] // groups)
    wgrad = KernelRegistry.provider("rms_norm", provider).extras["wgrad"]
    parts = [wgrad(g2[i * size : (i + 1) * size], r2[i * size : (i + 1) * size], eps)
             for i in range(groups)]  # fmt: skip
    return pair_tree(torch.stack(parts))


def head_wgrad(grad: torch.Tensor, r: torch.Tensor, eps: float, provider: str) -> torch.Tensor:
    """fp32 [n_heads, D]: each head's weight gradient of ``r`` [..., n_heads, D] (the provider's
    own, over that head's rows in order)."""
    wgrad = KernelRegistry.provider("rms_norm", provider).extras["wgrad"]
    return torch.stack([wgrad(grad[..., h, :], r[..., h, :], eps) for h in range(r.shape[-2])])


class _WeightGradOf(torch.autograd.Function):
    """Identity on ``y`` forward; backward passes ``grad`` on to ``y`` and gives ``weight``
    ``wgrad(grad, r)`` (``r`` gets none here: its gradient flows through ``y``'s own
    backward)."""

    @staticmethod
    def forward(ctx, y, r, weight, wgrad):
        ctx.save_for_backward(r)
        ctx.meta = (wgrad, weight.dtype)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        wgrad, dtype = ctx.meta
        dw = wgrad(grad.to(r.dtype), r).to(dtype) if ctx.needs_input_grad[2] else None
        return grad, None, dw, None


def _with_wgrad(x, weight, eps, backend, wgrad) -> torch.Tensor:
    """``rms_norm(x, weight, eps)`` whose weight gradient is ``wgrad(grad, x, provider)``."""
    from rl_engine import ops

    provider = resolve_provider("rms_norm", x.device.type, backend)
    y = ops.rms_norm(x, weight.detach(), eps, backend=provider)
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return y
    return _WeightGradOf.apply(y, x.detach(), weight, lambda g, r: wgrad(g, r, provider))


def rms_norm_tp(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, groups: int = 8,
                exchange: Exchange | None = None,
                backend: str | None = None) -> torch.Tensor:  # fmt: skip
    """``rms_norm(x, weight, eps)`` whose weight gradient is the row-grouped one (module doc).

    Args:
        x: [..., H]: all rows, or with sequence parallelism this rank's block of the rows (the
            leading dims flattened in order: Megatron's ``[s / t, b, H]`` block is rows
            ``[r M / t, (r + 1) M / t)`` of the ``[s, b, H]`` whole).
        weight: [H], replicated.
        groups: the row-group count ``G`` of the whole (TP = 1) rows.
        exchange: the TP group's :class:`~rl_engine.ops.det_gemm.tp.Exchange` when ``x`` is a
            sequence-parallel block (``None``: ``x`` holds every row).
        backend: pin the rms_norm provider (raises when it cannot run).
    Returns:
        ``y`` as :func:`rl_engine.ops.rms_norm`; ``weight.grad`` the same bits on every rank and
        at every TP degree in ``allowed_degrees(groups)``.
    """
    world = 1 if exchange is None else exchange.world
    if world not in allowed_degrees(groups):
        raise ValueError(
            f"rms_norm_tp: tensor-parallel degree {world} does not divide the {groups} row "
            f"groups; allowed degrees: {allowed_degrees(groups)}"
        )
    local = groups // world
    rows = x.numel() // max(x.shape[-1], 1)
    if world > 1 and rows % local:
        raise ValueError(
            f"rms_norm_tp: this rank's {rows} token rows do not split into its {local} of the "
            f"{groups} row groups; with sequence parallelism the token count (sequence x batch) "
            f"must be a multiple of {groups}"
        )

    def wgrad(g, r, provider):
        sub = row_group_wgrad(g, r, eps, local, provider)
        if world == 1:
            return sub
        return pair_tree(exchange.all_gather(sub.contiguous()[None]))  # [t, H]: rank order

    return _with_wgrad(x, weight, eps, backend, wgrad)


def rms_norm_heads_tp(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                      exchange: Exchange | None = None, sole: bool = False,
                      backend: str | None = None) -> torch.Tensor:  # fmt: skip
    """A per-head norm (Qwen3's q / k norm) of a tensor-parallel rank's heads whose weight
    gradient does not depend on the TP degree (family ``rms_norm_heads_tp[<rms_norm family>]``):
    one weight gradient per head (the provider's, over the head's rows), the ranks' per-head
    ``[heads, D]`` fp32 partials all-gathered (rank ``r`` holds the ``r``-th block of heads), and
    the heads summed by :func:`~rl_engine.ops._common.tree_sum` (a fixed pairwise order that
    depends on the head count only).

    Args:
        x: [..., heads_local, D]; weight: [D], replicated.
        exchange: the TP group's :class:`~rl_engine.ops.det_gemm.tp.Exchange` (``None``: every
            head is here).
        sole: give the gradient to TP rank 0 only and zeros to the others: for a trainer whose
            finalize step adds the ranks' gradients of these weights (Megatron does, by name):
            ``g + 0 + ... + 0`` is ``g`` exactly in any order.
    """
    world = 1 if exchange is None else exchange.world

    def wgrad(g, r, provider):
        parts = head_wgrad(g, r, eps, provider)
        if world > 1:
            parts = exchange.all_gather(parts.contiguous())  # [t * heads_local, D]
        dw = tree_sum(parts, dim=0)
        return torch.zeros_like(dw) if sole and exchange is not None and exchange.rank else dw

    return _with_wgrad(x, weight, eps, backend, wgrad)
