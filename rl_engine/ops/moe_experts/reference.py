"""PyTorch reference of ``moe_experts`` (the ``native`` provider): SwiGLU experts, per slot.

Numerics (family ``moe_experts/native``): for every token ``t`` and top-k slot ``s`` with
expert ``e = ids[t, s]`` (a local expert)::

    y[t, s] = det_gemm(silu_and_mul(det_gemm(x[t], w13[e].t())), w2[e].t())

with the ``native`` providers of ``det_gemm`` and ``silu_and_mul`` (model dtype between the
two GEMMs, as vLLM's and the trainers' expert MLPs round). ``det_gemm`` is row invariant, so
``y[t, s]`` is bitwise the expert MLP of that row alone, **whatever the number of tokens each
expert receives** and whatever else is in the batch. Slots whose expert lives on another rank
(``expert_map[e] == -1``) are ``+0`` rows: summing ``y`` over the ranks of an expert-parallel
group adds one value and zeros per element, which is exact in any order.

The rows are processed grouped by expert: the (token, slot) pairs sorted stably by local
expert id, i.e. by (expert, token, slot). That order only decides which rows share a launch;
it does not change any row's bits.

Backward, per expert ``e`` over its rows in (token, slot) order (``g`` = the rows' output
gradients, ``h`` = ``det_gemm(x_e, w13[e].t())`` recomputed, ``a = silu_and_mul(h)``)::

    da     = det_gemm(g, w2[e])                         # [n, I]
    dw2[e] = det_gemm_wgrad(a, g).t()                   # fp32, fixed row-chunk order
    dh     = silu_and_mul_backward(da, h)               # [n, 2I]
    dw13[e]= det_gemm_wgrad(x_e, dh).t()
    dx_slot= det_gemm(dh, w13[e])                       # [n, H], model dtype
    dx[t]  = (sum over s in slot order of dx_slot[t, s].float()).to(x.dtype)

``dx`` is row invariant; ``dw13`` / ``dw2`` are deterministic (zero-padding rows add exact
zeros) and rounded once to the weights' dtype.

**Grouped form** (family ``moe_experts_tp/g<G>[moe_experts/native]``; the experts whose
intermediate dimension ``I`` tensor parallelism shards, :mod:`rl_engine.ops.moe_experts.tp`):
the down product of every row is the TP-invariant K reduction of
:mod:`rl_engine.ops.det_gemm.tp` instead of a plain ``det_gemm``::

    a      = silu_and_mul(det_gemm(x[t], w13[e].t()))            # as above, x.dtype
    sub    = det_gemm_tp.subtree(a, w2[e].t(), G)                # fp32: G groups, pair tree
    y[t, s] = finish(sub, None, x.dtype)                         # one rounding

(:func:`moe_experts_subtree` returns ``sub``, fp32, ``+0`` rows for non-local experts). A rank
holding the ``I / t`` shard ``r`` of every expert (``w13`` rows ``[gate_r; up_r]``, ``w2``
columns ``r``) computes ``a``'s columns of that shard bitwise (``det_gemm`` is column
invariant) and so its subtree of ``G / t`` groups; the ranks' subtrees combined by
:func:`rl_engine.ops.det_gemm.tp.combine` and rounded once are the one-device bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from rl_engine.ops._common import check_float, check_same_device, check_same_dtype, check_tensor


class Kernels(NamedTuple):
    """The dense ops an experts provider runs per expert (one provider family's functions)."""

    mm: Callable[..., torch.Tensor]  # det_gemm(a, b, bias)
    wgrad: Callable[..., torch.Tensor]  # det_gemm_wgrad(a, grad) -> fp32 a.t() @ grad
    act: Callable[..., torch.Tensor]  # silu_and_mul(x)
    act_backward: Callable[..., torch.Tensor]  # silu_and_mul_backward(grad, x)
    # the grouped down product: subtree(a, b, groups) -> fp32 [M, N] (det_gemm_tp's subtree of
    # the family's det_gemm provider); None: the family has no grouped form
    subtree: Callable[..., torch.Tensor] | None = None


def _native() -> Kernels:
    from rl_engine.ops.det_gemm import reference as gemm
    from rl_engine.ops.det_gemm import tp
    from rl_engine.ops.silu_and_mul import reference as act

    def subtree(a: torch.Tensor, b: torch.Tensor, groups: int) -> torch.Tensor:
        return tp.subtree(a, b, groups, backend="native")

    return Kernels(gemm.det_gemm, gemm.det_gemm_wgrad, act.silu_and_mul,
                   act.silu_and_mul_backward, subtree)  # fmt: skip


def check_groups(w2: torch.Tensor, groups: int) -> None:
    """Refuse a group count the grouped down product cannot use on ``w2`` [E, H, I_local]."""
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(f"moe_experts: groups must be an int, got {type(groups).__name__}")
    if groups < 1 or groups & (groups - 1):
        raise ValueError(f"moe_experts: groups must be a power of two >= 1, got {groups}")
    inter = w2.shape[-1]
    if inter % groups:
        raise ValueError(
            f"moe_experts: the intermediate size {inter} of w2 {tuple(w2.shape)} is not a "
            f"multiple of {groups}: it does not split into {groups} equal groups (the "
            "TP-invariant down product)"
        )


def _check(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor | None,
    *,
    groups: int | None = None,
    values: bool = True,
) -> None:
    """Shapes, dtypes and devices; ``groups``: also the grouped form's group count
    (:func:`check_groups`; ``None``: the plain form); ``values``: also the id ranges (not in a
    fake / trace)."""
    check_tensor("x", x, dims=2)
    check_tensor("ids", ids, dims=2)
    check_tensor("w13", w13, dims=3)
    check_tensor("w2", w2, dims=3)
    check_float("x", x)
    check_same_dtype(x=x, w13=w13, w2=w2)
    check_same_device(x=x, ids=ids, w13=w13, w2=w2, expert_map=expert_map)
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moe_experts: ids must be int32 / int64, got {ids.dtype}")
    t, h = x.shape
    e_local, two_i, h13 = w13.shape
    if ids.shape[0] != t:
        raise ValueError(f"moe_experts: ids {tuple(ids.shape)} must be [T={t}, top_k]")
    if h13 != h or two_i % 2:
        raise ValueError(
            f"moe_experts: w13 {tuple(w13.shape)} must be [E, 2 * I, H={h}] (gate rows, then up)"
        )
    if tuple(w2.shape) != (e_local, h, two_i // 2):
        raise ValueError(
            f"moe_experts: w2 {tuple(w2.shape)} must be [E={e_local}, H={h}, I={two_i // 2}]"
        )
    n_global = e_local
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dims=1)
        if expert_map.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"moe_experts: expert_map must be int32 / int64, got {expert_map.dtype}"
            )
        n_global = expert_map.shape[0]
    if groups is not None:
        check_groups(w2, groups)
    if not values or ids.numel() == 0:
        return
    msg = f"moe_experts: expert ids must be in [0, {n_global})"
    ok = (ids >= 0) & (ids < n_global)
    if ids.device.type == "cpu":  # an accelerator queues the check (no host sync)
        if not bool(ok.all()):
            raise ValueError(f"{msg}; found {ids[~ok].flatten()[:3].tolist()}")
        if expert_map is not None and not bool(((expert_map >= -1) & (expert_map < e_local)).all()):
            raise ValueError(f"moe_experts: expert_map values must be in [-1, {e_local})")
    else:
        torch._assert_async(ok.all(), msg)


