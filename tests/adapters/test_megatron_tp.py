"""Tensor-parallel degree invariance of the Megatron trainer with real process groups (gloo,
2 and 4 processes on the CPU): log-probs and every gradient shard at TP 2 and 4 equal TP = 1's
bitwise, and TP = 1 equals the patched Hugging Face trainer. fp32 weights: with bf16 inputs a
tiny model's fp32 accumulations are often exact in any order (products of 8-bit mantissas, few
terms), which would hide an order difference. The negative control: TP = 1 with
the plain det_gemm reduction (``RL_ENGINE_TP_GROUPS`` unset) does not equal TP = 2.

A two-way sum is order-free, so TP = 2 alone could not catch a wrong combine order: TP = 4 can
(and tests/ops/test_det_gemm_tp.py checks TP 2, 4, 8 in one process).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

import trainer_cases as tc  # noqa: E402

from rl_engine.adapters.megatron import UnsupportedNumericsError  # noqa: E402
from rl_engine.adapters.megatron.loader import shard_state  # noqa: E402
from rl_engine.harness import tp_check  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

SHAPE = tc.tiny_shape(hidden=64, heads=8, kv_heads=4, head_dim=16)


model = tc.tiny_model_fixture("qwen2", SHAPE)


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """TP 1 and 4 with ``RL_ENGINE_TP_GROUPS=8``; TP 2 with it unset (the default: the grouped
    reduction at TP > 1, so the same bits)."""
    out = tmp_path_factory.mktemp("tp_runs")
    groups = {1: "8", 2: "", 4: "8"}
    return {t: tp_check.run(model, t, str(out / f"tp{t}"), "float32", g) for t, g in groups.items()}


@pytest.fixture(scope="module")
def plain(model, tmp_path_factory):
    """TP 1 with ``RL_ENGINE_TP_GROUPS`` unset: the plain det_gemm reduction (today's default)."""
    out = tmp_path_factory.mktemp("tp_plain")
    return tp_check.run(model, 1, str(out / "plain"), "float32", groups="")


@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_tp_equals_tp1_bitwise(model, runs, tp):
    assert len(runs[tp]) == tp
    assert runs[1][0]["logp"].numel() == 31 and len(runs[tp][0]["grads"]) > 10
    assert tp_check.compare(model, runs[1], runs[tp]) == []


def test_megatron_tp4_sequence_parallel_equals_tp1(model, runs, tmp_path):
    """Sequence parallelism: the row-parallel outputs reduce-scattered over the tokens (the
    grouped reduction's all-to-all of row blocks), the column-parallel inputs all-gathered.
    Log-probs and every gradient equal TP = 1's, the norm weights' too: used on each rank's
    token block, their gradients are the row-grouped ones (rl_engine.ops.rms_norm.tp), complete
    on every rank, so no weight is left holding a partial sum for Megatron's finalize step."""
    sp = tp_check.run(model, 4, str(tmp_path / "sp"), "float32", sequence_parallel=True)
    assert sp[0]["partial"] == []
    norms = [n for n in sp[0]["grads"] if "layernorm" in n]
    assert len(norms) == 2 * SHAPE["num_hidden_layers"] + 1, norms  # input, pre-MLP; final
    assert tp_check.compare(model, runs[1], sp) == []


def test_megatron_tp1_equals_hf(model, runs):
    assert torch.equal(tp_check.hf_logprobs(model, "float32"), runs[1][0]["logp"])


def test_plain_reduction_at_tp1_does_not_equal_tp2(model, runs, plain):
    bad = tp_check.compare(model, plain, runs[2])
    assert bad, "the plain det_gemm order at TP = 1 should differ from the grouped TP = 2"


def test_default_tp1_and_tp2_families_differ_and_the_checks_say_so(plain, runs):
    """Issue 44 item 3, until the grouped reduction is the default at TP 1: with
    ``RL_ENGINE_TP_GROUPS`` unset, a TP 1 and a TP 2 trainer run different reductions, record
    different families for them, and the family checks (the audit's, ``DriftMonitor``'s) name
    which side runs which and the fix, instead of passing on the ops both resolved."""
    from rl_engine.audit import DriftMonitor
    from rl_engine.drift.metrics import provenance_check, tp_reduction

    one, two = plain[0]["provenance"], runs[2][0]["provenance"]
    assert tp_reduction(one) == ["det_gemm/native-k16"]
    assert tp_reduction(two) == ["det_gemm_tp/g8[det_gemm/native-k16]"]
    check = provenance_check(one, two, names=("TP 1 trainer", "TP 2 trainer"))
    assert not check["ok"]
    assert [m["op"] for m in check["mismatches"]] == ["det_gemm_tp"]
    (msg,) = check["problems"]
    assert "TP 1 trainer runs plain det_gemm (det_gemm/native-k16; TP 1 with" in msg
    assert "TP 2 trainer runs the grouped TP-invariant reduction (det_gemm_tp/g8[" in msg
    assert "set RL_ENGINE_TP_GROUPS=8 on both sides" in msg
    with pytest.warns(RuntimeWarning, match="rollout runs plain det_gemm"):
        (said,) = DriftMonitor().check_families(one, two)
    assert "trainer runs the grouped TP-invariant reduction" in said
    with pytest.raises(RuntimeError, match="RL_ENGINE_TP_GROUPS=8 on both sides"):
        DriftMonitor().check_families(one, two, strict=True)
    lp1, lp2 = plain[0]["logp"][None], runs[2][0]["logp"][None]
    assert DriftMonitor(position_bins=None, seqlen_bins=None)(lp1, lp2)["bitwise_equal_frac"] < 1


def test_groups_on_both_sides_families_equal_and_bitwise(runs):
    """``RL_ENGINE_TP_GROUPS=8`` at TP 1 (and 4): the same families as the TP 2 default, the
    checks pass, the log-probs are bitwise equal."""
    from rl_engine.audit import DriftMonitor
    from rl_engine.drift.metrics import provenance_check

    one = runs[1][0]["provenance"]
    for t in (2, 4):
        check = provenance_check(one, runs[t][0]["provenance"])
        assert check["ok"] and not check["problems"], check
        assert DriftMonitor().check_families(one, runs[t][0]["provenance"], strict=True) == []
        assert torch.equal(runs[1][0]["logp"], runs[t][0]["logp"])


def test_shard_state_refuses_degrees_the_shapes_do_not_allow():
    cfg = dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=256, intermediate_size=128)
    with pytest.raises(UnsupportedNumericsError, match="query groups"):
        shard_state({}, cfg, 8, 0)
    with pytest.raises(UnsupportedNumericsError, match="degree 3"):
        shard_state({}, cfg, 3, 0)


