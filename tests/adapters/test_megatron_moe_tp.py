"""megatron-core adapter, mixture of experts under tensor parallelism (issue 43, item 3), with
real process groups (gloo, 2 and 4 processes on the CPU; ``rl_engine.harness.ep_check``).

Tiny fp32 checkpoints (with bf16 a tiny model's fp32 sums are often exact in any order, which
would hide an order difference), ``RL_ENGINE_TP_GROUPS=8`` everywhere (the base, TP = EP = 1,
runs the grouped reductions too). Against the base, bitwise: every rank's log-probs, its input
gradient (the embedding output's), each rank's expert-weight gradients (its experts, its
``I / ETP`` shard of them in megatron's layout) and, with one data-parallel replica, every
other gradient (its TP shard):

* Qwen3-MoE at TP 2 with expert TP 2 (megatron-core's default ETP = TP), TP 2 + EP 2 with
  ETP 2 (4 ranks: two replicas of 2 TP ranks, the experts split over the replicas), and TP 4
  with ETP 4 (a four-way combine, whose order a two-way sum could not test);
* Qwen2-MoE (a TP-sharded shared expert) at TP 2 with ETP 1 and EP 2: the EP group is the TP
  group, whose ranks hold the same tokens (only one of them contributes its rows);
* the negative control: TP 2 with the experts' down projection as plain per-rank partial sums
  added by an all-reduce differs;
* TP 1 with the grouped reductions == the patched Hugging Face trainer (log-probs);
* refusals: sequence parallelism with MoE layers, ETP not dividing TP, sizes the grouping
  cannot split.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

import trainer_cases as tc  # noqa: E402  (tests/adapters: shared inputs)

from rl_engine.adapters.megatron import UnsupportedNumericsError  # noqa: E402
from rl_engine.harness import ep_check  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

# CPU ranks (ep_check.run(device="cpu") hides the GPUs from them) and CPU tensors in process:
# the same on a CUDA machine
pytestmark = pytest.mark.megatron

# 8 query / 4 key-value heads: TP 4 divides the query groups; I = 64 splits into 8 groups at
# ETP 1, 2 and 4
SHAPE = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("q3m") / "qwen3_moe"
    return make_tiny_model(path, arch="qwen3_moe", dtype="float32", seed=3, **SHAPE)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("q2m") / "qwen2_moe"
    return make_tiny_model(path, arch="qwen2_moe", dtype="float32", seed=4, **SHAPE)


def _base(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    return ep_check.run(model, 1, str(out / "tp1"), "float32", groups="8")


@pytest.fixture(scope="module")
def base3(qwen3, tmp_path_factory):
    return _base(qwen3, tmp_path_factory)


@pytest.fixture(scope="module")
def base2(qwen2, tmp_path_factory):
    return _base(qwen2, tmp_path_factory)


def _run(model, tmp_path, tp, ep, etp, control=False):
    out = str(tmp_path / f"tp{tp}ep{ep}etp{etp}")
    return ep_check.run(model, ep, out, "float32", tp=tp, etp=etp, groups="8", control=control)


def _expert_shapes(res):
    return {n: tuple(g.shape) for n, g in res["grads"].items() if ".mlp.experts." in n}


def test_tp2_etp2_equals_tp1(qwen3, base3, tmp_path):
    two = _run(qwen3, tmp_path, 2, 1, 2)
    assert len(two) == 2 and two[0]["dp"] == 1
    # every rank holds I / 2 of every expert: fc1 [E, 2 I / 2, H], fc2 [E, H, I / 2]
    shapes = _expert_shapes(two[1])
    assert shapes["decoder.layers.0.mlp.experts.linear_fc1.weight"] == (8, 64, 128)
    assert shapes["decoder.layers.1.mlp.experts.linear_fc2.weight"] == (8, 128, 32)
    assert len(two[0]["grads"]) == len(base3[0]["grads"]) > 10
    assert ep_check.compare(base3, two, qwen3) == []
    # the comparison can fail: one perturbed element of one rank's expert shard is caught
    two[1]["grads"]["decoder.layers.1.mlp.experts.linear_fc2.weight"][3, 5, 7] += 1.0
    (bad,) = ep_check.compare(base3, two, qwen3)
    assert "rank 1: gradient of decoder.layers.1.mlp.experts.linear_fc2.weight" in bad


def test_tp2_ep2_etp2_equals_tp1(qwen3, base3, tmp_path):
    """4 ranks: two data-parallel replicas of TP 2, each with its own sequences; experts 0-3 on
    the first replica's ranks, 4-7 on the second's, each TP rank holding I / 2 of them."""
    four = _run(qwen3, tmp_path, 2, 2, 2)
    assert [r["tokens"] for r in four][::2] == [r["tokens"] for r in four][1::2]
    assert four[0]["tokens"] != four[2]["tokens"] and four[0]["dp"] == 2
    fc1 = "decoder.layers.0.mlp.experts.linear_fc1.weight"
    assert _expert_shapes(four[3])[fc1] == (4, 64, 128)
    assert ep_check.compare(base3, four, qwen3) == []


def test_tp4_etp4_equals_tp1(qwen3, base3, tmp_path):
    """A four-way combine of the ranks' subtrees (a two-way sum is order-free)."""
    four = _run(qwen3, tmp_path, 4, 1, 4)
    assert _expert_shapes(four[2])["decoder.layers.0.mlp.experts.linear_fc2.weight"] == (
        8,
        128,
        16,
    )
    assert ep_check.compare(base3, four, qwen3) == []


