"""Mixture-of-experts layers of vLLM through rl_engine's MoE ops.

vLLM builds every MoE layer of Qwen3-MoE, Mixtral and Qwen2-MoE as a ``MoERunner`` (0.24:
``FusedMoE(...)``, 0.32: ``FusedMoEFactory(...)``; the same class in both). While the plugin is
on, ``MoERunner.forward`` is replaced by :func:`moe_forward`:

* router logits: the model-dtype ``det_gemm`` of the gate (the model's ``ReplicatedLinear`` /
  ``GateLinear``, routed by the linear patches; a gate the runner holds itself, as Qwen3-MoE's,
  is called the same way);
* ``weights, ids = moe_topk(logits, k, scoring=..., renormalize=...)`` with ONE scoring per
  family, the one the trainer adapters use (:func:`routing_for`): Qwen3-MoE and Qwen2-MoE
  ``"softmax"`` with ``renormalize=norm_topk_prob``; Mixtral ``"topk_softmax"`` (vLLM runs
  Mixtral as softmax + renormalize, the same function mathematically, other bits);
* ``y = moe_experts(x, ids, w13_weight, w2_weight, expert_map=..., groups=G)`` per top-k
  slot, [T, k, H], with ``G = groups_for(tensor_parallel_size)`` (the rule of the dense
  row-parallel layers, :func:`rl_engine.ops.det_gemm.tp.groups_for`: the grouped experts of
  family ``moe_experts_tp/g<G>[...]`` at TP > 1, and at TP 1 when ``RL_ENGINE_TP_GROUPS`` is
  set; ``None``: the plain experts);
* tensor-parallel experts (TP t > 1 without expert parallelism, vLLM's default: every expert's
  intermediate size ``I`` sharded, ``w13_weight`` [E, 2I/t, H] = ``[gate_r; up_r]``,
  ``w2_weight`` [E, H, I/t]): ``rl_engine::moe_experts_tp`` (one custom op, opaque to
  torch.compile): this rank's fp32 subtrees of ``G / t`` groups
  (``moe_experts_subtree``), exchanged over vLLM's TP group by the exchange the row-parallel
  layers use (``compat.tp_exchange()``, built by ``compat.build_tp_exchange``): every rank gets
  the whole ``[T, k, H]`` rows of TP 1, rounded once; the model must keep ``I`` divisible into
  ``G`` groups (``check_split``);
* expert parallelism (``enable_expert_parallel``): ``expert_map`` gives this rank's experts
  (whole experts: all ``G`` groups local, no exchange); the other slots are ``+0`` rows, so the
  sum of ``y`` over the EP group (:func:`ep_slot_sum`) is exact in any order (one nonzero term
  per element);
* ``out = moe_combine(y, weights, shared=..., shared_gate=...)``: the shared expert (Qwen2-MoE)
  runs its MLP through the routed linear / ``silu_and_mul`` layers (at TP > 1 its column-
  parallel ``gate_up_proj`` gives this rank's columns, its ``down_proj`` - built with
  ``reduce_results=False`` - runs :func:`rl_engine.adapters.vllm.patches.row_parallel_full`: the
  whole output, rounded once), and its output and its sigmoid gate's logits join inside
  ``moe_combine`` (fp32, one rounding), not in vLLM's bf16 ``sigmoid(g) * out`` and
  ``shared + routed`` adds.

vLLM's own TP / EP all-reduce of the MoE output: in vLLM 0.24 and 0.32 it is inside
``MoERunner.forward`` (``_maybe_reduce_final_output``, and ``_maybe_reduce_shared_expert_output``
for a pre-reduced combine), which the patched forward replaces as a whole, so it never runs:
the result above is already complete on every rank and nothing adds it again. The supported
model blocks (``Qwen3MoeSparseMoeBlock``, ``MixtralMoE``, ``Qwen2MoeSparseMoeBlock``) do not
all-reduce in either version (checked in both sources: older vLLMs did, in the block, through
``maybe_all_reduce_tensor_model_parallel``). A runner built with ``reduce_results=False``
(0.32: ``moe_config.skip_final_all_reduce``; 0.24 has no such argument), whose block would
all-reduce the output itself, is refused (:func:`rl_engine.adapters.vllm.compat.moe_block_reduces`).

No path leads into vLLM's fused-MoE kernels (router, ``fused_experts``, modular kernels) while
the plugin is on; ``UnquantizedFusedMoEMethod.process_weights_after_loading`` keeps the expert
weights as loaded (vLLM would repack / shuffle them for its kernels).

Refused, with the reason (:func:`moe_unroutable`; strict mode refuses the model at load):
quantized experts, non-SiLU activations, grouped top-k / ``e_score_correction_bias`` / custom
routing functions / sigmoid scoring / other routers (DeepSeek-style, zero experts, routing
simulation, fused shared experts), a routed scaling factor, router weight on the input, expert
biases or SwiGLU limits, latent transforms, EPLB / redundant experts, LoRA, capacity factors
(token dropping), data / context / sequence parallel MoE, an MoE whose block all-reduces the
output itself (``reduce_results=False``), a TP degree not dividing the ``G`` groups or an
intermediate size (routed or shared expert) not divisible into them, an experts provider
without the grouped form (no ``"subtree"`` extra) where groups are on, and a shared expert whose
MLP is sharded otherwise than over the model's TP group.
"""

