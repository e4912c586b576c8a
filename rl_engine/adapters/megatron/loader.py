"""Build a megatron-core ``GPTModel`` with the rl_engine spec from a Hugging Face checkpoint."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from rl_engine.adapters.megatron.modules import (
    RLColumnParallelLinear,
    RopeSettings,
    UnsupportedModelError,
    UnsupportedNumericsError,
)
from rl_engine.adapters.megatron.replace import _swap_class
from rl_engine.adapters.megatron.spec import get_gpt_block_rl_spec

__all__ = [
    "from_pretrained",
    "hf_config_to_megatron",
    "ep_shard_state",
    "etp_shard_state",
    "hf_to_megatron_state",
    "megatron_to_hf_state",
    "moe_layers",
    "rope_from_hf_config",
    "shard_state",
    "stock_from_pretrained",
    "stock_unsupported_reason",
]

MOE = ("qwen3_moe", "mixtral", "qwen2_moe")
SUPPORTED = ("llama", "qwen2", "qwen3", *MOE)


def moe_layers(cfg: dict[str, Any]) -> list[bool]:
    """Per decoder layer: whether it is a mixture-of-experts layer (``adapters._moe.moe_spec``:
    every Mixtral layer; Qwen2/3-MoE layer ``i`` unless in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0``)."""
    spec = _moe_spec(cfg)
    sparse = set(spec.sparse_layers) if spec else set()
    return [i in sparse for i in range(cfg["num_hidden_layers"])]


def _moe_spec(cfg: dict[str, Any]) -> Any:
    from rl_engine.adapters._moe import moe_spec

    try:
        return moe_spec(cfg)
    except (ValueError, TypeError, KeyError) as exc:
        raise UnsupportedNumericsError(f"from_pretrained: {exc}") from None


def _num_experts(cfg: dict[str, Any]) -> int:
    spec = _moe_spec(cfg)
    if spec is None:
        raise UnsupportedNumericsError(f"from_pretrained: {cfg.get('model_type')!r} is not MoE")
    return spec.n_experts


def moe_routing(cfg: dict[str, Any]) -> dict[str, Any]:
    """``moe_topk`` scoring of an MoE family (what vLLM and the HF adapter run; one reading for
    every engine, ``adapters._moe``): Qwen3-MoE / Qwen2-MoE: softmax over all experts, top-k,
    renormalised when ``norm_topk_prob``; Mixtral: top-k of the logits, softmax over the k."""
    return _moe_spec(cfg).topk_kwargs


def _stock_pre_softmax(spec: Any) -> bool:
    """Whether megatron's ``TopKRouter`` computes the family's routing with
    ``moe_router_pre_softmax`` (softmax over all experts, top-k, not renormalised) rather than
    its default (top-k of the logits, softmax over the k: Mixtral, renormalised Qwen)."""
    return spec.scoring == "softmax" and not spec.renormalize


def _read_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _config_dtype(cfg: dict[str, Any], dtype: torch.dtype | str | None) -> torch.dtype:
    """``dtype`` as a torch dtype; ``None``: the checkpoint's (``dtype`` / ``torch_dtype`` of its
    config, float32 when it names none)."""
    if dtype is None:
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def rope_from_hf_config(cfg: dict[str, Any]) -> RopeSettings:
    """RoPE settings of a Llama / Qwen ``config.json`` dict (the HF adapter's parsing)."""
    from rl_engine.adapters.hf.patch import rope_kwargs

    return RopeSettings(**rope_kwargs(cfg))


def hf_config_to_megatron(cfg: dict[str, Any], dtype: torch.dtype, **overrides: Any) -> Any:
    """A ``TransformerConfig`` equivalent to a Llama / Qwen2 / Qwen3 ``config.json``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = cfg.get("model_type")
    if arch not in SUPPORTED:
        raise UnsupportedModelError(f"from_pretrained: model_type {arch!r}; supported {SUPPORTED}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedNumericsError(f"from_pretrained: hidden_act {cfg['hidden_act']!r}")
    if cfg.get("use_sliding_window", False) or (
        arch == "mixtral" and cfg.get("sliding_window") is not None
    ):
        raise UnsupportedNumericsError("from_pretrained: sliding-window attention")
    if cfg.get("mlp_bias", False):
        raise UnsupportedNumericsError("from_pretrained: MLP bias")
    if arch == "llama" and cfg.get("attention_bias", False):
        # o_proj would carry a bias too; Megatron adds it in the bias-dropout-add
        raise UnsupportedNumericsError("from_pretrained: Llama attention_bias")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kw: dict[str, Any] = dict(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        kv_channels=head_dim,
        ffn_hidden_size=cfg["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
        qk_layernorm=arch in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if arch in MOE:
        spec = _moe_spec(cfg)
        shared = spec.shared_intermediate
        kw.update(
            num_moe_experts=spec.n_experts,
            moe_router_topk=spec.top_k,
            moe_ffn_hidden_size=spec.intermediate,
            moe_shared_expert_intermediate_size=shared or None,
            moe_shared_expert_gate=bool(shared),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # the stock router's nearest equivalent (rl_engine's layer takes moe_routing);
            # megatron-core requires pre-softmax at top-1 (stock_from_pretrained refuses a
            # top-1 rule it would change), RLMoELayer does not read it
            moe_router_pre_softmax=_stock_pre_softmax(spec) or spec.top_k == 1,
        )
    kw.update(overrides)
    return TransformerConfig(**kw)


def _tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    from rl_engine.adapters._checkpoint import safetensor_files

    for file in safetensor_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def hf_to_megatron_state(
    hf: dict[str, torch.Tensor], cfg: dict[str, Any], tied: bool
) -> dict[str, torch.Tensor]:
    """Map a Hugging Face Llama / Qwen / MoE state dict to a TP = 1, EP = 1 ``GPTModel`` state
    dict.

    QKV: Megatron stores, per query group g, the rows ``[q heads of g; k_g; v_g]`` (so that a
    TP shard holds whole groups); the same interleave applies to the QKV bias. FC1 is
    ``[gate; up]``. MoE layers: ``RLMoELayer``'s stacked experts (:func:`_hf_moe_layer`).
    """
    nq = cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads") or nq
    d = cfg.get("head_dim") or cfg["hidden_size"] // nq
    per = nq // ng
    out: dict[str, torch.Tensor] = {}
    pre = "model."

    def qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rest = q.shape[1:]
        q = q.reshape(ng, per * d, *rest)
        k = k.reshape(ng, d, *rest)
        v = v.reshape(ng, d, *rest)
        return torch.cat([q, k, v], dim=1).reshape(ng * (per + 2) * d, *rest).contiguous()

    sparse = moe_layers(cfg)
    hf = _ReadTracker(hf)
    out["embedding.word_embeddings.weight"] = hf[pre + "embed_tokens.weight"]
    out["decoder.final_layernorm.weight"] = hf[pre + "norm.weight"]
    if not tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        h = f"{pre}layers.{i}."
        m = f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]
        )
        if a + "q_proj.bias" in hf:
            out[m + "self_attention.linear_qkv.bias"] = qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"]
            )
        if a + "q_norm.weight" in hf:
            out[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        if sparse[i]:
            out.update(_hf_moe_layer(hf, cfg, h, m + "mlp."))
            continue
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    _refuse_unread(hf, cfg, tied)
    return out


class _ReadTracker(dict):
    """A state dict that records which keys were read (``[]``)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(state)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return super().__getitem__(key)


def _refuse_unread(hf: _ReadTracker, cfg: dict[str, Any], tied: bool) -> None:
    """Refuse checkpoint tensors the mapping did not read: the GPT model would run without them
    (e.g. Qwen3's ``o_proj`` bias under ``attention_bias=True``, which megatron's attention
    output projection, built without linear biases, has no place for). Not refused: RoPE
    ``inv_freq`` buffers (rl_engine's rope builds its own tables), a tied model's saved
    ``lm_head.weight`` and empty tensors (a zero-width shared expert)."""
    left = sorted(
        k
        for k, v in dict.items(hf)
        if k not in hf.read
        and not k.endswith("rotary_emb.inv_freq")
        and not (tied and k == "lm_head.weight")
        and v.numel() > 0
    )
    if left:
        hint = ""
        if any(k.endswith("o_proj.bias") for k in left):
            hint = (
                f" ({cfg.get('model_type')} attention_bias="
                f"{cfg.get('attention_bias')}: a bias on the attention output projection)"
            )
        raise UnsupportedNumericsError(
            f"from_pretrained: {len(left)} checkpoint tensor(s) the Megatron model has no place "
            f"for{hint}; running without them computes another model: {left[:6]}"
            + (" ..." if len(left) > 6 else "")
        )


# per-expert Hugging Face names (the layout checkpoints are saved in): (gate, up, down)
_EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
}


