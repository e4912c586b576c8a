"""In-place patch of a transformers Llama / Qwen2 / Qwen3 model, or a mixture-of-experts
Qwen3-MoE / Mixtral / Qwen2-MoE model, onto rl_engine ops.

Per module instance (the class is untouched; ``module.forward`` becomes an instance attribute,
a callable object that holds the module it patches (never a closure over it) and carries
``_rl_engine_patched = True``; its ``__wrapped__`` is the original bound ``forward``). Because the
module is an attribute, ``copy.deepcopy(model)`` (how TRL builds a reference policy) and pickling
re-bind every patched forward to the copy's own modules: a copy computes with its own weights and
stays patched.

* ``nn.Linear`` (q/k/v/o, gate/up/down, ``lm_head``): ``det_gemm(x, W.t(), bias)``; q/k/v and
  gate/up as one GEMM each (``det_gemm_cat`` of their weights, not kept for the backward).
  ``det_gemm`` is column invariant, so fused or separate, they give the bits of vLLM's fused
  QKV (gate_up) GEMM.
* ``*RMSNorm`` (layer norms, final norm, Qwen3 q/k norms): ``rms_norm(x, w, eps)``. The decoder
  layer's ``residual + h`` (model dtype) followed by the norm equals vLLM's fused
  ``rms_norm(x, w, eps, residual)`` bitwise.
* ``*MLP``: ``down(silu_and_mul(gate_up(x)))`` (gate first, as vLLM's gate_up).
* ``*Attention``: projections, q/k norm, ``rope`` on q and k (neox layout, positions from
  ``position_ids``), then ``attention`` (varlen, causal; padding and packed sequences become
  ``cu_seqlens``) or, when decoding against a KV cache (``generate``), ``paged_attention`` on the
  cached keys/values, then ``o_proj``.
* ``*TopKRouter`` (MoE gate): ``moe_router``: logits ``det_gemm(x, W.t())`` (model dtype),
  then ``moe_topk`` (Qwen3-MoE / Qwen2-MoE: ``scoring="softmax"``, ``renormalize =
  config.norm_topk_prob``; Mixtral: ``scoring="topk_softmax"``). It returns HF's ``(logits [T,
  E], weights [T, k], ids [T, k])``, so ``output_router_logits`` and the load-balancing loss see
  the (rl_engine) logits as before; the weights are fp32 (HF rounds Qwen's to the model dtype).
* ``*SparseMoeBlock``: ``gate`` (the router above), ``moe_experts(x, ids, w13, w2)`` on the
  experts' own ``gate_up_proj`` [E, 2I, H] (gate rows, then up) / ``down_proj`` [E, H, I]
  parameters (no copy), then ``moe_combine(y, weights, shared=..., shared_gate=...)``: the k
  expert rows in top-k slot order in fp32, one rounding. Qwen2-MoE's shared expert (a patched
  ``*MLP``) and its gate logits ``shared_expert_gate(x)`` (a patched ``Linear``) join inside
  ``moe_combine``, last. The ``*Experts`` module's own forward (not called by the patched
  block) is patched too, for direct callers: ``moe_combine(moe_experts(...), weights)``.
  With the TP-invariant reduction on (``RL_ENGINE_TP_GROUPS``; the trainer is TP 1, so
  ``groups_for(1)``) the experts run its grouped form, ``moe_experts(..., groups=G)``: the bits
  of a rollout whose experts are TP-sharded (vLLM at TP 2 / 4 without expert parallelism).
  Refused: Mixtral's ``router_jitter_noise > 0`` (random routing in training), capacity /
  token-dropping settings, experts stored other than transformers 5's fused layout.
* ``config._attn_implementation`` is set to ``"rl_engine"`` (registered in transformers'
  ``AttentionInterface``, with the flash-attention style 2-D padding mask), so the attention
  receives the padding mask as [B, kv_len] booleans.

Deliberately left alone: the embedding lookup (a row gather, exact), the residual adds of the
decoder layer (model dtype, the same op vLLM runs), the rotary-embedding module (its cos/sin are
computed but ignored: rl_engine's ``rope`` builds its own tables), the loss function and the
generation utilities (sampling is not an rl_engine op).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from rl_engine import ops
from rl_engine.adapters._moe import MOE_FAMILIES, MoESpec, moe_spec, token_dropping_reason
from rl_engine.ops.det_gemm import tp as tpm

__all__ = ["is_patched", "patch_model", "rope_kwargs", "unpatch_model"]

MARK = "_rl_engine_patched"
ATTN_NAME = "rl_engine"
DENSE = ("llama", "qwen2", "qwen3")
MOE = tuple(MOE_FAMILIES)  # qwen3_moe, mixtral, qwen2_moe
SUPPORTED = DENSE + MOE
# the Linear layers tensor parallelism shards along K (Megatron / vLLM RowParallelLinear)
ROW_PARALLEL_LINEARS = ("o_proj", "down_proj")
_BLOCK = 16  # block size of the compact KV cache handed to paged_attention while decoding


class UnsupportedModelError(NotImplementedError):
    """A model / config whose numerics the HF adapter cannot route through rl_engine."""


# ------------------------------------------------------------------------------ configuration
def rope_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """``rl_engine.ops.rope`` keyword arguments (theta, rotary_dim, is_neox, scaling) of a Llama /
    Qwen ``config.json`` dict (``rope_parameters``, or ``rope_theta`` + ``rope_scaling``)."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = params if params else dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = cfg.get("partial_rotary_factor", 1.0)
    rotary_dim = None if partial == 1.0 else int(head_dim * partial)
    if rope_type == "default":
        scaling_out = None
    else:
        scaling_out = {k: v for k, v in scaling.items() if k != "type"}
        scaling_out["rope_type"] = rope_type
    return {
        "theta": float(theta),
        "rotary_dim": rotary_dim,
        "is_neox": True,
        "scaling": scaling_out,
    }