from __future__ import annotations

from typing import Any

import torch

# The rl_engine ops a routed MoE layer runs (registry op names; ``moe_topk`` is ``moe_router``'s).
MOE_OPS = ("moe_router", "moe_experts", "moe_combine")

SUPPORTED_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")

ATTR = "_rl_engine_moe"  # the routing a checked runner carries (set by :func:`annotate`)

# Routers whose selection is the plain softmax top-k (all other router classes are refused).
_PLAIN_ROUTERS = ("FusedTopKRouter", "CPURouter")


def routing_for(hf_config: Any) -> tuple[tuple[str, bool] | None, str | None]:
    """``((scoring, renormalize), None)`` for a supported MoE checkpoint, else ``(None,
    reason)``. The rule is :func:`rl_engine.adapters._moe.moe_spec`'s, the one the HF and
    Megatron adapters read: Qwen3-MoE / Qwen2-MoE ``softmax`` with ``norm_topk_prob``, Mixtral
    ``topk_softmax``."""
    spec, reason = _spec(hf_config)
    if spec is None:
        return None, reason
    return (spec.scoring, spec.renormalize), None


def _spec(hf_config: Any) -> tuple[Any, str | None]:
    from rl_engine.adapters._moe import moe_spec

    archs = list(getattr(hf_config, "architectures", None) or [])
    try:
        spec = moe_spec(hf_config)
    except ValueError as exc:
        return None, str(exc)
    if spec is None or not any(a in SUPPORTED_MOE_ARCHITECTURES for a in archs):
        return None, (
            f"mixture of experts in architecture {archs} (model_type "
            f"{getattr(hf_config, 'model_type', None)!r}; supported: "
            f"{', '.join(SUPPORTED_MOE_ARCHITECTURES)})"
        )
    return spec, None


def shared_mlp(runner: Any) -> Any:
    """The shared-expert MLP module of a runner, or ``None``."""
    shared = getattr(runner, "_shared_experts", None)
    return None if shared is None else shared._layer


