"""megatron-core trainer adapter (see docs/adapters/megatron.md).

* :func:`get_gpt_layer_rl_spec` / :func:`get_gpt_block_rl_spec`: GPT layer / block specs built
  from rl_engine modules (local spec; no Transformer Engine / apex).
* :func:`replace_modules`: swap an existing ``GPTModel``'s numerics to rl_engine in place.
* :func:`token_logprobs`: teacher-forced token log-probs through ``linear_logp``.
* :func:`stock_from_pretrained`: the stock local-spec model from the same checkpoint (baseline).
* :func:`from_pretrained`: a ``GPTModel`` with the rl_engine spec from a Hugging Face Llama /
  Qwen2 / Qwen3 checkpoint, or a Qwen3-MoE / Mixtral / Qwen2-MoE one (:class:`RLMoELayer`,
  expert parallelism, tensor and expert tensor parallelism).

Import explicitly (``import rl_engine.adapters.megatron``); needs ``megatron-core``.
"""

from rl_engine.adapters.megatron import _quiet  # noqa: F401  (first: before megatron imports)
from rl_engine.adapters.megatron.loader import (
    from_pretrained,
    hf_to_megatron_state,
    megatron_to_hf_state,
    stock_from_pretrained,
)
from rl_engine.adapters.megatron.logprobs import token_logprobs
from rl_engine.adapters.megatron.modules import (
    RopeSettings,
    UnsupportedModelError,
    UnsupportedNumericsError,
)
from rl_engine.adapters.megatron.moe import RLMoELayer
from rl_engine.adapters.megatron.replace import ReplaceReport, replace_modules
from rl_engine.adapters.megatron.spec import get_gpt_block_rl_spec, get_gpt_layer_rl_spec

__all__ = [
    "RLMoELayer",
    "ReplaceReport",
    "RopeSettings",
    "UnsupportedModelError",
    "UnsupportedNumericsError",
    "from_pretrained",
    "get_gpt_block_rl_spec",
    "get_gpt_layer_rl_spec",
    "hf_to_megatron_state",
    "megatron_to_hf_state",
    "replace_modules",
    "stock_from_pretrained",
    "token_logprobs",
]
