"""Hugging Face transformers trainer adapter (see docs/adapters/hf.md).

* :func:`patch_model`: route a Llama / Qwen2 / Qwen3 or Qwen3-MoE / Mixtral / Qwen2-MoE model's
  forward (logits included) through rl_engine ops, in place.
* :func:`token_logprobs`: teacher-forced token log-probs through ``linear_logp`` (the reference
  path the rollout engine is compared to).

Import explicitly (``import rl_engine.adapters.hf``); needs ``transformers``.
"""

from rl_engine.adapters.hf.logprobs import token_logprobs
from rl_engine.adapters.hf.patch import (
    UnsupportedModelError,
    is_patched,
    patch_model,
    rope_kwargs,
    unpatch_model,
)

__all__ = [
    "UnsupportedModelError",
    "is_patched",
    "patch_model",
    "rope_kwargs",
    "token_logprobs",
    "unpatch_model",
]