def _shared_reason(mlp: Any, lay: Any, model_tp: int, groups: int | None) -> str | None:
    """Why a shared-expert MLP cannot run through :func:`moe_forward`, or ``None``."""
    need = {
        "gate_up_proj": lay.MergedColumnParallelLinear,
        "down_proj": lay.RowParallelLinear,
        "act_fn": lay.SiluAndMul,
    }
    for name, cls in need.items():
        sub = getattr(mlp, name, None)
        if type(sub) is not cls:
            return (
                f"shared expert {type(mlp).__name__} without a plain {name} "
                f"({cls.__name__}); found {type(sub).__name__}"
            )
    down, up = mlp.down_proj, mlp.gate_up_proj
    if down.tp_size != up.tp_size or down.tp_size not in (1, model_tp):
        return (
            f"shared expert sharded over TP {up.tp_size} (gate_up) / {down.tp_size} (down); "
            f"expected the model's TP {model_tp} or 1"
        )
    if down.tp_size > 1:
        if not down.input_is_parallel or up.gather_output:
            return "shared expert with input_is_parallel=False / gather_output=True"
        from rl_engine.ops.det_gemm import tp as tpm

        try:
            tpm.check_split(down.input_size, down.tp_size, what="shared expert down_proj",
                            groups=groups or tpm.TP_GROUPS)  # fmt: skip
        except ValueError as exc:
            return str(exc)
    gate = getattr(mlp, "expert_gate", None)
    if gate is not None:
        if type(gate) is not lay.ReplicatedLinear:
            return f"shared-expert gate {type(gate).__name__} (expected ReplicatedLinear)"
        if gate.output_size != 1:
            return f"shared-expert gate with {gate.output_size} outputs (expected 1)"
    return None


