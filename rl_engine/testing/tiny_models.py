"""Tiny random Hugging Face checkpoints, generated locally with a fixed seed (no downloads).

``make_tiny_model(path, arch="llama")`` writes ``config.json`` + ``model.safetensors`` (no
tokenizer: prompts are token ids) that vLLM, transformers and the Megatron adapter all load.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")

# Mixture-of-experts defaults (tiny: 8 experts, top-2); overrides take the families' own names.
_MOE: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
    "qwen2_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}

_BASE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.08,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# arch -> (transformers config class, model class), by name
_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}


def _config(arch: str, dtype: str, tie_word_embeddings: bool, overrides: dict[str, Any]):
    import transformers

    kw = dict(_BASE)
    kw.update(_MOE.get(arch, {}))
    kw.update(overrides)
    theta = kw.pop("rope_theta")
    # an override's rope_parameters (RoPE scaling) keep their keys; rope_theta fills a gap
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta,
                             **(kw.get("rope_parameters") or {})}  # fmt: skip
    kw["tie_word_embeddings"] = tie_word_embeddings
    kw["dtype"] = dtype
    if arch not in _CLASSES:
        raise ValueError(f"unknown arch {arch!r}; supported: {ARCHS}")
    config_name, model_name = _CLASSES[arch]
    cfg = getattr(transformers, config_name)(**kw)
    cfg.architectures = [model_name]
    cls = getattr(transformers, model_name)
    return cfg, cls


def make_tiny_model(
    path: str | os.PathLike[str],
    arch: str = "llama",
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """Write a tiny random ``arch`` checkpoint to ``path`` and return the path.

    Args:
        path: folder to create (its parent must exist; an existing folder is overwritten).
        arch: ``llama``, ``qwen2`` (QKV bias), ``qwen3`` (q/k norm), or a mixture of experts:
            ``qwen3_moe`` (softmax top-k, renormalised), ``mixtral`` (top-k softmax) and
            ``qwen2_moe`` (a sigmoid-gated shared expert); 8 experts, top-2 by default.
        dtype: ``float32`` or ``bfloat16`` (the stored weights and the config's dtype).
        tie_word_embeddings: share the embedding and LM-head weights.
        seed: weights are a function of the seed only.
        **overrides: config fields (e.g. ``num_hidden_layers=4``).
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    cfg, cls = _config(arch, dtype, tie_word_embeddings, overrides)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            # Random (not unit) norm weights and biases so that every parameter matters.
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.05 * torch.randn_like(p))
        model = model.to(getattr(torch, dtype))
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a one-file write: no "Writing model shards" bar
        try:
            model.save_pretrained(path, safe_serialization=True)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
    finally:
        torch.random.set_rng_state(gen_state)
    # Record how the folder was made (for audit reports).
    with open(os.path.join(path, "rl_engine_tiny.json"), "w") as f:
        json.dump(
            {
                "arch": arch,
                "dtype": dtype,
                "tie_word_embeddings": tie_word_embeddings,
                "seed": seed,
                "overrides": overrides,
            },
            f,
            indent=1,
        )
    return path


# Vocabulary, RoPE base and embedding tying of the released families that the larger random
# models (benchmarks, GPU end-to-end checks) take their shape from: Qwen2 and Llama 3.
_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {"tie_word_embeddings": True, "vocab_size": 151936, "rope_theta": 1000000.0},
    "llama": {"tie_word_embeddings": False, "vocab_size": 128256, "rope_theta": 500000.0},
}


def family_config(
    arch: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    head_dim: int = 128,
    max_positions: int = 2048,
) -> dict[str, Any]:
    """``make_tiny_model`` keyword arguments (``arch`` and config fields) for a model of these
    sizes with the vocabulary, RoPE base and embedding tying of the ``arch`` family (``qwen2``:
    151936, 1e6, tied; ``llama``, as Llama 3: 128256, 5e5, untied)."""
    if arch not in _FAMILIES:
        raise ValueError(f"no family defaults for arch {arch!r}; known: {sorted(_FAMILIES)}")
    family = _FAMILIES[arch]
    return {
        "arch": arch,
        "tie_word_embeddings": family["tie_word_embeddings"],
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": ffn,
        "vocab_size": family["vocab_size"],
        "rope_theta": family["rope_theta"],
        "max_position_embeddings": max_positions,
    }


def make_tiny_tokenizer(path: str | os.PathLike[str], vocab_size: int = 512) -> str:
    """Write a word-level tokenizer for a tiny model folder (no downloads) and return the path.

    Token ``i`` is the word ``t<i>`` (``"t17 t400"`` -> ``[17, 400]``), 0 / 1 / 2 are
    ``<pad>`` / ``<s>`` / ``</s>`` (the tiny models' bos / eos ids). For frameworks that take
    text prompts (TRL) and a vLLM engine built with its tokenizer.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
    )
    path = os.fspath(path)
    fast.save_pretrained(path)
    return path
