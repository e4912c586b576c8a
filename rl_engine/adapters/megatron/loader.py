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
    UnsupportedNumericsError,
)
from rl_engine.adapters.megatron.replace import _swap_class
from rl_engine.adapters.megatron.spec import get_gpt_block_rl_spec

__all__ = [
    "from_pretrained",
    "hf_config_to_megatron",
    "hf_to_megatron_state",
    "megatron_to_hf_state",
    "rope_from_hf_config",
    "shard_state",
    "stock_from_pretrained",
]

SUPPORTED = ("llama", "qwen2", "qwen3")


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
        raise UnsupportedNumericsError(
            f"from_pretrained: model_type {arch!r}; supported {SUPPORTED}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedNumericsError(f"from_pretrained: hidden_act {cfg['hidden_act']!r}")
    if cfg.get("use_sliding_window", False):
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
        add_qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_layernorm=arch == "qwen3",
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
    """Map a Hugging Face Llama / Qwen state dict to a TP = 1 ``GPTModel`` state dict.

    QKV: Megatron stores, per query group g, the rows ``[q heads of g; k_g; v_g]`` (so that a
    TP shard holds whole groups); the same interleave applies to the QKV bias. FC1 is
    ``[gate; up]``.
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
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


def check_tp_shapes(cfg: dict[str, Any], tp: int) -> None:
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
    for what, (size, glu) in sizes.items():
        try:
            tpm.check_split(size, tp, what=f"from_pretrained: {what}", groups=groups, glu=glu)
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
        if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
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
        fc1 = get(m + "mlp.linear_fc1.weight")
        out[h + "mlp.gate_proj.weight"] = fc1[:ffn].contiguous()
        out[h + "mlp.up_proj.weight"] = fc1[ffn:].contiguous()
        out[h + "mlp.down_proj.weight"] = get(m + "mlp.linear_fc2.weight")
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
    shard, :func:`shard_state`; the TP-invariant reductions need a degree in 1, 2, 4, 8). Megatron's model-parallel
    state must be initialised (``parallel_state.initialize_model_parallel``).

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
    path = os.fspath(path)
    cfg = _read_config(path)
    dtype = _config_dtype(cfg, dtype)
    tied = bool(cfg.get("tie_word_embeddings", False))
    check_tp_shapes(cfg, tp)
    config_overrides.setdefault("tensor_model_parallel_size", tp)
    tcfg = hf_config_to_megatron(cfg, dtype, **config_overrides)
    rope = rope_from_hf_config(cfg)
    spec = get_gpt_block_rl_spec(tcfg.num_layers, qk_layernorm=tcfg.qk_layernorm, rope=rope)
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


def stock_from_pretrained(
    path: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None
) -> Any:
    """The *stock* megatron-core ``GPTModel`` (local spec, Megatron's own RoPE, no rl_engine ops)
    with the weights of a Hugging Face checkpoint: the "before" picture of tests and audits.

    Megatron's model-parallel state must be initialised. Returns the model in eval mode; call it
    as ``model(input_ids, None, None)`` for logits [B, S, V] in the model dtype.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    path = os.fspath(path)
    cfg = _read_config(path)
    dtype = _config_dtype(cfg, dtype)
    mcfg = hf_config_to_megatron(cfg, dtype)
    rope = rope_from_hf_config(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))
    model = GPTModel(
        mcfg,
        get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=mcfg.qk_layernorm),
        vocab_size=cfg["vocab_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=int(rope.theta),
    ).to(dtype)
    state = hf_to_megatron_state(dict(_tensors(path)), cfg, tied)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or not all(k.endswith("_extra_state") for k in missing):
        raise RuntimeError(f"stock_from_pretrained: missing {missing}, unexpected {unexpected}")
    if torch.cuda.is_available():
        model = model.cuda()
    model.rl_engine_vocab_size = int(cfg["vocab_size"])  # the true vocabulary (token_logprobs)
    return model.eval()