def moe_unroutable(runner: Any, vllm_config: Any) -> str | None:
    """Why :func:`moe_forward` cannot compute this ``MoERunner`` exactly, or ``None``."""
    from rl_engine.adapters.vllm import compat

    lay = compat.layers()
    moe = compat.moe_layers()
    hf_config = vllm_config.model_config.hf_config
    hf_text = getattr(vllm_config.model_config, "hf_text_config", hf_config)
    spec, reason = _spec(hf_config)
    if reason:
        return reason
    routing = (spec.scoring, spec.renormalize)
    from rl_engine.adapters._moe import token_dropping_reason

    reason = token_dropping_reason(hf_text)
    if reason:
        return reason
    experts = runner.routed_experts
    cfg = runner.moe_config
    qm = experts.quant_method
    if type(qm) is not moe.UnquantizedFusedMoEMethod:
        return f"quantized MoE ({type(qm).__name__})"
    act = getattr(experts.activation, "value", experts.activation)
    if act != "silu":
        return f"MoE activation {act!r} (supported: silu)"
    router = runner.router
    rname = type(router).__name__
    if rname not in _PLAIN_ROUTERS:
        return f"MoE router {rname} (supported: plain softmax top-k)"
    if experts.use_grouped_topk or getattr(router, "use_grouped_topk", False):
        return "grouped top-k routing (use_grouped_topk, DeepSeek-style)"
    if experts.e_score_correction_bias is not None:
        return "MoE routing with e_score_correction_bias"
    if experts.custom_routing_function is not None:
        return "a custom MoE routing function"
    if experts.scoring_func != "softmax":
        return f"MoE scoring {experts.scoring_func!r} (supported: softmax)"
    if getattr(router, "_hash_indices_table", None) is not None:
        return "hash-table MoE routing"
    if getattr(router, "eplb_state", None) is not None or cfg.moe_parallel_config.enable_eplb:
        return "EPLB / redundant experts (the physical expert of a token changes with load)"
    if experts.routed_scaling_factor != 1.0 or runner.routed_scaling_factor != 1.0:
        return "a routed scaling factor"
    if experts.apply_router_weight_on_input:
        return "router weight applied on the input"
    if cfg.has_bias or any(
        getattr(experts, f, None) is not None
        for f in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")
    ):
        return "expert biases or SwiGLU limits"
    if runner.routed_input_transform is not None or runner.routed_output_transform is not None:
        return "latent MoE (routed input / output transforms)"
    if getattr(runner, "shared_expert_gate", None) is not None:
        return "a shared-expert gate fused into the router GEMM"
    if getattr(experts, "rocm_aiter_fmoe_enabled", False):
        return "ROCm AITER fused MoE (its expert mask is not an expert map)"
    if getattr(cfg, "is_lora_enabled", False):
        return "LoRA on MoE layers"
    if cfg.dp_size > 1 or cfg.pcp_size > 1 or cfg.is_sequence_parallel:
        return (
            f"data / context / sequence parallel MoE (DP {cfg.dp_size}, PCP {cfg.pcp_size}, "
            f"SP {cfg.is_sequence_parallel}): tokens are dispatched across ranks"
        )
    model_tp = _model_tp(vllm_config)
    expert_tp = _expert_tp(cfg)
    if expert_tp > 1 and expert_tp != model_tp:
        return f"tensor-parallel experts over {expert_tp} ranks, the model's TP is {model_tp}"
    if compat.moe_block_reduces(cfg) and model_tp > 1:
        return (
            "an MoE layer built with reduce_results=False (its model block all-reduces the "
            "output itself, which would add the complete routed output again)"
        )
    from rl_engine.ops.det_gemm import tp as tpm

    try:
        groups = tpm.groups_for(model_tp)
    except ValueError as exc:
        return str(exc)
    if getattr(cfg.moe_parallel_config, "use_all2all_kernels", False):
        return "all-to-all MoE dispatch kernels"
    scoring, renorm = routing
    if scoring == "softmax" and bool(experts.renormalize) != renorm:
        return f"vLLM renormalize={experts.renormalize} but norm_topk_prob={renorm}"
    w13, w2 = experts.w13_weight, experts.w2_weight
    n_local = experts.local_num_experts
    h = cfg.hidden_dim
    inter = w2.shape[-1]
    if (
        w13.dim() != 3
        or tuple(w13.shape) != (n_local, 2 * inter, h)
        or tuple(w2.shape) != (n_local, h, inter)
    ):
        return (
            f"expert weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} not in the "
            f"[E={n_local}, 2I, H={h}] / [E, H, I] layout"
        )
    if inter * expert_tp != spec.intermediate:
        return (
            f"expert intermediate size {inter} x TP {expert_tp} != the model's "
            f"{spec.intermediate} (padded)"
        )
    if groups is not None:
        from rl_engine.ops.moe_experts import tp as moe_tp
        from rl_engine.registry import RLEngineError

        try:
            tpm.check_split(spec.intermediate, expert_tp, what="MoE experts (intermediate size)",
                            groups=groups)  # fmt: skip
            moe_tp.resolve(_device_type(vllm_config))
        except (ValueError, RLEngineError) as exc:
            return str(exc)
    if runner.routed_experts.top_k != spec.top_k:
        return f"vLLM top-k {runner.routed_experts.top_k} != num_experts_per_tok {spec.top_k}"
    if w13.dtype != vllm_config.model_config.dtype:
        return f"expert weights in {w13.dtype} (model dtype {vllm_config.model_config.dtype})"
    mlp = shared_mlp(runner)
    if (mlp is not None) != (spec.shared_intermediate > 0):
        return (
            f"a shared expert in vLLM ({mlp is not None}) but not in the trainers' reading of "
            f"the config (shared_expert_intermediate_size {spec.shared_intermediate}), or back"
        )
    if mlp is not None:
        reason = _shared_reason(mlp, lay, model_tp, groups)
        if reason:
            return reason
    gate = runner.gate
    if gate is not None and not isinstance(gate, lay.ReplicatedLinear):
        return f"MoE gate {type(gate).__name__} held by the runner"
    return None


def _model_tp(vllm_config: Any) -> int:
    return int(vllm_config.parallel_config.tensor_parallel_size)


def _expert_tp(cfg: Any) -> int:
    """How many ranks share every expert (its ``I`` sharded): vLLM's MoE TP degree without
    expert parallelism, 1 with it (whole experts per rank)."""
    return 1 if cfg.use_ep else int(cfg.tp_size)


def _device_type(vllm_config: Any) -> str:
    device = vllm_config.device_config.device
    return torch.device(device).type if device is not None else "cpu"