def _hf_moe_layer(
    hf: dict[str, torch.Tensor], cfg: dict[str, Any], h: str, m: str
) -> dict[str, torch.Tensor]:
    """One MoE layer's Megatron tensors (``RLMoELayer`` names, all experts: EP = 1) from a Hugging
    Face layer prefix ``h``: the per-expert layout (``experts.{e}.gate_proj`` / ``w1`` ...,
    under ``mlp.`` or Mixtral's ``block_sparse_moe.``) or transformers 5's fused one
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    arch = cfg["model_type"]
    n = _num_experts(cfg)
    moe = h + ("block_sparse_moe." if h + "block_sparse_moe.gate.weight" in hf else "mlp.")
    out = {m + "router.weight": hf[moe + "gate.weight"]}
    if moe + "experts.gate_up_proj" in hf:
        w13, w2 = hf[moe + "experts.gate_up_proj"], hf[moe + "experts.down_proj"]
    else:
        g, u, d = _EXPERT_NAMES[arch]
        ex = moe + "experts."
        w13 = torch.stack(
            [torch.cat([hf[f"{ex}{e}.{g}.weight"], hf[f"{ex}{e}.{u}.weight"]]) for e in range(n)]
        )
        w2 = torch.stack([hf[f"{ex}{e}.{d}.weight"] for e in range(n)])
    if w13.shape[0] != n or w2.shape[0] != n:
        raise RuntimeError(f"from_pretrained: {moe}experts: {w13.shape[0]} experts, not {n}")
    out[m + "experts.linear_fc1.weight"] = w13.contiguous()
    out[m + "experts.linear_fc2.weight"] = w2.contiguous()
    if moe + "shared_expert.gate_proj.weight" in hf:
        se = moe + "shared_expert."
        out[m + "shared_experts.linear_fc1.weight"] = torch.cat(
            [hf[se + "gate_proj.weight"], hf[se + "up_proj.weight"]], dim=0
        )
        out[m + "shared_experts.linear_fc2.weight"] = hf[se + "down_proj.weight"]
        if moe + "shared_expert_gate.weight" in hf:
            out[m + "shared_experts.gate_weight"] = hf[moe + "shared_expert_gate.weight"]
    return out


def ep_shard_state(state: dict[str, torch.Tensor], ep: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of an EP = 1 state dict at expert-parallel degree ``ep``: the stacked
    expert weights (``experts.linear_fc1`` / ``linear_fc2``, [E, ...]) cut into ``ep``
    contiguous blocks of whole experts; everything else replicated. Exact slices.

    Raises ``UnsupportedNumericsError`` when ``ep`` does not divide the number of experts."""
    out = {}
    for name, t in state.items():
        if name.endswith(("experts.linear_fc1.weight", "experts.linear_fc2.weight")) and (
            ".shared_experts." not in name
        ):
            if t.shape[0] % ep:
                raise UnsupportedNumericsError(
                    f"from_pretrained: {t.shape[0]} experts do not divide over "
                    f"expert_model_parallel_size={ep} ({name})"
                )
            n = t.shape[0] // ep
            out[name] = t[rank * n : (rank + 1) * n].contiguous()
        else:
            out[name] = t
    return out


