"""Mixture-of-experts layer of the rl_engine Megatron spec (stands in for megatron's ``MoELayer``).

:class:`RLMoELayer` is the ``mlp`` submodule of an MoE transformer layer. It holds the router
weight and the *stacked* expert weights as parameters and computes, per token row::

    weights, ids, _ = moe_router(x, router.weight, k, scoring=..., renormalize=...)
    y   = moe_experts(x, ids, experts.linear_fc1.weight, experts.linear_fc2.weight,
                      groups=groups_for(TP))                                         # [T, k, H]
    out = moe_combine(y, weights, shared=shared_expert(x), shared_gate=x @ gate_weight.T)

with every GEMM a ``det_gemm`` (the ops' numerics: DESIGN.md section 1, "Mixture of experts").
With the TP-invariant reduction on (``groups_for(TP)``: always at TP > 1; at TP 1 with
``RL_ENGINE_TP_GROUPS=8``) the experts run ``moe_experts``' grouped form (the down product's
``I`` in ``G`` groups, fp32 pair tree, one rounding) and the shared expert the dense MLP's TP
layers: the bits of a rollout whose experts (and shared expert) are TP-sharded.
Megatron's ``TopKRouter``, token dispatchers and ``SequentialMLP`` / ``GroupedMLP`` are not
used: their permutation, capacity and grouped-GEMM paths change bits with the batch, and their
TP / EP combine adds each rank's partially combined tokens in the reduce-scatter's order.

Parameters (names follow megatron; shapes of one rank)::

    router.weight                       [E, H]                  replicated
    experts.linear_fc1.weight           [E / EP, 2 I / ETP, H]  [gate_r; up_r] per expert (w13)
    experts.linear_fc2.weight           [E / EP, H, I / ETP]    columns r of I (w2)
    shared_experts.linear_fc1.weight    [2 I_s / TP, H]         [gate_r; up_r] (Qwen2-MoE)
    shared_experts.linear_fc2.weight    [H, I_s / TP]
    shared_experts.gate_weight          [1, H]                  sigmoid gate logits, replicated

Parallel layouts (megatron's process groups; PP = CP = 1). The TP ranks of a model replica
hold the same tokens (sequence parallelism is refused with MoE layers, below), the data-parallel
ranks their own. Expert parallelism (``expert_model_parallel_size`` = EP): rank ``p`` of the EP
group holds experts ``[p E / EP, (p + 1) E / EP)``. Expert tensor parallelism
(``expert_tensor_parallel_size`` = ETP, megatron-core's default: the TP degree; any divisor of
TP): rank ``r`` of the expert-TP group (which lies inside the TP group) holds the ``I / ETP``
shard ``r`` of those experts, megatron's checkpoint layout (``loader.etp_shard_state``).

* **Plain reduction** (TP = 1, ``RL_ENGINE_TP_GROUPS`` unset). EP 1: ``moe_experts``. EP > 1:
  the EP ranks' (token, slot) rows all-gathered (real rows only, in rank order: the
  concatenated batch), each rank computes the slots of its local experts (``expert_map``; the
  others are ``+0`` rows), the per-slot outputs are summed over the EP group (one value and
  zeros per element: exact in any order), each rank keeps its rows, the combine is local.
  Backward mirrors it: the slot rows' input gradients summed over the group (exact, same
  argument), each token's slots added in slot order in fp32 with one rounding.
* **Grouped reduction** (every TP / ETP / EP degree; :class:`_GroupedExperts`). The token rows
  of the EP group are gathered, a member whose tokens an earlier member holds (a TP replica:
  at ETP 1 the EP group may be the TP group) contributing none, so the batch is the
  concatenation, in data-parallel rank order, of the replicas' tokens, identical on every rank
  of the expert-TP group. Each rank computes the fp32 subtrees of its experts' ``I / ETP``
  shard (``moe_experts_subtree``: ``G / ETP`` groups; gate / up per column, exact), the
  expert-TP group combines them with the exchange of the row-parallel layers
  (:class:`rl_engine.ops.det_gemm.tp.Exchange`: the tree's top levels, one rounding), the EP
  group sums the per-slot rows (exact), each rank keeps its rows. Backward: the rows'
  gradients placed in the batch and summed over the EP group (exact); per local expert
  ``da = g @ w2[e]``, ``dh``, ``dw2[e]``, ``dw13[e]`` are per element of the shard (the
  TP = 1 values of its columns: det_gemm's column invariance and weight-gradient order over
  the same rows), and the slot input gradient ``dh @ w13[e]`` (its K, ``2 I``, sharded) is the
  grouped N reduction of the dense column-parallel fc1 (``glu``: gate group j with up group j),
  exchanged over the expert-TP group like the forward; the EP sum; the slots added in slot
  order in fp32. So log-probs, the input gradient and every expert's weight gradient (each
  rank's shard) equal TP = ETP = EP = 1's bitwise, at every degree dividing ``G = 8``.
  The router and the shared-expert gate are replicated and see the same rows on every TP
  rank: their gradients equal TP 1's on every rank.

The expert weights carry ``allreduce = False`` (megatron's mark for expert parameters: their
gradients are reduced over the expert-data-parallel group, not the data-parallel one).

Refused with a reason (at build time): capacity factors / token dropping / padding to capacity
(:class:`~rl_engine.ops.moe_experts.TokenDroppingError`), sigmoid scoring, expert bias, group-
limited routing, top-k scaling, router jitter, aux / z losses, a router dtype other than the
model's, latent projections, sequence parallelism with MoE layers at TP > 1 (each TP rank
would route only its block of the tokens: the router's and the shared-expert gate's weight
gradients would be partial sums added by megatron's finalize all-reduce, not the TP 1 bits),
an expert-TP degree that does not divide TP, and (at run time, ``check_split``) an ``I`` the
grouping cannot split.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from rl_engine import ops
from rl_engine.adapters.megatron.modules import (
    UnsupportedNumericsError,
    _config_tp,
    _init_device,
    _tp_group,
)
from rl_engine.ops.det_gemm import tp as tpm
from rl_engine.ops.moe_experts import TokenDroppingError, refuse_token_dropping

__all__ = ["RLMoELayer", "moe_scoring_from_config"]

SCORINGS = ("softmax", "topk_softmax")


def _refuse(cond: bool, what: str) -> None:
    if cond:
        raise UnsupportedNumericsError(f"rl_engine Megatron MoE layer: {what} is not supported")


def moe_scoring_from_config(config: Any) -> tuple[str, bool]:
    """``(scoring, renormalize)`` of ``moe_topk`` equivalent to a megatron config's softmax
    router: ``moe_router_pre_softmax`` -> softmax over all experts, then top-k, not
    renormalised; otherwise top-k of the logits, softmax over the k (megatron's default)."""
    if getattr(config, "moe_router_pre_softmax", False):
        return "softmax", False
    return "topk_softmax", False


def _check_config(config: Any) -> None:
    _refuse(not getattr(config, "num_moe_experts", None), "a config without num_moe_experts")
    if config.moe_pad_expert_input_to_capacity or getattr(config, "moe_token_dropping", False):
        raise TokenDroppingError(
            "moe_pad_expert_input_to_capacity / moe_token_dropping: padding experts to a "
            "capacity and dropping tokens depend on the whole batch; rl_engine routes every token"
        )
    refuse_token_dropping("moe_expert_capacity_factor", config.moe_expert_capacity_factor)
    _refuse(config.moe_router_score_function != "softmax",
            f"moe_router_score_function={config.moe_router_score_function!r}")  # fmt: skip
    _refuse(bool(config.moe_router_enable_expert_bias), "moe_router_enable_expert_bias")
    _refuse(bool(config.moe_router_num_groups or config.moe_router_group_topk),
            "group-limited routing (moe_router_num_groups / moe_router_group_topk)")  # fmt: skip
    _refuse(config.moe_router_topk_limited_devices is not None, "moe_router_topk_limited_devices")
    _refuse(config.moe_router_topk_scaling_factor is not None, "moe_router_topk_scaling_factor")
    _refuse(config.moe_input_jitter_eps is not None, "router input jitter (moe_input_jitter_eps)")
    _refuse(bool(config.moe_router_force_load_balancing), "moe_router_force_load_balancing")
    lb = config.moe_router_load_balancing_type
    _refuse(lb != "none", f"moe_router_load_balancing_type={lb!r} (auxiliary losses are not "
            "computed; set it to 'none')")  # fmt: skip
    _refuse(bool(config.moe_z_loss_coeff), "the router z-loss (moe_z_loss_coeff)")
    _refuse(config.moe_router_dtype is not None,
            f"moe_router_dtype={config.moe_router_dtype!r} (the router logits are computed in "
            "the model dtype, as the rollout's gate computes them)")  # fmt: skip
    _refuse(bool(getattr(config, "moe_latent_size", None)), "MoE latent projections")
    _refuse(bool(getattr(config, "moe_apply_probs_on_input", False)), "moe_apply_probs_on_input")
    _refuse(not config.gated_linear_unit, "non-gated experts")
    _refuse(config.activation_func is not torch.nn.functional.silu, "an activation but SiLU")
    _refuse(bool(config.add_bias_linear), "expert biases")
    tp, etp = _config_tp(config), _config_etp(config)
    _refuse(tp > 1 and bool(getattr(config, "sequence_parallel", False)),
            "sequence parallelism with MoE layers (each TP rank would route only its block of "
            "the tokens: the router's and the shared-expert gate's weight gradients would be "
            "partial sums over the TP ranks, added by megatron's finalize all-reduce in an "
            "order that is not the TP = 1 one)")  # fmt: skip
    _refuse(etp > tp or tp % etp,
            f"expert_tensor_parallel_size={etp} with tensor_model_parallel_size={tp} (the "
            "expert-TP group must lie inside the TP group, whose ranks hold the same tokens: "
            "ETP must divide TP)")  # fmt: skip


def _group_size_rank(kind: str) -> tuple[Any, int, int]:
    """``(group, size, rank)`` of megatron's ``kind`` parallel group (``"expert_model"``: EP,
    ``"expert_tensor"``: expert TP); ``(None, 1, 0)`` for one rank or no parallel state."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 1, 0
    size = getattr(ps, f"get_{kind}_parallel_world_size")()
    if size == 1:
        return None, 1, 0
    return (
        getattr(ps, f"get_{kind}_parallel_group")(),
        size,
        getattr(ps, f"get_{kind}_parallel_rank")(),
    )


def _config_etp(config: Any) -> int:
    """The config's expert-TP degree (megatron-core sets it to the TP degree when unset)."""
    etp = getattr(config, "expert_tensor_parallel_size", None)
    return _config_tp(config) if etp is None else int(etp)


def _data_parallel_rank() -> int:
    """The attention data-parallel rank (ranks with equal ones hold the same tokens: the TP
    ranks of one model replica, sequence parallelism being refused)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_data_parallel_rank()


class _Weight(torch.nn.Module):
    """A bare parameter holder (so the state dict reads ``<name>.weight``)."""

    def __init__(self, shape: tuple[int, ...], config: Any, expert: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(shape, dtype=config.params_dtype, device=_init_device(config))
        )
        if config.perform_initialization:
            torch.nn.init.normal_(self.weight, std=float(getattr(config, "init_method_std", 0.02)))
        if expert:
            self.weight.allreduce = False  # megatron's mark of expert parameters


class _Router(_Weight):
    """The router weight [E, H]; called, the router logits ``det_gemm(x, weight.t())`` in the
    model dtype (``moe_router``'s first step: the audit's localisation hooks this module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.det_gemm(x, self.weight.t())


class RLSharedExpert(torch.nn.Module):
    """Shared expert ``fc2(silu_and_mul(fc1(x)))`` (fc1 rows ``[gate; up]``), with an optional
    sigmoid gate whose logits ``det_gemm(x, gate_weight.t())`` join ``moe_combine``."""

    def __init__(self, config: Any, size: int, gate: bool) -> None:
        super().__init__()
        self.tp = _config_tp(config)
        if size % self.tp:
            raise UnsupportedNumericsError(
                f"rl_engine Megatron MoE layer: the shared expert's intermediate size {size} "
                f"does not divide over tensor_model_parallel_size={self.tp}"
            )
        h = config.hidden_size
        self.linear_fc1 = _Weight((2 * size // self.tp, h), config)  # [gate_r; up_r]
        self.linear_fc2 = _Weight((h, size // self.tp), config)
        if gate:
            self.gate_weight = torch.nn.Parameter(
                torch.empty((1, h), dtype=config.params_dtype, device=_init_device(config))
            )
            if config.perform_initialization:
                torch.nn.init.normal_(self.gate_weight, std=0.02)
        else:
            self.gate_weight = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, H] -> (shared output [T, H], gate logits [T, 1] or None)."""
        groups = tpm.groups_for(self.tp)
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        if groups is None:
            out = ops.det_gemm(ops.silu_and_mul(ops.det_gemm(x, w1.t())), w2.t())
        else:  # the dense MLP's TP layers (RLMLP): column-parallel [gate; up] (its input
            # gradient the grouped N reduction), row-parallel down projection (the grouped K
            # reduction); TP = 1 runs the same groups
            ex = tpm.Exchange.over(_tp_group()) if self.tp > 1 else None
            kw = dict(exchange=ex, tp=self.tp, groups=groups)
            h = tpm.tp_linear(x, w1, parallel="column", glu=True, **kw)
            out = tpm.tp_linear(ops.silu_and_mul(h), w2, parallel="row", **kw)
        gate = None if self.gate_weight is None else ops.det_gemm(x, self.gate_weight.t())
        return out, gate


class RLMoELayer(MegatronModule):
    """Megatron MoE layer on rl_engine ops (module docstring).

    Args:
        config: the megatron ``TransformerConfig`` (``num_moe_experts``, ``moe_router_topk``,
            ``moe_ffn_hidden_size``, ``moe_shared_expert_intermediate_size``,
            ``moe_shared_expert_gate``, ``expert_model_parallel_size``).
        submodules: unused (the spec's ``MoESubmodules`` may be passed; megatron's router /
            experts classes are not built).
        layer_number: set by the transformer layer.
        pg_collection: unused (the expert-parallel group comes from ``parallel_state``).
        scoring: ``moe_topk`` scoring (``"softmax"`` or ``"topk_softmax"``); ``None``: from the
            config (:func:`moe_scoring_from_config`).
        renormalize: ``moe_topk``'s renormalisation of the top-k softmax probabilities (with
            ``scoring="softmax"``: Qwen3-MoE ``norm_topk_prob``); ``None``: from the config.
    """

    def __init__(
        self,
        config: Any,
        submodules: Any = None,
        layer_number: int | None = None,
        pg_collection: Any = None,
        scoring: str | None = None,
        renormalize: bool | None = None,
    ) -> None:
        super().__init__(config=config)
        _check_config(config)
        default = moe_scoring_from_config(config)
        self.scoring = default[0] if scoring is None else scoring
        self.renormalize = default[1] if renormalize is None else bool(renormalize)
        if self.scoring not in SCORINGS:
            raise ValueError(f"RLMoELayer: scoring {self.scoring!r}; expected one of {SCORINGS}")
        self.layer_number = layer_number
        self.num_experts = int(config.num_moe_experts)
        self.top_k = int(config.moe_router_topk)
        _, ep, rank = _group_size_rank("expert_model")
        if ep != int(getattr(config, "expert_model_parallel_size", 1) or 1):
            raise ValueError(
                f"RLMoELayer: expert_model_parallel_size={config.expert_model_parallel_size} in "
                f"the config, but megatron's parallel state has an expert-parallel group of {ep}"
            )
        if self.num_experts % ep:
            raise UnsupportedNumericsError(
                f"rl_engine Megatron MoE layer: {self.num_experts} experts do not divide over "
                f"expert_model_parallel_size={ep} (each rank holds E / EP whole experts)"
            )
        _, etp, self.etp_rank = _group_size_rank("expert_tensor")
        if etp != _config_etp(config):
            raise ValueError(
                f"RLMoELayer: expert_tensor_parallel_size={_config_etp(config)} in the config, "
                f"but megatron's parallel state has an expert-TP group of {etp}"
            )
        inter = int(config.moe_ffn_hidden_size)
        if inter % etp:
            raise UnsupportedNumericsError(
                f"rl_engine Megatron MoE layer: moe_ffn_hidden_size={inter} does not divide over "
                f"expert_tensor_parallel_size={etp}"
            )
        self.ep_size, self.etp_size = ep, etp
        self.num_local_experts = self.num_experts // ep
        first = rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        emap = torch.full((self.num_experts,), -1, dtype=torch.long)
        emap[first : first + self.num_local_experts] = torch.arange(self.num_local_experts)
        self.register_buffer("expert_map", emap.to(_init_device(config)), persistent=False)
        h, i = config.hidden_size, inter // etp  # this rank's shard of I: [gate_r; up_r]
        self.router = _Router((self.num_experts, h), config)
        self.experts = torch.nn.Module()
        self.experts.linear_fc1 = _Weight((self.num_local_experts, 2 * i, h), config, expert=True)
        self.experts.linear_fc2 = _Weight((self.num_local_experts, h, i), config, expert=True)
        shared = config.moe_shared_expert_intermediate_size
        self.shared_experts = (
            RLSharedExpert(config, int(shared), bool(config.moe_shared_expert_gate))
            if shared is not None
            else None
        )

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(
        self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        """hidden_states [s, b, H] (or [t, H]) -> (output of the same shape, None).

        ``padding_mask`` is ignored: every row is routed on its own (padding rows cannot change
        a real row's bits); megatron uses it only for its auxiliary-loss statistics."""
        _refuse(bool(kwargs.get("intermediate_tensors")), "partial CUDA-graph MoE execution")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        # moe_router in two steps (the same bits): the logits through the router module
        logits = self.router(x)
        weights, ids = ops.moe_topk(
            logits, self.top_k, scoring=self.scoring, renormalize=self.renormalize
        )
        w13, w2 = self.experts.linear_fc1.weight, self.experts.linear_fc2.weight
        groups = tpm.groups_for(_config_tp(self.config))  # the grouped experts (TP_GROUPS)
        if groups is not None:  # every TP / ETP / EP degree, TP = 1 included
            y = _grouped_experts(x, ids, w13, w2, self.expert_map, groups, self.etp_size)
        elif self.ep_size == 1:
            y = ops.moe_experts(x, ids, w13, w2)
        else:
            y = _ep_experts(x, ids, w13, w2, self.expert_map, self.top_k)
        shared = gate = None
        if self.shared_experts is not None:
            shared, gate = self.shared_experts(x)
        out = ops.moe_combine(y, weights, shared=shared, shared_gate=gate)
        return out.view(shape), None


# ------------------------------------------------------------------------- expert parallelism
class _GatherSlotRows(torch.autograd.Function):
    """x [T, H] of this rank -> the EP group's (token, slot) rows [sum_r T_r * k, H] (each token
    row repeated k times; ranks in order, real rows only).

    Backward: the slot rows' gradients summed over the group (each row's gradient is non-zero
    on the one rank that holds its expert: exact), this rank's rows kept, then each token's k
    slot gradients added in slot order in fp32 with one rounding (``moe_experts``' rule)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: int, counts: list[int], rank: int, group: Any):
        t_max = max(counts)
        padded = x.new_zeros((t_max, x.shape[1]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        torch.distributed.all_gather(parts, padded, group=group)
        rows = torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)], dim=0)
        ctx.k, ctx.counts, ctx.rank, ctx.group, ctx.dtype = k, counts, rank, group, x.dtype
        return rows.repeat_interleave(k, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.contiguous()
        torch.distributed.all_reduce(g, group=ctx.group)
        k, counts = ctx.k, ctx.counts
        start = sum(counts[: ctx.rank]) * k
        mine = g[start : start + counts[ctx.rank] * k].view(counts[ctx.rank], k, -1)
        acc = torch.zeros(mine.shape[0], mine.shape[2], dtype=torch.float32, device=g.device)
        for s in range(k):
            acc = acc + mine[:, s].float()
        return acc.to(ctx.dtype), None, None, None, None


class _SumRowsOverGroup(torch.autograd.Function):
    """Sum over the EP group of per-slot outputs that are non-zero on one rank only (exact),
    then this rank's rows ``[start, start + n)``. Backward: the rows' gradient placed back and
    summed over the group (again one non-zero rank per row)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, start: int, n: int, group: Any):
        y = y.contiguous()
        torch.distributed.all_reduce(y, group=group)
        ctx.start, ctx.n, ctx.rows, ctx.group = start, n, y.shape[0], group
        return y[start : start + n]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        full[ctx.start : ctx.start + ctx.n] = grad
        torch.distributed.all_reduce(full, group=ctx.group)
        return full, None, None, None


def _ep_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor,
    k: int,
    groups: int | None = None,
) -> torch.Tensor:
    """``moe_experts`` over the expert-parallel group (module docstring): [T, k, H]."""
    group, ep, rank = _group_size_rank("expert_model")
    t = x.shape[0]
    n = torch.tensor([t], dtype=torch.long, device=x.device)
    sizes = [torch.empty_like(n) for _ in range(ep)]
    torch.distributed.all_gather(sizes, n, group=group)
    counts = [int(c.item()) for c in sizes]
    rows = _GatherSlotRows.apply(x, k, counts, rank, group)  # [N k, H]
    id_pad = ids.new_zeros((max(counts), k))
    id_pad[:t] = ids
    id_parts = [torch.empty_like(id_pad) for _ in range(ep)]
    torch.distributed.all_gather(id_parts, id_pad, group=group)
    all_ids = torch.cat([p[:c] for p, c in zip(id_parts, counts, strict=True)], dim=0)
    y = ops.moe_experts(rows, all_ids.reshape(-1, 1), w13, w2, expert_map=expert_map,
                        groups=groups)  # fmt: skip
    start = sum(counts[:rank]) * k
    mine = _SumRowsOverGroup.apply(y.view(-1, x.shape[1]), start, t * k, group)
    return mine.view(t, k, x.shape[1])


# ------------------------------------------------------- the grouped experts over TP, ETP, EP
class _Plan:
    """Who holds which token rows in the expert-parallel group (module docstring).

    ``counts[j]``: the rows member ``j`` contributes to the gathered batch (0 for a rank whose
    tokens an earlier member of the group already holds: a TP replica), ``start``: the first
    gathered row of this rank's tokens, ``mine``: whether this rank contributed them."""

    def __init__(self, t: int, device: torch.device) -> None:
        from rl_engine.ops.det_gemm.tp import Exchange

        self.ep_group, self.ep, rank = _group_size_rank("expert_model")
        self.etp_group, self.etp, _ = _group_size_rank("expert_tensor")
        self.exchange = Exchange.over(self.etp_group) if self.etp > 1 else None
        self.t, self.counts, self.start, self.mine = t, [t], 0, True
        if self.ep == 1:
            return
        me = torch.tensor([t, _data_parallel_rank()], dtype=torch.long, device=device)
        got = [torch.empty_like(me) for _ in range(self.ep)]
        torch.distributed.all_gather(got, me, group=self.ep_group)
        sizes = [int(g[0].item()) for g in got]
        keys = [int(g[1].item()) for g in got]
        first = [keys.index(key) for key in keys]  # the member holding each rank's tokens
        self.counts = [n if first[j] == j else 0 for j, n in enumerate(sizes)]
        self.start = sum(self.counts[: first[rank]])
        self.mine = first[rank] == rank

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows [T, ...] -> the group's batch [N, ...] (the contributing members'
        rows, in member order; identical on every member)."""
        if self.ep == 1:
            return x
        padded = x.new_zeros((max(self.counts), *x.shape[1:]))
        if self.mine:
            padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in self.counts]
        torch.distributed.all_gather(parts, padded.contiguous(), group=self.ep_group)
        return torch.cat([p[:n] for p, n in zip(parts, self.counts, strict=True)], dim=0)

    def sum_rows(self, y: torch.Tensor) -> torch.Tensor:
        """Sum over the EP group of rows that are non-zero on one member only: exact."""
        if self.ep > 1:
            y = y.contiguous()
            torch.distributed.all_reduce(y, group=self.ep_group)
        return y

    def own(self, y: torch.Tensor, k: int) -> torch.Tensor:
        """This rank's (token, slot) rows of the batch's [N k, H]."""
        return y[self.start * k : (self.start + self.t) * k]

    def combine(self, sub: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The ETP ranks' fp32 subtrees [rows, H] -> the rounded rows (the tree's top levels,
        one rounding: :class:`~rl_engine.ops.det_gemm.tp.Exchange`)."""
        if self.exchange is None:
            return tpm.finish(sub, None, dtype)
        return self.exchange(sub, None, dtype)


def _kernels(provider: str, device: torch.device) -> Any:
    """The dense ops of the ``moe_experts`` provider ``provider``'s family (its ``det_gemm`` /
    ``silu_and_mul`` providers of the same name, whose bits its expert rows are), and the
    ``det_gemm`` provider the grouped input gradient runs (resolved as ``det_gemm_tp``)."""
    from rl_engine.ops.moe_experts import reference
    from rl_engine.registry import KernelRegistry

    gemm = tpm._resolve(device.type, provider)
    if provider == "native":
        return reference._native(), gemm
    mm = KernelRegistry.provider("det_gemm", provider)
    act = KernelRegistry.provider("silu_and_mul", provider)
    kern = reference.Kernels(mm.fn, mm.extras["wgrad"], act.fn, act.extras["backward"])
    return kern, gemm


def _experts_rows(x, ids, w13, w2, expert_map, groups: int, plan: _Plan, provider: str):
    """The gathered batch's per-slot expert rows [N k, H] in ``x.dtype``: this rank's fp32
    subtrees (its experts, its ``I / ETP`` shard; ``+0`` rows for the other experts), combined
    over the ETP group, rounded once (the negative control of the tests replaces this)."""
    from rl_engine.ops.moe_experts import moe_experts_subtree

    sub = moe_experts_subtree(x, ids, w13, w2, groups, expert_map=expert_map, backend=provider)
    return plan.combine(sub.view(-1, x.shape[1]), x.dtype)


class _GroupedExperts(torch.autograd.Function):
    """The grouped experts of one rank of the TP x EP layout (module docstring): [T, k, H].

    Forward: the group's token rows gathered (:class:`_Plan`), :func:`_experts_rows`, the EP
    sum, this rank's rows. Backward: the rows' gradients placed in the batch and summed over
    the EP group (each row non-zero on one member: exact); per local expert, as
    ``moe_experts``' backward (``da``, ``dh``, ``dw2``, ``dw13`` per element of the shard: the
    TP = 1 values of its columns), but the slot input gradient ``dh @ w13[e]`` (K = 2 I,
    sharded) is the grouped N reduction (``glu``: gate group j with up group j, as the dense
    column-parallel fc1), its ETP subtrees combined like the forward's, one rounding; the EP
    sum; this rank's slots added in slot order in fp32, one rounding."""

    @staticmethod
    def forward(ctx, x, ids, w13, w2, expert_map, groups, plan, provider):
        k = ids.shape[1]
        xs, all_ids = plan.gather(x), plan.gather(ids)
        emap = expert_map if plan.ep > 1 else None
        y = plan.sum_rows(_experts_rows(xs, all_ids, w13, w2, emap, groups, plan, provider))
        ctx.save_for_backward(xs, all_ids, w13, w2, emap)
        ctx.meta = (groups, plan, provider, x.dtype)
        return plan.own(y, k).reshape(x.shape[0], k, x.shape[1])

    @staticmethod
    def backward(ctx, grad):
        from rl_engine.ops.moe_experts import reference

        xs, all_ids, w13, w2, emap = ctx.saved_tensors
        groups, plan, provider, dtype = ctx.meta
        n, k = all_ids.shape
        hdim = xs.shape[1]
        g = grad.reshape(-1, hdim).to(dtype)
        if plan.ep > 1:
            full = g.new_zeros((n * k, hdim))
            if plan.mine:
                plan.own(full, k).copy_(g)
            g = plan.sum_rows(full)
        kern, gemm = _kernels(provider, xs.device)
        dsub = torch.zeros((n * k, hdim), dtype=torch.float32, device=xs.device)
        dw13 = torch.zeros(w13.shape, dtype=torch.float32, device=w13.device)
        dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device)
        for e, rows in reference.groups(all_ids, emap, w13.shape[0]):
            dh, dw13[e], dw2[e] = reference.expert_backward(
                xs[rows // k], g[rows], w13[e], w2[e], kern
            )
            dsub[rows] = tpm.subtree(dh, w13[e], groups, glu=True, backend=gemm)
        dxs = plan.sum_rows(plan.combine(dsub, dtype))
        dx = reference.sum_slots(plan.own(dxs, k).reshape(plan.t, k, hdim))
        need = ctx.needs_input_grad
        return (dx if need[0] else None, None, dw13.to(w13.dtype) if need[2] else None,
                dw2.to(w2.dtype) if need[3] else None, None, None, None, None)  # fmt: skip


def _grouped_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor,
    groups: int,
    etp: int,
) -> torch.Tensor:
    """``moe_experts(x, ids, W13, W2, groups=groups)`` of the whole experts (module
    docstring), from this rank's experts and ``I / etp`` shard: [T, k, H]."""
    from rl_engine.ops.moe_experts import tp as etpm

    tpm.check_split(w2.shape[-1] * etp, etp, what="RLMoELayer experts", groups=groups, glu=False)
    provider = etpm.resolve(x.device.type)
    plan = _Plan(x.shape[0], x.device)
    return _GroupedExperts.apply(x, ids, w13, w2, expert_map, groups // etp, plan, provider)