def annotate(runner: Any, vllm_config: Any) -> dict[str, Any]:
    """Record on ``runner`` the routing :func:`moe_forward` runs (after the check passed) and
    return its provenance entry: the routing, the expert-parallel and expert-TP degrees, the
    group count ``G`` (``None``: the plain experts) and the experts' numerics family."""
    from rl_engine.ops.det_gemm import tp as tpm

    routing, _ = routing_for(vllm_config.model_config.hf_config)
    assert routing is not None
    scoring, renorm = routing
    cfg = runner.moe_config
    ep = int(cfg.ep_size) if cfg.use_ep else 1
    groups = tpm.groups_for(_model_tp(vllm_config))
    mlp = shared_mlp(runner)
    if groups is None:
        numerics = None  # the plain family: the registry's moe_experts record
    else:
        from rl_engine.ops.moe_experts import tp as moe_tp

        numerics = moe_tp.family(_device_type(vllm_config), groups=groups)
    info = {
        "scoring": scoring,
        "renormalize": renorm,
        "top_k": int(runner.routed_experts.top_k),
        "num_experts": int(runner.routed_experts.global_num_experts),
        "local_experts": int(runner.routed_experts.local_num_experts),
        "expert_parallel": ep,
        "expert_tp": _expert_tp(cfg),
        "groups": groups,
        "experts_numerics": numerics,
        "shared_expert": mlp is not None,
        "shared_tp": int(mlp.down_proj.tp_size) if mlp is not None else 1,
    }
    setattr(runner, ATTR, info)
    return {**info, "ops": list(MOE_OPS)}


def ep_slot_sum(y: torch.Tensor, all_reduce: Any) -> torch.Tensor:
    """The [T, k, H] per-slot expert outputs of every rank of an expert-parallel group, from
    this rank's (non-local slots ``+0``): a sum-all-reduce over the group, exact in any order
    and precision because each element has at most one nonzero term (``x + 0 == x``; a ``-0``
    may come back ``+0``, which :func:`rl_engine.ops.moe_combine` adds to its ``+0``
    accumulator the same way). ``all_reduce(t) -> t`` is the group's sum."""
    return all_reduce(y)