def test_ep4_equals_ep1(qwen3, base3, tmp_path):
    """EP 4 without TP: four data-parallel ranks with their own sequences, two of the 8 experts
    each; the combine never depends on where an expert ran."""
    four = _run(qwen3, tmp_path, 1, 4, 1)
    assert len({tuple(r["tokens"]) for r in four}) == 4 and four[0]["dp"] == 4
    assert _expert_shapes(four[1])["decoder.layers.0.mlp.experts.linear_fc1.weight"][0] == 2
    assert ep_check.compare(base3, four, qwen3) == []


def test_control_plain_partial_sums_differ(qwen3, base3, tmp_path):
    """Without the grouped reduction (each rank's plain det_gemm of its I / 2 shard, the two
    partial sums added by an all-reduce) the log-probs and gradients differ from TP 1's."""
    ctl = _run(qwen3, tmp_path, 2, 1, 2, control=True)
    bad = ep_check.compare(base3, ctl, qwen3)
    assert any("log-probs differ" in b for b in bad), bad
    assert any("input gradient differs" in b for b in bad), bad


def test_qwen2_moe_tp2_etp1_ep2_equals_tp1(qwen2, base2, tmp_path):
    """ETP 1, EP 2 on 2 ranks: the EP group is the TP group (the same tokens on both ranks;
    rank 0 alone contributes them), each rank holds 4 whole experts; the shared expert is
    TP-sharded like a dense MLP."""
    two = _run(qwen2, tmp_path, 2, 2, 1)
    assert two[0]["tokens"] == two[1]["tokens"] and two[0]["dp"] == 1
    shapes = _expert_shapes(two[0])
    assert shapes["decoder.layers.0.mlp.experts.linear_fc1.weight"] == (4, 128, 128)
    assert tuple(two[1]["grads"]["decoder.layers.0.mlp.shared_experts.linear_fc2.weight"].shape)[
        1
    ] == (base2[0]["grads"]["decoder.layers.0.mlp.shared_experts.linear_fc2.weight"].shape[1] // 2)
    assert ep_check.compare(base2, two, qwen2) == []


def test_tp1_grouped_equals_hf(qwen3, base3):
    """TP 1 with the grouped reductions == the patched Hugging Face trainer with them."""
    from transformers import AutoModelForCausalLM

    from rl_engine.adapters import hf as ha
    from rl_engine.harness._spawn import tp_groups_env
    from rl_engine.harness.tp_check import batch

    with tp_groups_env("8"):
        hf = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
        ha.patch_model(hf)
        ids, cu = batch(hf.config.vocab_size, ep_check.LENGTHS)
        with torch.no_grad():
            lp = ha.token_logprobs(hf, ids, cu_seqlens=cu)
    assert torch.equal(lp, base3[0]["logp"])


# ---------------------------------------------------------------------------------- refusals
def test_refuses_sequence_parallel_and_etp_not_dividing_tp():
    from rl_engine.adapters.megatron import RLMoELayer

    with pytest.raises(UnsupportedNumericsError, match="sequence parallelism with MoE layers"):
        RLMoELayer(tc.moe_config(tensor_model_parallel_size=2, sequence_parallel=True))
    with pytest.raises(UnsupportedNumericsError, match="ETP must divide TP"):
        RLMoELayer(tc.moe_config(tensor_model_parallel_size=2, expert_tensor_parallel_size=4))


def test_expert_shapes_the_grouping_cannot_split_are_refused():
    from rl_engine.adapters.megatron.loader import check_tp_shapes, etp_shard_state

    cfg = dict(model_type="qwen3_moe", num_hidden_layers=1, hidden_size=64, vocab_size=256,
               num_attention_heads=8, num_key_value_heads=4, head_dim=8, intermediate_size=64,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
               norm_topk_prob=True)  # fmt: skip
    check_tp_shapes(cfg, 2, 2)
    with pytest.raises(
        UnsupportedNumericsError, match=r"experts \(down projection\).*not a multiple"
    ):
        check_tp_shapes({**cfg, "moe_intermediate_size": 36}, 2, 1)
    with pytest.raises(UnsupportedNumericsError, match="degree 3"):
        check_tp_shapes(cfg, 2, 3)
    state = {"decoder.layers.0.mlp.experts.linear_fc2.weight": torch.zeros(8, 4, 6)}
    with pytest.raises(UnsupportedNumericsError, match="intermediate size 6 does not divide"):
        etp_shard_state(state, 4, 0)
    fc1 = torch.arange(2 * 6 * 2.0).view(1, 12, 2)  # one expert, I = 6: rows [gate; up]
    got = etp_shard_state({"x.mlp.experts.linear_fc1.weight": fc1}, 3, 1)
    want = torch.cat([fc1[:, 2:4], fc1[:, 8:10]], dim=1)  # [gate_1; up_1]
    assert torch.equal(got["x.mlp.experts.linear_fc1.weight"], want)