def local_ids(ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """[T * k] local expert id of every (token, slot), -1 where the expert is not local."""
    flat = ids.reshape(-1).long()
    return flat if expert_map is None else expert_map.long()[flat]


def groups(
    ids: torch.Tensor, expert_map: torch.Tensor | None, n_local: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(local expert, its rows)``: the flat (token, slot) indices routed to each local expert
    that received any, in (token, slot) order (a stable sort by expert)."""
    local = local_ids(ids, expert_map)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local + 1, minlength=n_local + 1).tolist()  # [0]: not local
    start = counts[0]
    for e in range(n_local):
        n = counts[e + 1]
        if n:
            yield e, order[start : start + n]
        start += n


_by_expert = groups  # for the grouped functions, whose ``groups`` argument is the group count


def sum_slots(dx_slots: torch.Tensor) -> torch.Tensor:
    """A token's input gradient from its slots' [T, k, H]: added in slot order in fp32, rounded
    once to their dtype (every provider's rule)."""
    acc = torch.zeros((dx_slots.shape[0], dx_slots.shape[2]), dtype=torch.float32,
                      device=dx_slots.device)  # fmt: skip
    for s in range(dx_slots.shape[1]):
        acc = acc + dx_slots[:, s].float()
    return acc.to(dx_slots.dtype)


def experts_forward(x, ids, w13, w2, expert_map, kern: Kernels) -> torch.Tensor:
    """The forward of the module docstring with one family's dense ops."""
    t, k = ids.shape
    y = x.new_zeros((t * k, x.shape[1]))
    for e, rows in groups(ids, expert_map, w13.shape[0]):
        a = kern.act(kern.mm(x[rows // k], w13[e].t(), None))
        y[rows] = kern.mm(a, w2[e].t(), None)
    return y.view(t, k, x.shape[1])


def experts_subtree(x, ids, w13, w2, groups: int, expert_map, kern: Kernels) -> torch.Tensor:
    """The grouped form's fp32 subtrees [T, k, H] (module docstring) with one family's ops."""
    t, k = ids.shape
    y = torch.zeros((t * k, x.shape[1]), dtype=torch.float32, device=x.device)
    for e, rows in _by_expert(ids, expert_map, w13.shape[0]):
        a = kern.act(kern.mm(x[rows // k], w13[e].t(), None))
        y[rows] = kern.subtree(a, w2[e].t(), groups)
    return y.view(t, k, x.shape[1])


def expert_backward(xe, g, w13e, w2e, kern: Kernels):
    """One expert's ``(dh, dw13, dw2)`` for its rows ``xe`` and their output gradient ``g``:
    ``dh`` the gate / up outputs' gradient, the weight gradients in fp32 (module docstring)."""
    h = kern.mm(xe, w13e.t(), None)
    da = kern.mm(g, w2e, None)
    dw2 = kern.wgrad(kern.act(h), g).t()
    dh = kern.act_backward(da, h)
    return dh, kern.wgrad(xe, dh).t(), dw2


def experts_backward(grad, x, ids, w13, w2, expert_map, kern: Kernels):
    """``(dx, dw13, dw2)`` of the module docstring with one family's dense ops."""
    t, k = ids.shape
    g_rows = grad.reshape(t * k, -1).to(x.dtype)
    dx_slots = x.new_zeros((t * k, x.shape[1]))
    dw13 = torch.zeros(w13.shape, dtype=torch.float32, device=w13.device)
    dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device)
    for e, rows in groups(ids, expert_map, w13.shape[0]):
        dh, dw13[e], dw2[e] = expert_backward(x[rows // k], g_rows[rows], w13[e], w2[e], kern)
        dx_slots[rows] = kern.mm(dh, w13[e], None)
    return sum_slots(dx_slots.view(t, k, -1)), dw13.to(w13.dtype), dw2.to(w2.dtype)


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU experts, one output row per (token, top-k slot).

    Equivalent to ``y[t, s] = (silu(x[t] @ W_g[e].T) * (x[t] @ W_u[e].T)) @ W_d[e].T`` with
    ``e = ids[t, s]``, each GEMM ``det_gemm`` (fp32 accumulation, one rounding).

    Args:
        x: [T, H] float32 / bfloat16 / float16 token rows.
        ids: [T, k] int32 / int64 global expert ids (``moe_topk``'s).
        w13: [E_local, 2 * I, H] gate rows then up rows (vLLM's ``w13_weight`` layout).
        w2: [E_local, H, I] down projections.
        expert_map: optional [E_global] int: global id -> local index, -1 when the expert is on
            another rank (expert parallelism); ``None``: every expert is local.

    Returns:
        [T, k, H] in ``x.dtype`` (``+0`` rows for non-local experts).
    """
    _check(x, ids, w13, w2, expert_map)
    return experts_forward(x, ids, w13, w2, expert_map, _native())


def moe_experts_subtree(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    groups: int,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """A rank's fp32 subtrees of the grouped experts (module docstring, "Grouped form").

    Equivalent to ``y[t, s] = det_gemm_tp.subtree(silu_and_mul(det_gemm(x[t], w13[e].t())),
    w2[e].t(), groups)`` with ``e = ids[t, s]`` (``+0`` rows where ``e`` is not local).

    Args:
        x, ids, w13, w2, expert_map: as :func:`moe_experts`; ``w13`` / ``w2`` may be a TP
            rank's shard of the intermediate dimension (``w13`` rows ``[gate_r; up_r]``).
        groups: the number of groups of this rank's ``I_local`` (``G / t`` at TP degree t).

    Returns:
        [T, k, H] float32 (not rounded: combine the ranks', then round once).
    """
    _check(x, ids, w13, w2, expert_map, groups=groups)
    return experts_subtree(x, ids, w13, w2, groups, expert_map, _native())


def moe_experts_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw13, dw2)`` from ``grad`` [T, k, H] (module docstring)."""
    return experts_backward(grad, x, ids, w13, w2, expert_map, _native())