def _routed_expert(name: str) -> bool:
    """Whether ``name`` is a stacked routed-expert weight (``experts.linear_fc1`` / ``fc2``)."""
    return name.endswith(("experts.linear_fc1.weight", "experts.linear_fc2.weight")) and (
        ".shared_experts." not in name
    )


def etp_shard_state(state: dict[str, torch.Tensor], etp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of the routed experts at expert-TP degree ``etp`` (megatron's
    layout of expert weights: every expert's ``linear_fc1`` column-parallel, rows
    ``[gate_r; up_r]``; ``linear_fc2`` row-parallel, columns ``r`` of ``I``); everything else
    as it is. Exact slices. Raises ``UnsupportedNumericsError`` when ``etp`` does not divide
    the experts' intermediate size."""
    out = {}
    for name, t in state.items():
        if not _routed_expert(name):
            out[name] = t
            continue
        inter = t.shape[1] // 2 if name.endswith("linear_fc1.weight") else t.shape[2]
        if inter % etp:
            raise UnsupportedNumericsError(
                f"from_pretrained: the experts' intermediate size {inter} does not divide over "
                f"expert_tensor_parallel_size={etp} ({name})"
            )
        n = inter // etp
        if name.endswith("linear_fc1.weight"):
            gate, up = t[:, :inter], t[:, inter:]
            out[name] = torch.cat(
                [gate[:, rank * n : (rank + 1) * n], up[:, rank * n : (rank + 1) * n]], dim=1
            ).contiguous()
        else:
            out[name] = t[:, :, rank * n : (rank + 1) * n].contiguous()
    return out


def check_tp_shapes(cfg: dict[str, Any], tp: int, etp: int | None = None) -> None:
    """Refuse, at model build, a TP degree or sizes the TP-invariant reductions cannot split:
    the row-parallel K (attention output ``heads x head_dim``, FFN) and the column-parallel N
    of the input gradient (QKV rows, ``[gate; up]``, vocabulary). Nothing to check when the
    configuration leaves the plain reduction on (TP = 1, ``RL_ENGINE_TP_GROUPS`` unset)."""
    from rl_engine.ops.det_gemm import tp as tpm

    groups = tpm.groups_for(tp)
    if groups is None:
        return
    nq = cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads") or nq
    d = cfg.get("head_dim") or cfg["hidden_size"] // nq
    ffn = cfg["intermediate_size"]
    sizes = {
        "attention output (heads x head_dim)": (nq * d, False),
        "FFN (down projection)": (ffn, False),
        "QKV rows": ((nq + 2 * ng) * d, False),
        "FFN [gate; up] rows": (2 * ffn, True),
        "vocabulary": (cfg["vocab_size"], False),
    }
    degrees = dict.fromkeys(sizes, tp)
    spec = _moe_spec(cfg) if cfg.get("model_type") in MOE else None
    if spec is not None:  # routed experts over the expert-TP group, shared ones over TP
        etp = tp if etp is None else etp
        sizes["experts (down projection)"] = (spec.intermediate, False)
        sizes["experts [gate; up] rows"] = (2 * spec.intermediate, True)
        degrees["experts (down projection)"] = degrees["experts [gate; up] rows"] = etp
        if spec.shared_intermediate:
            sizes["shared expert (down projection)"] = (spec.shared_intermediate, False)
            sizes["shared expert [gate; up] rows"] = (2 * spec.shared_intermediate, True)
            degrees["shared expert (down projection)"] = tp
            degrees["shared expert [gate; up] rows"] = tp
    for what, (size, glu) in sizes.items():
        try:
            tpm.check_split(size, degrees[what], what=f"from_pretrained: {what}", groups=groups,
                            glu=glu)  # fmt: skip
        except ValueError as exc:
            raise UnsupportedNumericsError(str(exc)) from None


def shard_state(
    state: dict[str, torch.Tensor], cfg: dict[str, Any], tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of a TP = 1 ``GPTModel`` state dict (Megatron's TP layout).

    Vocabulary rows (embedding, output layer) and QKV rows (whole query groups: the TP = 1 layout
    is per group) are cut into ``tp`` contiguous blocks; FC1 holds ``[gate_r; up_r]``; the
    row-parallel weights (``linear_proj``, ``linear_fc2``) are cut along K; norms are replicated.
    Exact slices. Raises ``UnsupportedNumericsError`` for sizes ``tp`` does not divide.
    """
    ng = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    sizes = {
        "vocabulary": cfg["vocab_size"],
        "query groups": ng,
        "intermediate_size": cfg["intermediate_size"],
    }
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise UnsupportedNumericsError(
            f"from_pretrained: tensor-parallel degree {tp} does not divide {bad}"
        )

    def rows(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // tp
        return t[rank * n : (rank + 1) * n]

    def cols(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[1] // tp
        return t[:, rank * n : (rank + 1) * n]

    out = {}
    for name, t in state.items():
        if _routed_expert(name):  # the expert-TP group's (etp_shard_state)
            out[name] = t
        elif name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
            out[name] = rows(t)
        elif name.endswith("linear_qkv.bias"):
            out[name] = rows(t)
        elif name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([rows(gate), rows(up)], dim=0)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[name] = cols(t)
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf_state(
    state: dict[str, torch.Tensor], cfg: dict[str, Any], tied: bool
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_megatron_state`: a TP = 1 ``GPTModel`` state dict back to
    Hugging Face names (QKV de-interleaved per query group, FC1 split into gate / up). Exact
    copies (views / slices), so weights pushed to a rollout engine keep their bits.

    Raises ``KeyError`` naming the first Megatron tensor the state lacks.
    """
    nq = cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads") or nq
    d = cfg.get("head_dim") or cfg["hidden_size"] // nq
    per = nq // ng
    ffn = cfg["intermediate_size"]
    pre = "model."
    sparse = moe_layers(cfg)

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"megatron_to_hf_state: the state has no {name!r}")
        return state[name]

    def split_qkv(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rest = t.shape[1:]
        g = t.reshape(ng, (per + 2) * d, *rest)
        q = g[:, : per * d].reshape(nq * d, *rest)
        k = g[:, per * d : (per + 1) * d].reshape(ng * d, *rest)
        v = g[:, (per + 1) * d :].reshape(ng * d, *rest)
        return q.contiguous(), k.contiguous(), v.contiguous()

    out: dict[str, torch.Tensor] = {
        pre + "embed_tokens.weight": get("embedding.word_embeddings.weight"),
        pre + "norm.weight": get("decoder.final_layernorm.weight"),
    }
    if not tied:
        out["lm_head.weight"] = get("output_layer.weight")
    for i in range(cfg["num_hidden_layers"]):
        h = f"{pre}layers.{i}."
        m = f"decoder.layers.{i}."
        a = h + "self_attn."
        out[h + "input_layernorm.weight"] = get(m + "input_layernorm.weight")
        q, k, v = split_qkv(get(m + "self_attention.linear_qkv.weight"))
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if m + "self_attention.linear_qkv.bias" in state:
            q, k, v = split_qkv(state[m + "self_attention.linear_qkv.bias"])
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        if m + "self_attention.q_layernorm.weight" in state:
            out[a + "q_norm.weight"] = state[m + "self_attention.q_layernorm.weight"]
            out[a + "k_norm.weight"] = get(m + "self_attention.k_layernorm.weight")
        out[a + "o_proj.weight"] = get(m + "self_attention.linear_proj.weight")
        out[h + "post_attention_layernorm.weight"] = get(m + "pre_mlp_layernorm.weight")
        if sparse[i]:
            out.update(_megatron_moe_to_hf(get, cfg, h, m + "mlp."))
            continue
        fc1 = get(m + "mlp.linear_fc1.weight")
        out[h + "mlp.gate_proj.weight"] = fc1[:ffn].contiguous()
        out[h + "mlp.up_proj.weight"] = fc1[ffn:].contiguous()
        out[h + "mlp.down_proj.weight"] = get(m + "mlp.linear_fc2.weight")
    return out


def _megatron_moe_to_hf(get, cfg: dict[str, Any], h: str, m: str) -> dict[str, torch.Tensor]:
    """One MoE layer back to the per-expert Hugging Face names (what checkpoints and vLLM use)."""
    arch = cfg["model_type"]
    moe = h + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
    g, u, d = _EXPERT_NAMES[arch]
    w13, w2 = get(m + "experts.linear_fc1.weight"), get(m + "experts.linear_fc2.weight")
    i = w13.shape[1] // 2
    out = {moe + "gate.weight": get(m + "router.weight")}
    for e in range(w13.shape[0]):
        out[f"{moe}experts.{e}.{g}.weight"] = w13[e, :i].contiguous()
        out[f"{moe}experts.{e}.{u}.weight"] = w13[e, i:].contiguous()
        out[f"{moe}experts.{e}.{d}.weight"] = w2[e].contiguous()
    if arch == "qwen2_moe" and cfg.get("shared_expert_intermediate_size"):
        fc1 = get(m + "shared_experts.linear_fc1.weight")
        s = fc1.shape[0] // 2
        se = moe + "shared_expert."
        out[se + "gate_proj.weight"] = fc1[:s].contiguous()
        out[se + "up_proj.weight"] = fc1[s:].contiguous()
        out[se + "down_proj.weight"] = get(m + "shared_experts.linear_fc2.weight")
        out[moe + "shared_expert_gate.weight"] = get(m + "shared_experts.gate_weight")
    return out


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    **config_overrides: Any,
) -> Any:
    """A ``GPTModel`` with the rl_engine spec and the weights of a Hugging Face checkpoint.

    Supports Llama, Qwen2 (QKV bias) and Qwen3 (per-head q/k RMSNorm), tied or untied
    embeddings, PP = 1, any TP degree Megatron accepts for the shapes (each rank loads its
    shard, :func:`shard_state`; the TP-invariant reductions need a degree in 1, 2, 4, 8).
    Mixture of experts: Qwen3-MoE, Mixtral and Qwen2-MoE (sigmoid-gated shared expert) with
    :class:`~rl_engine.adapters.megatron.moe.RLMoELayer` (any TP degree above, sequence
    parallelism refused; expert parallelism from Megatron's ``expert_model_parallel_size``,
    each rank loading its experts, :func:`ep_shard_state`; expert tensor parallelism from its
    ``expert_tensor_parallel_size`` (ETP = TP, megatron's default, or any divisor of TP), each
    rank loading its ``I / ETP`` shard of them, :func:`etp_shard_state`). Megatron's model-parallel state must be initialised
    (``parallel_state.initialize_model_parallel``).

    Args:
        path: folder with ``config.json`` and ``model.safetensors`` (or an index + shards).
        dtype: parameter dtype (default: the checkpoint's ``dtype`` / ``torch_dtype``).
        device: where to put the model (default: CUDA when available, else CPU).
        **config_overrides: extra ``TransformerConfig`` fields.

    Returns:
        ``GPTModel`` in eval mode, built with ``position_embedding_type="none"`` (RoPE is applied
        by the rl_engine core attention; ``model.rl_engine_rope`` holds its settings) and the
        checkpoint's unpadded vocabulary (``model.rl_engine_vocab_size``).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "from_pretrained: initialise Megatron's model-parallel state first "
            "(torch.distributed.init_process_group + parallel_state.initialize_model_parallel)"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    path = os.fspath(path)
    cfg = _read_config(path)
    dtype = _config_dtype(cfg, dtype)
    tied = bool(cfg.get("tie_word_embeddings", False))
    if cfg.get("model_type") not in SUPPORTED:
        raise UnsupportedModelError(
            f"from_pretrained: model_type {cfg.get('model_type')!r}; supported {SUPPORTED}"
        )
    sparse = moe_layers(cfg)
    if ep > 1 and not any(sparse):
        raise UnsupportedNumericsError(
            f"from_pretrained: expert_model_parallel_size={ep} for a model without MoE layers"
        )
    if any(sparse) and _num_experts(cfg) % ep:
        raise UnsupportedNumericsError(
            f"from_pretrained: {_num_experts(cfg)} experts do not divide over "
            f"expert_model_parallel_size={ep} (each rank holds E / EP whole experts)"
        )
    if etp not in (1, tp) and not any(sparse):  # megatron-core's default ETP is the TP degree
        raise UnsupportedNumericsError(
            f"from_pretrained: expert_tensor_parallel_size={etp} (TP {tp}) for a model without "
            "MoE layers"
        )
    check_tp_shapes(cfg, tp, etp)
    config_overrides.setdefault("tensor_model_parallel_size", tp)
    if any(sparse):
        config_overrides.setdefault("expert_model_parallel_size", ep)
        config_overrides.setdefault("expert_tensor_parallel_size", etp)
    tcfg = hf_config_to_megatron(cfg, dtype, **config_overrides)
    rope = rope_from_hf_config(cfg)
    spec = get_gpt_block_rl_spec(
        tcfg.num_layers,
        qk_layernorm=tcfg.qk_layernorm,
        rope=rope,
        moe=moe_routing(cfg) if any(sparse) else None,
        moe_layers=sparse,
    )
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg["vocab_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        share_embeddings_and_output_weights=tied,
        position_embedding_type="none",
    )
    # GPTModel builds its LM head itself, outside the layer spec: without this its forward
    # logits came from the stock GEMM (host BLAS bits), not det_gemm (token_logprobs' bits)
    if type(model.output_layer) is ColumnParallelLinear:
        _swap_class(model.output_layer, RLColumnParallelLinear)
    hf = dict(_tensors(path))
    state = hf_to_megatron_state(hf, cfg, tied)
    if tp > 1:
        state = shard_state(state, cfg, tp, rank)
    if etp > 1:
        state = etp_shard_state(state, etp, etp_rank)
    if ep > 1:
        state = ep_shard_state(state, ep, ep_rank)
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("_extra_state")]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise RuntimeError(
            f"from_pretrained: state dict mismatch: missing {missing}, unexpected {unexpected}"
        )
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise RuntimeError(f"from_pretrained: {k}: shape {tuple(v.shape)} != {own[k].shape}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device=device, dtype=dtype)
    model.rl_engine_rope = rope
    model.rl_engine_vocab_size = int(cfg["vocab_size"])  # the true vocabulary (token_logprobs)
    model.eval()
    return model


def _stock_moe_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``RLMoELayer``'s stacked experts as megatron's ``SequentialMLP`` tensors
    (``experts.local_experts.{e}.linear_fc1.weight`` ...); other names are the same."""
    out = {}
    for name, t in state.items():
        for fc in ("linear_fc1", "linear_fc2"):
            suffix = f".mlp.experts.{fc}.weight"
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                for e in range(t.shape[0]):
                    out[f"{base}.mlp.experts.local_experts.{e}.{fc}.weight"] = t[e]
                break
        else:
            out[name] = t
    return out


def stock_unsupported_reason(cfg: dict[str, Any]) -> str | None:
    """Why the stock megatron-core model (:func:`stock_from_pretrained`) cannot compute the
    checkpoint's model, or ``None``: its local spec has one MLP kind for every layer, its RoPE
    takes a base only, and its ``TopKRouter`` requires ``moe_router_pre_softmax`` at top-1."""
    sparse = moe_layers(cfg)
    if any(sparse) and not all(sparse):
        return (
            "a mix of dense and MoE layers (mlp_only_layers / decoder_sparse_step; the stock "
            "local spec has one MLP kind for every layer)"
        )
    rope = rope_from_hf_config(cfg)
    if rope.scaling is not None or rope.rotary_dim is not None:
        what = f"rope_type {rope.scaling['rope_type']!r}" if rope.scaling else "partial rotary"
        return (
            f"RoPE with {what} (megatron's stock rotary embedding is built from rope_theta "
            "alone: it would compute another model)"
        )
    spec = _moe_spec(cfg) if any(sparse) else None
    if spec is not None and spec.top_k == 1 and not _stock_pre_softmax(spec):
        return (
            f"{cfg['model_type']} num_experts_per_tok=1 (the expert's weight is 1: top-k then "
            "softmax over the k, or a renormalised softmax): megatron-core's TopKRouter "
            "requires moe_router_pre_softmax at top-1, which weights the expert by its softmax "
            "probability instead"
        )
    return None


def stock_from_pretrained(
    path: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None
) -> Any:
    """The *stock* megatron-core ``GPTModel`` (local spec, Megatron's own RoPE, no rl_engine ops)
    with the weights of a Hugging Face checkpoint: the "before" picture of tests and audits.
    MoE checkpoints get megatron's ``MoELayer`` (``TopKRouter``, allgather dispatcher,
    ``SequentialMLP``; no auxiliary loss; its nearest router: top-k then softmax, or softmax
    then top-k when the family does not renormalise).

    Megatron's model-parallel state must be initialised. Returns the model in eval mode; call it
    as ``model(input_ids, None, None)`` for logits [B, S, V] in the model dtype.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    path = os.fspath(path)
    cfg = _read_config(path)
    reason = stock_unsupported_reason(cfg)
    if reason is not None:
        raise UnsupportedNumericsError(f"stock_from_pretrained: {reason}")
    dtype = _config_dtype(cfg, dtype)
    mcfg = hf_config_to_megatron(cfg, dtype)
    rope = rope_from_hf_config(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))
    model = GPTModel(
        mcfg,
        get_gpt_layer_local_spec(
            num_experts=mcfg.num_moe_experts,
            moe_grouped_gemm=False,
            normalization="RMSNorm",
            qk_layernorm=mcfg.qk_layernorm,
        ),
        vocab_size=cfg["vocab_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=int(rope.theta),
    ).to(dtype)
    state = _stock_moe_names(hf_to_megatron_state(dict(_tensors(path)), cfg, tied))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or not all(k.endswith("_extra_state") for k in missing):
        raise RuntimeError(f"stock_from_pretrained: missing {missing}, unexpected {unexpected}")
    if torch.cuda.is_available():
        model = model.cuda()
    model.rl_engine_vocab_size = int(cfg["vocab_size"])  # the true vocabulary (token_logprobs)
    return model.eval()