def test_check_tp_shapes_names_the_allowed_degrees(monkeypatch):
    from rl_engine import config
    from rl_engine.adapters.megatron.loader import check_tp_shapes

    cfg = dict(SHAPE)
    check_tp_shapes(cfg, 4)  # fine
    with pytest.raises(UnsupportedNumericsError, match=r"allowed degrees: \[1, 2, 4, 8\]"):
        check_tp_shapes(cfg, 3)
    with pytest.raises(UnsupportedNumericsError, match="vocabulary.*not a multiple of 8"):
        check_tp_shapes({**cfg, "vocab_size": 260}, 2)
    monkeypatch.setenv("RL_ENGINE_TP_GROUPS", "0")
    config.reload()
    try:
        with pytest.raises(ValueError, match="RL_ENGINE_TP_GROUPS=0"):
            check_tp_shapes(cfg, 2)
        check_tp_shapes({**cfg, "vocab_size": 260}, 1)  # the plain reduction: nothing to split
    finally:
        monkeypatch.delenv("RL_ENGINE_TP_GROUPS")
        config.reload()


def test_megatron_qwen3_qk_norms_tp4_equal_tp1(tmp_path_factory):
    """Qwen3's per-head q / k norms at TP 4 (each rank normalises its heads): after the
    finalize step's TP sum of their gradients (which Megatron does by name), every gradient and
    the log-probs equal TP = 1's. Their per-head partials are all-gathered and tree-summed
    (rl_engine.ops.rms_norm.tp.rms_norm_heads_tp); rank 0 holds the sum, the others zeros."""
    model = make_tiny_model(
        tmp_path_factory.mktemp("tp") / "qwen3", arch="qwen3", dtype="float32", seed=0, **SHAPE
    )
    out = tmp_path_factory.mktemp("tp_qwen3")
    one = tp_check.run(model, 1, str(out / "tp1"), "float32")
    four = tp_check.run(model, 4, str(out / "tp4"), "float32")
    summed = four[0]["finalize_summed"]
    assert len(summed) == 2 * SHAPE["num_hidden_layers"], summed
    assert all("q_layernorm" in n or "k_layernorm" in n for n in summed)
    assert tp_check.compare(model, one, four) == []
