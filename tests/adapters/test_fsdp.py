"""FSDP2 (``fully_shard``, 2 processes, gloo) shards parameters, not math: the patched HF
trainer's log-probs and gradients equal one unwrapped process bitwise (TP = 1 numerics)."""

from __future__ import annotations

import pytest
import torch
import trainer_cases as tc

from rl_engine.harness import fsdp_check

pytest.importorskip("transformers")


model = tc.tiny_model_fixture("qwen2", tc.tiny_shape(hidden=64, heads=4, kv_heads=2, head_dim=16))


def test_fsdp2_equals_one_process(model, tmp_path):
    base = fsdp_check.single(model)
    runs = fsdp_check.run(model, 2, str(tmp_path / "r"))
    assert len(base["grads"]) > 10 and base["logp"].numel() == 31
    assert fsdp_check.compare(base, runs) == []


def test_compare_reports_a_difference(model):
    base = fsdp_check.single(model)
    other = {"logp": base["logp"].clone(), "grads": dict(base["grads"])}
    other["logp"][3] = torch.nextafter(other["logp"][3], torch.tensor(0.0))
    name = next(iter(other["grads"]))
    other["grads"][name] = other["grads"][name] * 2
    bad = fsdp_check.compare(base, [other])
    assert any("log-probs" in b for b in bad) and any(name in b for b in bad)
