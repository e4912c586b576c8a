"""Tensor-parallel-invariant reductions for the GEMMs whose reduction dimension TP shards.

A row-parallel layer (attention output, MLP down projection) holds a slice of K on every rank;
the backward of a column-parallel layer (QKV, gate/up, the vocab-parallel LM head) holds a slice
of N. Summing the ranks' partials changes the bits with the TP degree unless the single-GPU
computation *is* that sum. Numerics of the ``tp`` reduction (family
``det_gemm_tp/g<G>[<det_gemm family>]``):

* the reduction dimension is cut into ``G`` equal contiguous **groups** (``G = TP_GROUPS = 8``,
  a fixed count, never derived from the TP degree or the batch);
* each group is one fp32 GEMM of the det_gemm provider's family (the provider's fp32 product
  ``a_g @ b_g``, its ``wgrad`` entry: a fixed order that depends on the group's length only);
* the ``G`` fp32 partials are combined by a fixed tree of **adjacent** pairs,
  ``((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7))`` (:func:`pair_tree`; not
  :func:`rl_engine.ops._common.tree_sum`, whose first level adds ``g_i + g_{i+G/2}``: its
  subtrees are strided, a rank's contiguous shard would not be one);
* then ``+ bias`` in fp32 and one rounding to the input dtype.

The tree's subtrees are contiguous runs of groups, so at any TP degree ``t`` dividing ``G``, rank
``r`` (holding groups ``[r G/t, (r+1) G/t)``) computes its subtree with :func:`subtree`, the
ranks exchange these fp32 ``[M, N]`` partials (:class:`Exchange`: all-to-all of column blocks,
combine, all-gather of the rounded blocks), and :func:`combine` adds them with the tree's top
levels: the TP = 1 bits on every rank, for every ``t`` in ``allowed_degrees()``.

Layouts whose TP shard is not a contiguous slice (Megatron's fused ``[gate; up]`` FC1 holds
``[gate_r; up_r]`` on rank ``r``) pass ``glu=True``: group ``j`` is then gate rows ``j`` and up
rows ``j`` (each half cut into ``G`` groups), in that order, on one rank as on ``t`` ranks.

A rank's subtree is one launch where the provider has a ``tp_subtree`` entry (Triton:
group products and tree in one kernel); :func:`subtree_per_group` is the same computation one
launch per group (the reference). Small messages may take the one-shot exchange
(:mod:`rl_engine.ops.det_gemm.oneshot`, ``RL_ENGINE_TP_ONESHOT``): the same bits.

Cost: 1.5x the bytes of a bf16 ring all-reduce at every degree (:class:`Exchange`; see
``docs/operators/det_gemm.md``, "Tensor parallelism").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rl_engine.config import settings
from rl_engine.registry import KernelRegistry, resolve_provider

__all__ = [
    "TP_GROUPS",
    "allowed_degrees",
    "check_split",
    "combine",
    "det_gemm_tp",
    "family",
    "groups_for",
    "pair_tree",
    "Exchange",
    "register_exchange",
    "tp_row_parallel",
    "subtree",
    "subtree_per_group",
    "tp_linear",
]

TP_GROUPS = 8  # fixed group count (part of the numerics): TP degrees 1, 2, 4, 8


def allowed_degrees(groups: int = TP_GROUPS) -> list[int]:
    """The TP degrees whose shards are whole subtrees of the ``groups``-leaf tree."""
    return [d for d in range(1, groups + 1) if groups % d == 0 and d & (d - 1) == 0]


def check_split(size: int, tp: int, *, what: str, groups: int = TP_GROUPS, glu: bool = False):
    """Refuse a reduction length or TP degree the grouping cannot split.

    ``size`` is the full (TP = 1) reduction length; ``glu``: two halves, each cut into groups.
    """
    if groups < 1 or groups & (groups - 1):
        raise ValueError(f"{what}: the group count must be a power of two, got {groups}")
    allowed = allowed_degrees(groups)
    if tp not in allowed:
        raise ValueError(
            f"{what}: tensor-parallel degree {tp} does not divide the {groups} reduction groups "
            f"of the TP-invariant GEMM; allowed degrees: {allowed}"
        )
    unit = groups * (2 if glu else 1)
    if size % unit:
        raise ValueError(
            f"{what}: reduction length {size} is not a multiple of {unit} ({groups} groups"
            f"{' per gate / up half' if glu else ''}), so it cannot be cut into equal groups; "
            f"pad the layer or use TP-invariant numerics off (TP = 1 only)"
        )


def groups_for(tp: int) -> int | None:
    """The group count the configuration asks for at TP degree ``tp`` (``None``: the plain
    det_gemm reduction). ``RL_ENGINE_TP_GROUPS``: unset = 8 groups at TP > 1, off at TP = 1;
    ``G`` = G groups at every degree; ``0`` = off (TP > 1 refused)."""
    g = settings().tp_groups
    if g is None:
        return TP_GROUPS if tp > 1 else None
    if g == 0:
        if tp > 1:
            raise ValueError(
                f"tensor-parallel degree {tp} with RL_ENGINE_TP_GROUPS=0: the TP-invariant "
                "reduction is off, and without it TP > 1 cannot keep the bits (unset it or set 8)"
            )
        return None
    return g


def _resolve(device_type: str, backend: str | None) -> str:
    """The det_gemm provider whose fp32 products the TP reduction uses: det_gemm's own choice
    (or ``backend``), resolved (and recorded for provenance) as the op ``det_gemm_tp``."""
    name = backend or resolve_provider("det_gemm", device_type)
    return resolve_provider("det_gemm_tp", device_type, name)


def _provider(device: torch.device, backend: str | None):
    return KernelRegistry.provider("det_gemm", _resolve(device.type, backend))


def family(device: torch.device | str = "cpu", backend: str | None = None,
           groups: int = TP_GROUPS) -> str:  # fmt: skip
    """The numerics family id of the TP reduction on ``device``."""
    return f"det_gemm_tp/g{groups}[{_provider(torch.device(device), backend).numerics}]"


def _group_order(n: int, groups: int, glu: bool) -> torch.Tensor | None:
    """Indices that make the groups contiguous (``glu``: gate block j then up block j)."""
    if not glu:
        return None
    half, g = n // 2, n // (2 * groups)
    idx = torch.arange(n).view(2, groups, g).transpose(0, 1).reshape(-1)
    assert idx.numel() == 2 * half
    return idx


def _check_subtree(a: torch.Tensor, b: torch.Tensor, groups: int, glu: bool) -> int:
    k = a.shape[1]
    if b.shape[0] != k:
        raise ValueError(f"det_gemm_tp: a is [{a.shape[0]}, {k}] but b is {list(b.shape)}")
    if k % (groups * (2 if glu else 1)):
        raise ValueError(f"det_gemm_tp: {k} columns do not split into {groups} groups")
    return k


def subtree(a: torch.Tensor, b: torch.Tensor, groups: int, *, glu: bool = False,
            backend: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """fp32 tree sum of the ``groups`` group products of ``a [M, K] @ b [K, N]`` (K = ``groups``
    equal groups, ``glu``: two halves of ``groups`` groups each). A rank passes its shard and its
    own number of groups (``TP_GROUPS / tp``).

    A provider with a ``tp_subtree`` entry (Triton) computes it in one launch, group products
    and tree; otherwise (or with ``RL_ENGINE_TP_SUBTREE=per-group``) :func:`subtree_per_group`.
    Both are the same bits (a test checks it).
    ``out``: an fp32 ``[M, N]`` destination (e.g. the one-shot exchange's buffer)."""
    _check_subtree(a, b, groups, glu)
    fused = _provider(a.device, backend).extras.get("tp_subtree")
    if fused is not None and not settings().tp_subtree_per_group:
        return fused(a, b, groups, glu=glu, out=out)
    sub = subtree_per_group(a, b, groups, glu=glu, backend=backend)
    return sub if out is None else out.copy_(sub)


def subtree_per_group(a: torch.Tensor, b: torch.Tensor, groups: int, *, glu: bool = False,
                      backend: str | None = None) -> torch.Tensor:  # fmt: skip
    """:func:`subtree` as the numerics define it, one launch per group: each group's product
    through the provider's ``wgrad`` entry (its fp32 product), :func:`pair_tree` over the
    stacked products. The reference of the one-launch kernels."""
    k = _check_subtree(a, b, groups, glu)
    order = _group_order(k, groups, glu)
    if order is not None:
        order = order.to(a.device)
        a, b = a.index_select(1, order), b.index_select(0, order)
    wgrad = _provider(a.device, backend).extras["wgrad"]
    step = k // groups
    # the provider's fp32 product a_g @ b_g: its wgrad entry computes x.t() @ y
    parts = [wgrad(a[:, i : i + step].t(), b[i : i + step]) for i in range(0, k, step)]
    return pair_tree(torch.stack(parts))


def combine(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tree's top levels over the ranks' subtrees (rank order), fp32."""
    return pair_tree(torch.stack(list(parts)))


def finish(acc: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``(acc + bias) -> dtype``: fp32 add, one rounding (as det_gemm's epilogue)."""
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(dtype)


def pair_tree(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 (a power-of-two length) by adjacent pairs, level by level: every subtree
    is a contiguous run. Elementwise fp32 adds only: the same bits on any device."""
    n = x.shape[0]
    if n < 1 or n & (n - 1):
        raise ValueError(f"pair_tree: {n} terms; expected a power of two")
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]


class Exchange:
    """How the ranks of a TP group combine their fp32 subtrees (TP = 1: one rank, no traffic).

    * ``ex(sub, bias, dtype)``: the whole ``[M, N]`` result on every rank. 1. all-to-all of the
      subtrees' row blocks (rank ``j`` receives every rank's block ``j``; column blocks when the
      ``M`` rows do not split evenly), 2. the tree's top levels, the bias and one rounding on the
      own block, 3. all-gather of the rounded blocks. A rank sends ``(t-1)/t`` of an fp32
      ``[M, N]`` and of a 16-bit one: 1.5x the bytes of a bf16 ring all-reduce at every degree.
    * ``ex.scatter(sub, bias, dtype)``: sequence parallelism's reduce-scatter: steps 1 and 2 on
      row blocks, no all-gather (1x a ring reduce-scatter's bytes in fp32, 2x in bf16 terms).
    * ``ex.gather_rows(x)``: all-gather along rows (exact copies).

    Every output element is combined by one rank in the order of ``finish(combine(subtrees))``,
    whichever block it is in: the same bits as one device. ``all_to_all(x)``: ``x`` [t, ...] ->
    [t, ...] with ``out[r]`` = rank ``r``'s ``x[rank]``; ``all_gather(x)``: every rank's ``x``
    in rank order, concatenated along dim 0 (one ``[t * rows, ...]`` tensor: the row-block
    path's result needs no copy).
    """

    def __init__(self, all_to_all=None, all_gather=None, rank: int = 0, world: int = 1,
                 one_shot: Any = None) -> None:  # fmt: skip
        self.all_to_all, self.all_gather = all_to_all, all_gather
        self.rank, self.world = rank, world
        # small messages: the one-shot path (rl_engine.ops.det_gemm.oneshot.OneShot), or None
        self.one_shot = one_shot

    @classmethod
    def over(cls, group: Any, *, one_shot: bool | None = None) -> Exchange:
        """The exchange of a ``torch.distributed`` process group (gloo or NCCL): one
        ``all_to_all_single`` and one all-gather into a single tensor. ``one_shot`` (default:
        ``RL_ENGINE_TP_ONESHOT``): subtrees of at most ``oneshot.ONESHOT_MAX_BYTES`` take the
        one-shot symmetric-memory kernel instead (built once per group, a collective); raises
        where it cannot run."""
        import torch.distributed as dist

        if one_shot is None:
            one_shot = settings().tp_oneshot
        fast = None
        if one_shot and dist.get_world_size(group) > 1:
            from rl_engine.ops.det_gemm import oneshot

            fast = oneshot.for_group(group)

        world = dist.get_world_size(group)
        # torch >= 2.13 names it all_gather_single (all_gather_into_tensor: deprecated there)
        gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def all_to_all(x: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=group)
            return out

        def all_gather(x: torch.Tensor) -> torch.Tensor:
            out = x.new_empty((world * x.shape[0], *x.shape[1:]))
            gather_into(out, x, group=group)
            return out

        return cls(all_to_all, all_gather, dist.get_rank(group), world, fast)

    def subtree_out(self, m: int, n: int) -> torch.Tensor | None:
        """Where a rank's ``[m, n]`` fp32 subtree should be written: the one-shot buffer when
        the message takes that path (no copy), else ``None`` (anywhere)."""
        if self.one_shot is not None and self.world > 1 and self.one_shot.fits(m, n):
            return self.one_shot.staging(m, n)
        return None

    def _blocks(self, n: int, what: str) -> int:
        if n % self.world:
            raise ValueError(f"TP exchange: {n} {what} do not split over {self.world} ranks")
        return n // self.world

    def _own(self, blocks: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        """Steps 1 and 2 for ``blocks`` [t, ...] (block ``j`` goes to rank ``j``): the own
        block of every rank's subtree, combined (the received ``[t, ...]`` is the tree's
        input as it stands: no stacking copy), plus ``bias``, rounded."""
        return finish(pair_tree(self.all_to_all(blocks)), bias, dtype)

    def __call__(self, sub: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        if self.world == 1:
            return finish(sub, bias, dtype)
        m, n = sub.shape
        if self.one_shot is not None and self.one_shot.fits(m, n):
            return self.one_shot(sub, bias, dtype)
        if m % self.world == 0:  # row blocks: views in, the gathered rows are the result
            return self.gather_rows(self.scatter(sub, bias, dtype))
        w = self._blocks(n, "output columns")
        blocks = sub.view(m, self.world, w).transpose(0, 1).contiguous()  # [t, M, N/t]
        own_bias = None if bias is None else bias[self.rank * w : (self.rank + 1) * w]
        mine = self._own(blocks, own_bias, dtype)  # [M, N/t]
        got = self.all_gather(mine.contiguous())  # [t * M, N/t]
        return got.view(self.world, m, w).transpose(0, 1).reshape(m, n)

    def scatter(self, sub: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        if self.world == 1:
            return finish(sub, bias, dtype)
        m, n = sub.shape
        h = self._blocks(m, "rows (tokens)")
        if self.one_shot is not None and self.one_shot.fits(m, n):
            return self.one_shot(sub, bias, dtype, rows=True)
        return self._own(sub.contiguous().view(self.world, h, n), bias, dtype)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        return self.all_gather(x.contiguous())


_SINGLE = Exchange()


class _TPLinearFn(torch.autograd.Function):
    """``x @ W.t() (+ bias)`` of one rank's shard of a TP layer (TP = 1: the whole layer).

    ``row`` (K sharded): forward = the grouped K reduction, its rank subtrees exchanged and
    combined; backward ``dx = grad @ W`` and ``dW`` are per element of the shard (exact at any
    degree). ``column`` (N sharded): forward = det_gemm (per column: exact); backward ``dx`` =
    the grouped N reduction, exchanged and combined. ``exchange``: the group's
    :class:`Exchange`. ``sp`` (sequence parallelism): the layer's token rows are sharded too;
    column parallel all-gathers its input rows (backward: the grouped reduce-scatter), row
    parallel reduce-scatters its output (backward: all-gather of the gradient rows).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, parallel, groups, glu, exchange, sp, provider):
        fns = KernelRegistry.provider("det_gemm", provider)
        if parallel == "row":
            dest = exchange.subtree_out(x.shape[0], weight.shape[0])
            sub = subtree(x, weight.t(), groups, backend=provider, out=dest)
            out = (exchange.scatter if sp else exchange)(sub, bias, x.dtype)
        else:
            if sp:
                x = exchange.gather_rows(x)
            out = fns.fn(x, weight.t(), bias)
        ctx.save_for_backward(x, weight)
        ctx.meta = (parallel, groups, glu, exchange, sp, provider, bias is not None)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        parallel, groups, glu, exchange, sp, provider, has_bias = ctx.meta
        fns = KernelRegistry.provider("det_gemm", provider)
        grad = grad.to(x.dtype)
        if parallel == "row" and sp:
            grad = exchange.gather_rows(grad)
        dx = dw = dbias = None
        if ctx.needs_input_grad[0]:
            if parallel == "row":
                dx = fns.fn(grad, weight, None)
            else:
                dest = exchange.subtree_out(grad.shape[0], weight.shape[1])
                sub = subtree(grad, weight, groups, glu=glu, backend=provider, out=dest)
                dx = (exchange.scatter if sp else exchange)(sub, None, x.dtype)
        if ctx.needs_input_grad[1]:
            dw = fns.extras["wgrad"](x, grad).t().to(weight.dtype)
        if has_bias and ctx.needs_input_grad[2]:
            dbias = fns.extras["wgrad"](grad.new_ones((grad.shape[0], 1)), grad)[0].to(grad.dtype)
        return dx, dw, dbias, None, None, None, None, None, None


def tp_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              parallel: str, exchange: Exchange | None = None, tp: int = 1,
              full_size: int | None = None, groups: int = TP_GROUPS, glu: bool = False,
              sequence_parallel: bool = False,
              backend: str | None = None) -> torch.Tensor:  # fmt: skip
    """One rank's shard of a linear layer with TP-invariant reductions (autograd included).

    Args:
        x: [M, K_local] (``row``) or [M, K] (``column``).
        weight: ``nn.Linear`` layout, this rank's shard: [N, K_local] (``row``) or
            [N_local, K] (``column``; ``glu``: rows ``[gate_r; up_r]``).
        bias: [N] (``row``: the whole bias, added once after the combine) or [N_local].
        parallel: ``"row"`` (K sharded) or ``"column"`` (N sharded).
        exchange: the TP group's :class:`Exchange` (``None``: TP = 1).
        sequence_parallel: ``x`` (column) / the output (row) holds this rank's block of rows.
        tp: the TP degree; ``full_size``: the TP = 1 reduction length (checked against the
            grouping; default: the local one times ``tp``).
    Returns:
        [M, N] (``row``) or [M, N_local] (``column``) in ``x.dtype``.
    """
    if parallel not in ("row", "column"):
        raise ValueError(f"tp_linear: parallel={parallel!r}; expected 'row' or 'column'")
    local = weight.shape[1] if parallel == "row" else weight.shape[0]
    check_split(full_size or local * tp, tp, what="tp_linear", groups=groups, glu=glu)
    if (exchange is None) != (tp == 1):
        raise ValueError("tp_linear: pass an exchange function exactly when tp > 1")
    provider = _resolve(x.device.type, backend)
    return _TPLinearFn.apply(
        x,
        weight,
        bias,
        parallel,
        groups // tp,
        glu,
        exchange or _SINGLE,
        sequence_parallel,
        provider,
    )


# exchanges of engines whose process groups a custom op cannot take as an argument (vLLM's TP
# group): registered by name, looked up inside ``rl_engine::tp_row_parallel``
_EXCHANGES: dict[str, Any] = {}
# name prefix -> builder(name) of an exchange not registered yet: the op's body may run where
# the Python that would register it never did (a compiled graph loaded from a cache, a graph
# whose traced side effects are applied after it ran)
_BUILDERS: dict[str, Any] = {}


def register_exchange(name: str, exchange: Any) -> None:
    """Make ``exchange(sub, bias, dtype)`` (an :class:`Exchange`) callable by ``name``."""
    _EXCHANGES[name] = exchange


def register_exchange_builder(prefix: str, build: Any) -> None:
    """``build(name)`` makes the exchange of a ``name`` starting with ``prefix`` on its first use
    (kept in the registry after)."""
    _BUILDERS[prefix] = build


def exchange_named(name: str) -> Any:
    """The exchange registered (or buildable) as ``name``; raises when there is none."""
    ex = _EXCHANGES.get(name)
    if ex is None:
        build = next((b for p, b in _BUILDERS.items() if name.startswith(p)), None)
        if build is None:
            raise RuntimeError(f"tp_row_parallel: no exchange registered as {name!r}")
        ex = _EXCHANGES[name] = build(name)
    return ex


@torch.library.custom_op("rl_engine::tp_row_parallel", mutates_args=())
def _tp_row_parallel_op(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    groups: int,
    exchange: str,
    provider: str,
) -> torch.Tensor:
    ex = exchange_named(exchange)
    dest = ex.subtree_out(a.shape[0], b.shape[1]) if hasattr(ex, "subtree_out") else None
    return ex(subtree(a, b, groups, backend=provider, out=dest), bias, a.dtype)


@_tp_row_parallel_op.register_fake
def _(a, b, bias, groups, exchange, provider):
    return a.new_empty((a.shape[0], b.shape[1]))


def tp_row_parallel(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, groups: int,
                    exchange: str, *, backend: str | None = None) -> torch.Tensor:  # fmt: skip
    """Inference form of a row-parallel shard (custom op, opaque to ``torch.compile``):
    ``a [M, K_local] @ b [K_local, N]`` as this rank's subtree of ``groups`` groups, combined
    with the other ranks' by the exchange registered as ``exchange``; the whole ``bias`` [N]."""
    provider = _resolve(a.device.type, backend)
    return _tp_row_parallel_op(a, b, bias, groups, exchange, provider)


@torch.library.custom_op("rl_engine::det_gemm_tp", mutates_args=())
def _det_gemm_tp_op(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, groups: int, provider: str
) -> torch.Tensor:
    return finish(subtree(a, b, groups, backend=provider), bias, a.dtype)


@_det_gemm_tp_op.register_fake
def _(a, b, bias, groups, provider):
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup_tp_context(ctx, inputs, output):
    from rl_engine.ops import det_gemm as dg

    a, b, bias, _, provider = inputs
    dg._setup_context(ctx, (a, b, bias, provider), output)


def _tp_backward(ctx, grad):
    from rl_engine.ops import det_gemm as dg

    da, db, dbias, _ = dg._backward(ctx, grad)
    return da, db, dbias, None, None


_det_gemm_tp_op.register_autograd(_tp_backward, setup_context=_setup_tp_context)


def det_gemm_tp(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                groups: int = TP_GROUPS, backend: str | None = None) -> torch.Tensor:  # fmt: skip
    """``a @ b (+ bias)`` with the TP-invariant K reduction, computed on one device (TP = 1).

    Equal, bitwise, to ``finish(combine([subtree(a_r, b_r, groups // t) for r]), bias)`` over the
    ``t`` contiguous K shards of every ``t`` in ``allowed_degrees(groups)``; differentiable
    (backward: det_gemm's rule). Under ``torch.compile`` it is the custom op
    ``rl_engine::det_gemm_tp`` (what the vLLM plugin's row-parallel layers trace).

    Args:
        a: [M, K] float, K a multiple of ``groups``.
        b: [K, N], same dtype.
        bias: optional [N].
    Returns:
        [M, N] in ``a.dtype``.
    """
    from rl_engine.ops.det_gemm import reference

    reference._check(a, b, bias)
    if torch.compiler.is_compiling():
        check_split(a.shape[1], 1, what="det_gemm_tp", groups=groups)
        provider = _resolve(a.device.type, backend)
        return _det_gemm_tp_op(a, b, bias, groups, provider)
    return tp_linear(a, b.t(), bias, parallel="row", groups=groups, backend=backend)


# ----------------------------------------------------------------------------- registry
# ``det_gemm_tp`` is an op of its own in the registry (the TP reduction is a numerics family of
# its own: provenance names it), with one provider per invariant det_gemm provider, same name,
# same devices and availability: its group products are that provider's.
def _reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return finish(subtree(a, b, TP_GROUPS, backend="native"), bias, a.dtype)


def _provider_fn(name: str):
    def fn(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return finish(subtree(a, b, TP_GROUPS, backend=name), bias, a.dtype)

    return fn


def register_grouped(
    op: str,
    base: str,
    *,
    entry: Callable[..., Any],
    reference: Callable[..., Any],
    fn: Callable[[str], Callable[..., Any]],
    available: Callable[[str, Any], Any] | None = None,
) -> None:
    """Register the grouped (TP-invariant) op ``op`` of the op ``base``: one provider per
    invariant ``base`` provider not registered yet, same name, devices, dtypes, version and
    opt-in, numerics ``{op}/g{TP_GROUPS}[<base provider's family>]``, function ``fn(name)``,
    availability the base provider's (``available(name, base's)``: a narrower one)."""
    KernelRegistry.register_op(op, entry=entry, reference=reference)
    have = {p.name for p in KernelRegistry.providers(op)}
    for prov in KernelRegistry.providers(base):
        if not prov.invariant or prov.name in have:
            continue
        avail = prov.available if available is None else available(prov.name, prov.available)
        KernelRegistry.register_provider(
            dataclasses.replace(  # the rest (name, devices, dtypes, version, opt_in) as base's
                prov,
                op=op,
                numerics=f"{op}/g{TP_GROUPS}[{prov.numerics}]",
                fn=fn(prov.name),
                available=avail,
                extras={},
            )
        )


def _entry(a, b, bias=None, *, provider: str):
    return det_gemm_tp(a, b, bias, backend=provider)


register_grouped("det_gemm_tp", "det_gemm", entry=_entry, reference=_reference, fn=_provider_fn)