def _shared_parts(mlp: Any, x: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shared expert's MLP output and its gate logits ([T, 1], or ``None``), each through
    the routed (patched) linear / activation layers: no arithmetic here. ``tp`` > 1: its MLP
    is TP-sharded (``gate_up_proj`` gives this rank's ``[gate_r; up_r]`` columns); the down
    projection's whole output comes from the TP-invariant reduction
    (:func:`~rl_engine.adapters.vllm.patches.row_parallel_full`), not from vLLM's all-reduce."""
    gate_up, _ = mlp.gate_up_proj(x)
    act = mlp.act_fn(gate_up)
    if tp > 1:
        from rl_engine.adapters.vllm import patches

        out = patches.row_parallel_full(mlp.down_proj, act)
    else:
        out, _ = mlp.down_proj(act)
    gate = getattr(mlp, "expert_gate", None)
    logits = gate(x)[0] if gate is not None else None
    return out, logits


def _make_runner_forward(original):
    def forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
        """rl_engine's MoE layer (see :mod:`rl_engine.adapters.vllm.moe`)."""
        from rl_engine.adapters.vllm import compat, patches
        from rl_engine.ops import moe_combine, moe_experts, moe_topk
        from rl_engine.ops.moe_experts.tp import moe_experts_tp

        info = getattr(self, ATTR, None)
        if info is None:
            patches._unrouted_call(
                self, "an MoE layer that the load-time check did not accept (see provenance)"
            )
            return original(self, hidden_states, router_logits, input_ids)
        x = hidden_states
        logits = router_logits
        if self.gate is not None:  # the runner holds the gate (Qwen3-MoE): routed linear
            logits, _ = self.gate(x)
        weights, ids = moe_topk(
            logits, info["top_k"], scoring=info["scoring"], renormalize=info["renormalize"]
        )
        capture = getattr(self.router, "capture_fn", None)
        if capture is not None:  # vLLM's routing capture (enable_return_routed_experts)
            capture(ids)
        experts = self.routed_experts
        w13, w2, groups, etp = (
            experts.w13_weight,
            experts.w2_weight,
            info["groups"],
            info["expert_tp"],
        )
        if etp > 1:  # this rank's I / t shard: its subtrees, exchanged over the TP group
            y = moe_experts_tp(x, ids, w13, w2, groups // etp, compat.tp_exchange())
        else:
            expert_map = experts.expert_map if info["expert_parallel"] > 1 else None
            y = moe_experts(x, ids, w13, w2, expert_map=expert_map, groups=groups)
            if info["expert_parallel"] > 1:
                y = ep_slot_sum(y, compat.ep_all_reduce)
        shared = shared_gate = None
        mlp = shared_mlp(self)
        if mlp is not None:
            shared_in = x if shared_experts_input is None else shared_experts_input
            shared, shared_gate = _shared_parts(mlp, shared_in, info["shared_tp"])
        return moe_combine(y, weights, shared=shared, shared_gate=shared_gate)

    return forward


def _make_keep_moe_weights(original):
    def process_weights_after_loading(self, layer):
        """Keep ``w13_weight`` / ``w2_weight`` as loaded: the routed experts read them directly
        (vLLM would repack them for its own kernels, which the plugin never calls)."""
        return None

    return process_weights_after_loading


def _make_no_modular_kernel(original):
    def maybe_init_modular_kernel(self, *args, **kwargs):
        """No vLLM modular kernel (prepare / finalize all-to-all, fused experts): the routed
        ``forward`` sums the per-slot rows over the EP group itself. CUDA vLLM calls this at
        load for expert parallelism; on the weights the plugin keeps as loaded, vLLM's own
        initialisation refuses to run (seen on vLLM 0.24, 2 x H200, EP 2)."""
        return None

    return maybe_init_modular_kernel


def _make_gate_forward(original):
    from rl_engine.adapters.vllm import compat

    replicated_forward = compat.layers().ReplicatedLinear.forward

    def forward(self, x):
        """vLLM 0.32's ``GateLinear``: the plain ``ReplicatedLinear`` path (the routed
        ``det_gemm`` in the model dtype); never its specialised router GEMMs. A requested fp32
        ``out_dtype`` is an exact upcast of the model-dtype logits."""
        from rl_engine.adapters.vllm import patches

        if not self.is_unquantized or self.weight.dtype != x.dtype:
            patches._unrouted_call(self, gate_unroutable(self) or "router GEMM input dtype")
            return original(self, x)
        out = replicated_forward(self, x)
        out_dtype = self.out_dtype
        if out_dtype is None:
            return out
        if isinstance(out, tuple):
            return (out[0].to(out_dtype), out[1])
        return out.to(out_dtype)

    return forward


def gate_unroutable(module: Any) -> str | None:
    """Why a ``GateLinear`` (vLLM 0.32) cannot take the routed path, or ``None``."""
    if not getattr(module, "is_unquantized", True):
        return "quantized MoE router gate"
    return None


def apply_patches(patch: Any) -> None:
    """Patch the MoE classes this vLLM has (``patch`` is :func:`patches._patch`)."""
    from rl_engine.adapters.vllm import compat

    moe = compat.moe_layers()
    patch(moe.MoERunner, "forward", _make_runner_forward)
    patch(moe.UnquantizedFusedMoEMethod, "process_weights_after_loading", _make_keep_moe_weights)
    if hasattr(moe.MoERunner, "maybe_init_modular_kernel"):
        patch(moe.MoERunner, "maybe_init_modular_kernel", _make_no_modular_kernel)
    if moe.GateLinear is not None:
        patch(moe.GateLinear, "forward", _make_gate_forward)