def _check_config(config: Any) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED:
        raise UnsupportedModelError(f"patch_model: model_type {mt!r}; supported {SUPPORTED}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"patch_model: hidden_act {config.hidden_act!r}")
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError("patch_model: sliding-window attention")
    if mt == "mixtral" and getattr(config, "sliding_window", None) is not None:
        # transformers' Mixtral applies the window whenever the field is set (no
        # use_sliding_window switch); the patched attention is full causal
        raise UnsupportedModelError(
            f"patch_model: mixtral sliding_window={config.sliding_window} (sliding-window "
            "attention; set it to null for full causal attention)"
        )
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise UnsupportedModelError(
            "patch_model: sliding-window attention (config layer_types has 'sliding_attention')"
        )
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        raise UnsupportedModelError("patch_model: pretraining_tp > 1")


def _moe_spec(config: Any) -> MoESpec | None:
    """The MoE facts of ``config`` as every engine reads them (``rl_engine.adapters._moe``;
    ``None`` for a dense model); refuses what no engine can route invariantly."""
    mt = getattr(config, "model_type", None)
    try:
        spec = moe_spec(config)
    except ValueError as exc:
        raise UnsupportedModelError(f"patch_model: {mt}: {exc}") from None
    if spec is None:
        return None
    dropping = token_dropping_reason(config)
    if dropping is not None:
        raise UnsupportedModelError(f"patch_model: {mt} {dropping}")
    return spec


# ------------------------------------------------------------------------------ patched forwards
class _PatchedForward:
    """A module's patched ``forward``: a callable object holding the module it patches.

    The module is an attribute, never a closure cell, so the forward follows the module through
    ``copy.deepcopy`` (TRL builds its reference policy that way) and pickling: the copy's
    forward computes with the copy's weights. Subclasses implement :meth:`run`; every other
    per-module setting they keep is a plain attribute too.
    """

    _rl_engine_patched = True
    __name__ = "forward"

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        # an instance-level forward that was there before patching (another library's hook)
        self._original = module.__dict__.get("forward")

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The original forward (bound to this forward's module)."""
        if self._original is not None:
            return self._original
        return type(self.module).forward.__get__(self.module, type(self.module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<rl_engine {type(self).__name__} of {type(self.module).__name__}>"


def _install(module: torch.nn.Module, make: Callable[[torch.nn.Module], _PatchedForward]) -> bool:
    current = module.__dict__.get("forward")
    if current is not None and getattr(current, MARK, False):
        return False
    module.forward = make(module)
    return True


class _LinearForward(_PatchedForward):
    """``nn.Linear``: ``det_gemm(x, W.t(), bias)``."""

    def run(self, x: torch.Tensor) -> torch.Tensor:
        mod = self.module
        shape = x.shape
        y = ops.det_gemm(x.reshape(-1, shape[-1]), mod.weight.t(), mod.bias)
        return y.view(*shape[:-1], mod.weight.shape[0])


class _RowParallelLinearForward(_PatchedForward):
    """``o_proj`` / ``down_proj`` (the layers tensor parallelism shards along K) with the
    TP-invariant K reduction when it is on (``RL_ENGINE_TP_GROUPS``): the bits of a Megatron or
    vLLM run at TP 1, 2, 4 or 8 that uses it. Otherwise plain ``det_gemm``, as every Linear."""

    def run(self, x: torch.Tensor) -> torch.Tensor:
        groups = tpm.groups_for(1)
        if groups is None:
            return _LinearForward.run(self, x)
        mod = self.module
        shape = x.shape
        y = tpm.tp_linear(
            x.reshape(-1, shape[-1]), mod.weight, mod.bias, parallel="row", groups=groups
        )
        return y.view(*shape[:-1], mod.weight.shape[0])


class _NormForward(_PatchedForward):
    """``*RMSNorm``: ``rms_norm(x, weight, eps)``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        eps = getattr(module, "variance_epsilon", None)
        if eps is None:
            eps = getattr(module, "eps", None)
        if eps is None or getattr(module, "weight", None) is None:
            raise UnsupportedModelError(
                f"patch_model: {type(module).__name__} without weight / eps"
            )
        self.eps = float(eps)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.module.weight, self.eps)


def _shared_input_linears(
    x: torch.Tensor, mods: tuple[torch.nn.Module, ...]
) -> torch.Tensor | None:
    """q/k/v (gate/up) as one ``det_gemm_cat`` when every layer is a plain patched ``Linear``
    (no hooks, forward not replaced by someone else: LoRA, per-Linear FSDP, quantised layers run
    their own forward) and the biases are all present or all absent; else ``None``.

    Forward and weight / bias gradients are bitwise those of the separate layers (column
    invariance); the input gradient is one GEMM over the concatenated N (what Megatron's fused
    QKV / FC1 computes) instead of a sum of per-layer products."""
    for m in mods:
        if (
            type(m.__dict__.get("forward")) is not _LinearForward
            or m._forward_hooks
            or m._forward_pre_hooks
        ):
            return None
    has_bias = [m.bias is not None for m in mods]
    if any(has_bias) and not all(has_bias):
        return None
    shape = x.shape
    y = ops.det_gemm_cat(
        x.reshape(-1, shape[-1]),
        [m.weight for m in mods],
        [m.bias for m in mods] if has_bias[0] else None,
    )
    return y.view(*shape[:-1], y.shape[-1])


class _MLPForward(_PatchedForward):
    """``*MLP``: ``down(silu_and_mul(gate_up(x)))``: gate and up as one GEMM (gate first, as
    vLLM's gate_up), or ``cat([gate(x), up(x)])`` when they cannot be fused."""

    def __init__(self, module: torch.nn.Module, fuse: bool = True) -> None:
        super().__init__(module)
        self.fuse = fuse

    def run(self, x: torch.Tensor) -> torch.Tensor:
        mod = self.module
        gate_up = _shared_input_linears(x, (mod.gate_proj, mod.up_proj)) if self.fuse else None
        if gate_up is None:
            gate_up = torch.cat([mod.gate_proj(x), mod.up_proj(x)], dim=-1)
        return mod.down_proj(ops.silu_and_mul(gate_up))


def _expert_weights(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2I, H], w2 [E, H, I])`` of a transformers-5 ``*Experts`` module: its own
    ``gate_up_proj`` / ``down_proj`` parameters (gate rows, then up: ``chunk(2)`` gives gate
    first), or transposed views of them where the module stores ``[E, H, 2I]`` (no copy either
    way, so the gradients land in the parameters)."""
    w13 = experts.gate_up_proj
    w2 = experts.down_proj
    if getattr(experts, "is_transposed", False):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    return w13, w2


def _check_experts(experts: torch.nn.Module) -> None:
    """Refuse an experts module whose layout or numerics ``moe_experts`` does not compute."""
    name = type(experts).__name__
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) or not isinstance(
        getattr(experts, "down_proj", None), torch.Tensor
    ):
        raise UnsupportedModelError(
            f"patch_model: {name} without fused gate_up_proj / down_proj parameters (the "
            "per-expert module layout of transformers < 5 is not supported)"
        )
    for attr, want, what in (
        ("is_concatenated", True, "interleaved gate / up rows"),
        ("has_gate", True, "experts without a gate projection"),
        ("has_bias", False, "expert biases"),
        ("_is_expert_parallel", False, "transformers' expert parallelism"),
    ):
        if getattr(experts, attr, want) != want:
            raise UnsupportedModelError(f"patch_model: {name}: {what}")
    act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"patch_model: {name}: hidden_act {act!r}")
    w13, w2 = _expert_weights(experts)
    e, two_i, h = w13.shape
    if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise UnsupportedModelError(
            f"patch_model: {name}: gate_up_proj {tuple(w13.shape)} / down_proj "
            f"{tuple(w2.shape)} are not [E, 2I, H] / [E, H, I]"
        )


def _layer_index(name: str) -> int | None:
    """``i`` of a module named ``...layers.<i>.mlp``."""
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


class _RouterForward(_PatchedForward):
    """``*TopKRouter``: ``moe_router`` (``det_gemm`` logits in the model dtype, then
    ``moe_topk``). Returns HF's ``(logits [T, E], weights [T, k] fp32, ids [T, k] int64)``."""

    def __init__(self, module: torch.nn.Module, spec: MoESpec) -> None:
        super().__init__(module)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise UnsupportedModelError(
                f"patch_model: {type(module).__name__} without [E, H] weight"
            )
        if getattr(module, "bias", None) is not None:
            raise UnsupportedModelError(f"patch_model: {type(module).__name__} with a bias")
        if int(getattr(module, "top_k", spec.top_k)) != spec.top_k or weight.shape[0] != (
            spec.n_experts
        ):
            raise UnsupportedModelError(
                f"patch_model: {type(module).__name__} (top-k {module.top_k}, weight "
                f"{tuple(weight.shape)}) disagrees with the config ({spec.top_k} of "
                f"{spec.n_experts} experts)"
            )
        self.top_k = spec.top_k
        self.scoring = spec.scoring
        self.renormalize = spec.renormalize

    def run(self, hidden_states: torch.Tensor):
        w = self.module.weight
        x = hidden_states.reshape(-1, w.shape[1])
        weights, ids, logits = ops.moe_router(
            x, w, self.top_k, scoring=self.scoring, renormalize=self.renormalize
        )
        return logits, weights, ids


class _ExpertsForward(_PatchedForward):
    """``*Experts`` called directly (the patched sparse block does not call it):
    ``moe_combine(moe_experts(x, ids, w13, w2, groups=groups_for(1)), weights)``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        _check_experts(module)

    def run(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        w13, w2 = _expert_weights(self.module)
        y = ops.moe_experts(hidden_states, top_k_index, w13, w2, groups=tpm.groups_for(1))
        return ops.moe_combine(y, top_k_weights.float())


class _SparseMoeForward(_PatchedForward):
    """``*SparseMoeBlock``: router, ``moe_experts``, shared expert, ``moe_combine``.

    ``gate`` is called as a module (its patched forward is :class:`_RouterForward`), so HF's
    ``router_logits`` recorder (a forward hook on the router) still sees the logits. The shared
    expert (Qwen2-MoE) runs as its patched ``*MLP``, its gate logits through the patched
    ``shared_expert_gate`` Linear; both join inside ``moe_combine``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        _check_experts(module.experts)
        if getattr(module, "jitter_noise", 0.0):
            raise UnsupportedModelError(
                f"patch_model: {type(module).__name__} jitter_noise={module.jitter_noise} "
                "(random routing in training mode)"
            )
        self.shared = getattr(module, "shared_expert", None) is not None
        self.shared_gate = getattr(module, "shared_expert_gate", None) is not None
        if self.shared_gate and not self.shared:
            raise UnsupportedModelError("patch_model: a shared-expert gate without a shared expert")

    def run(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mod = self.module
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, ids = mod.gate(x)
        w13, w2 = _expert_weights(mod.experts)
        # the TP-invariant grouped experts when RL_ENGINE_TP_GROUPS is set (the trainer: TP 1)
        y = ops.moe_experts(x, ids, w13, w2, groups=tpm.groups_for(1))
        shared = mod.shared_expert(x) if self.shared else None
        gate = mod.shared_expert_gate(x) if self.shared_gate else None
        out = ops.moe_combine(y, weights, shared=shared, shared_gate=gate)
        return out.view(shape)


def _cu_from_lens(lens: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    return cu


def _packed_cu_from_positions(pos: torch.Tensor) -> torch.Tensor | None:
    """cu_seqlens of a [1, T] batch whose position ids restart at 0 (packed), else ``None``."""
    p = pos[0]
    starts = (p == 0).nonzero().flatten()
    if starts.numel() <= 1:
        return None
    if int(starts[0]) != 0:
        raise UnsupportedModelError("packed position_ids must start at 0")
    lens = torch.diff(torch.cat([starts, starts.new_tensor([p.numel()])]))
    return _cu_from_lens(lens)


class _AttentionForward(_PatchedForward):
    """``*Attention``: projections, q/k norm, ``rope``, varlen / paged attention, ``o_proj``."""

    def __init__(self, module: torch.nn.Module, rope_kw: dict[str, Any], fuse: bool = True) -> None:
        super().__init__(module)
        self.fuse = fuse
        if getattr(module, "sliding_window", None):
            raise UnsupportedModelError("patch_model: sliding-window attention layer")
        cfg = module.config
        self.rope_kw = dict(rope_kw)
        self.head_dim = module.head_dim
        self.hq = cfg.num_attention_heads
        self.hkv = cfg.num_key_value_heads
        self.scale = module.scaling

    def run(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ):
        mod, d, hq, hkv, scale = self.module, self.head_dim, self.hq, self.hkv, self.scale
        rope_kw = self.rope_kw
        b, s, _ = hidden_states.shape
        qkv = None
        if self.fuse:
            qkv = _shared_input_linears(hidden_states, (mod.q_proj, mod.k_proj, mod.v_proj))
        if qkv is not None:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            # v is copied out: the attention saves v for its backward, and a view would keep
            # the whole fused [tokens, (hq + 2 hkv) d] output alive until then (4x v's bytes at
            # 16 / 8 heads); q and k are new tensors after rope anyway
            q, k, v = q.view(b, s, hq, d), k.view(b, s, hkv, d), v.contiguous().view(b, s, hkv, d)
        else:
            q = mod.q_proj(hidden_states).view(b, s, hq, d)
            k = mod.k_proj(hidden_states).view(b, s, hkv, d)
            v = mod.v_proj(hidden_states).view(b, s, hkv, d)
        if getattr(mod, "q_norm", None) is not None:
            q = mod.q_norm(q)
            k = mod.k_norm(k)
        past = 0
        if past_key_values is not None:
            past = past_key_values.get_seq_length(mod.layer_idx)
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = (torch.arange(s, device=q.device) + past).unsqueeze(0)
        pos = position_ids.expand(b, s).reshape(-1)
        q, k = ops.rope_qk(q.reshape(b * s, hq, d), k.reshape(b * s, hkv, d), pos, **rope_kw)
        v = v.reshape(b * s, hkv, d)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise UnsupportedModelError(
                "rl_engine attention expects the 2-D padding mask of the 'rl_engine' attention "
                f"implementation, got a {attention_mask.dim()}-D mask (was the config changed?)"
            )
        if past_key_values is not None:
            k4, v4 = past_key_values.update(
                k.view(b, s, hkv, d).transpose(1, 2),
                v.view(b, s, hkv, d).transpose(1, 2),
                mod.layer_idx,
            )
            total = k4.shape[2]
        else:
            total = s
        if total == s:
            out, sel = _prefill(q, k, v, b, s, attention_mask, position_ids, kwargs, scale)
            if sel is not None:
                return _project_real_rows(mod.o_proj, out, sel, b, s), None
        else:
            out = _decode(q, k4, v4, b, s, attention_mask, scale)
        out = out.reshape(b, s, hq * d)
        return mod.o_proj(out), None


def _project_real_rows(o_proj, o, sel, b, s):
    """``o_proj`` of the attention output ``o`` of the real tokens (rows ``sel`` of the padded
    ``[b, s]`` batch), scattered into ``[b, s, hidden]`` with zero rows for the padding.

    The projection's input is then the attention's own output, which autograd keeps once for
    both; projecting the padded ``[b * s]`` scatter of it kept a second copy, one ``[b * s,
    heads x head dim]`` tensor a layer. The same bits: ``det_gemm`` is row invariant, and a zero
    row projects to zeros without a bias (with one, the padded rows get the bias, as before)."""
    if getattr(o_proj, "bias", None) is not None:
        full = o.new_zeros(b * s, *o.shape[1:]).index_copy(0, sel, o)
        return o_proj(full.view(b, s, -1))
    y = o_proj(o.reshape(o.shape[0], -1))
    return y.new_zeros(b * s, y.shape[-1]).index_copy(0, sel, y).view(b, s, -1)


def _prefill(q, k, v, b, s, mask, position_ids, kwargs, scale):
    """Varlen causal attention over the (unpadded) sequences of a [b, s] batch: ``(out,
    None)`` with ``out`` [b * s, hq, d], or for a padding mask ``(o, sel)``, the attention of the
    real tokens (rows ``sel`` of the batch) only (:func:`_project_real_rows`)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if b != 1:
            raise UnsupportedModelError("cu_seq_lens_q needs a [1, T] packed batch")
        cuk = kwargs.get("cu_seq_lens_k")
        if cuk is not None and not torch.equal(cuk, cu):
            raise UnsupportedModelError("cu_seq_lens_k different from cu_seq_lens_q")
        return ops.attention(q, k, v, cu.to(torch.int32), scale=scale, causal=True), None
    if mask is None:
        packed = _packed_cu_from_positions(position_ids) if b == 1 else None
        if packed is not None:
            return ops.attention(q, k, v, packed, scale=scale, causal=True), None
        cu = torch.arange(b + 1, device=q.device, dtype=torch.int32) * s
        return ops.attention(q, k, v, cu, scale=scale, causal=True), None
    keep = mask.to(torch.bool)[:, -s:].reshape(-1)
    cu = _cu_from_lens(mask.to(torch.bool)[:, -s:].sum(1))
    sel = keep.nonzero().flatten()
    return ops.attention(q[sel], k[sel], v[sel], cu, scale=scale, causal=True), sel


def _decode(q, k4, v4, b, s, mask, scale):
    """Attention of the last ``s`` tokens of each row against the cache, via paged_attention.

    The cache [b, Hkv, total, D] is compacted per row (padding keys dropped) into blocks of
    ``_BLOCK`` tokens; the query tokens are each row's last ``s`` positions.
    """
    total = k4.shape[2]
    if mask is None:
        valid = torch.ones(b, total, dtype=torch.bool, device=q.device)
    else:
        valid = mask.to(torch.bool)[:, -total:]
    lens = valid.sum(1)
    nblk = max(1, -(-int(lens.max()) // _BLOCK))
    hkv, d = k4.shape[1], k4.shape[3]
    kc = k4.new_zeros(b, nblk * _BLOCK, hkv, d)
    vc = v4.new_zeros(b, nblk * _BLOCK, hkv, d)
    for i in range(b):
        idx = valid[i].nonzero().flatten()
        kc[i, : idx.numel()] = k4[i, :, idx].transpose(0, 1)
        vc[i, : idx.numel()] = v4[i, :, idx].transpose(0, 1)
    kc = kc.view(b * nblk, _BLOCK, hkv, d)
    vc = vc.view(b * nblk, _BLOCK, hkv, d)
    table = torch.arange(b * nblk, device=q.device, dtype=torch.int32).view(b, nblk)
    qsl = torch.arange(b + 1, device=q.device, dtype=torch.int32) * s
    return ops.paged_attention(q, kc, vc, table, lens.to(torch.int32), qsl, scale=scale)


def _register_attention_implementation() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    def _direct_call(*args: Any, **kwargs: Any):
        raise UnsupportedModelError(
            "the 'rl_engine' attention implementation runs inside patched attention modules "
            "only (call rl_engine.adapters.hf.patch_model on the model)"
        )

    AttentionInterface.register(ATTN_NAME, _direct_call)
    AttentionMaskInterface.register(ATTN_NAME, flash_attention_mask)


# ------------------------------------------------------------------------------ public API
def patch_model(
    model: torch.nn.Module, *, strict: bool = True, fuse_projections: bool = True
) -> dict[str, list[str]]:
    """Route a transformers Llama / Qwen2 / Qwen3 (dense) or Qwen3-MoE / Mixtral / Qwen2-MoE
    (mixture of experts) model's forward through rl_engine ops, in place.

    Idempotent: a second call patches nothing. The original ``forward`` of every patched module
    is kept in ``module.forward.__wrapped__``; :func:`unpatch_model` restores them.

    Args:
        model: ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` /
            ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` (or the
            bare decoder model). Dense layers of an MoE model (``mlp_only_layers``,
            ``decoder_sparse_step``) are ``*MLP`` modules, patched as in a dense model.
        strict: refuse a model with a numerically relevant module the adapter does not route
            (any other module type with parameters).
        fuse_projections: q/k/v and gate/up as one GEMM each (``det_gemm_cat``, Megatron's
            fused QKV / FC1): the same log-probs and weight gradients bitwise, fewer launches;
            the hidden-state gradient is then one reduction over the fused N. ``False``: each
            ``Linear`` runs on its own. Layers with hooks or a replaced forward (LoRA,
            per-Linear FSDP) are never fused.

    Returns:
        ``{"patched": [...], "already": [...], "left_alone": [...]}`` module names.

    Raises:
        UnsupportedModelError: unsupported architecture / config, parameters in a dtype the ops
            do not take (float64), or (strict) unroutable modules.
    """
    config = model.config
    _check_config(config)
    _check_dtypes(model)
    rope_kw = rope_kwargs(config.to_dict())
    spec = _moe_spec(config)
    _register_attention_implementation()
    report: dict[str, list[str]] = {"patched": [], "already": [], "left_alone": []}
    unroutable: list[str] = []
    handled_children: set[int] = set()
    sparse: list[int | None] = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        make: Callable[[torch.nn.Module], _PatchedForward] | None = None
        if cls.endswith("SparseMoeBlock") and hasattr(mod, "experts") and hasattr(mod, "gate"):
            make = _SparseMoeForward
            sparse.append(_layer_index(name))
        elif cls.endswith("TopKRouter") and spec is not None:
            make = functools.partial(_RouterForward, spec=spec)
        elif cls.endswith("Experts") and hasattr(mod, "gate_up_proj"):
            make = _ExpertsForward
        elif cls.endswith("Attention") and hasattr(mod, "q_proj"):
            make = functools.partial(_AttentionForward, rope_kw=rope_kw, fuse=fuse_projections)
        elif cls.endswith("MLP") and hasattr(mod, "gate_proj"):
            make = functools.partial(_MLPForward, fuse=fuse_projections)
        elif cls.endswith("RMSNorm"):
            make = _NormForward
        elif isinstance(mod, torch.nn.Linear):
            row_parallel = name.rsplit(".", 1)[-1] in ROW_PARALLEL_LINEARS
            make = _RowParallelLinearForward if row_parallel else _LinearForward
        if make is None:
            own = [p for p in mod.parameters(recurse=False)]
            if isinstance(mod, torch.nn.Embedding) or cls.endswith("RotaryEmbedding"):
                report["left_alone"].append(name)
            elif own and id(mod) not in handled_children:
                unroutable.append(f"{name} ({cls})")
            continue
        if _install(mod, make):
            report["patched"].append(name)
        else:
            report["already"].append(name)
    if unroutable and strict:
        raise UnsupportedModelError(f"patch_model: cannot route {', '.join(unroutable)}")
    want = list(spec.sparse_layers) if spec is not None else []
    if sparse != want:
        raise UnsupportedModelError(
            f"patch_model: MoE blocks in layers {sparse}, the config says {want} "
            "(mlp_only_layers / decoder_sparse_step)"
        )
    if getattr(config, "_attn_implementation", None) != ATTN_NAME:
        model._rl_engine_attn_implementation = config._attn_implementation
        config._attn_implementation = ATTN_NAME
    model._rl_engine_patched = True
    return report


# The floating dtypes rl_engine's ops take (every provider; float64 has no kernel family).
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtypes(model: torch.nn.Module) -> None:
    """Refuse at patch time a model whose floating parameters the ops cannot take (a float64
    model would pass the patch and fail at its first forward)."""
    bad = sorted(
        {str(p.dtype) for p in model.parameters() if p.is_floating_point()}
        - {str(d) for d in _PARAM_DTYPES}
    )
    if bad:
        raise UnsupportedModelError(
            f"patch_model: parameters in {', '.join(bad)}; rl_engine's ops take "
            f"{', '.join(str(d) for d in _PARAM_DTYPES)} (cast the model first, e.g. "
            "model.to(torch.float32))"
        )


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch_model` has been applied to ``model``."""
    return bool(getattr(model, MARK, False))


def unpatch_model(model: torch.nn.Module) -> None:
    """Undo :func:`patch_model` (restore every module's original ``forward``)."""
    for mod in model.modules():
        fwd = mod.__dict__.get("forward")
        if fwd is not None and getattr(fwd, MARK, False):
            if fwd._original is not None:
                mod.forward = fwd._original
            else:
                del mod.__dict__["forward"]
    if hasattr(model, "_rl_engine_attn_implementation"):
        model.config._attn_implementation = model._rl_engine_attn_implementation
        del model._rl_engine_attn_implementation
    if getattr(model, MARK, False):
        model._rl_engine_patched = False
