"""The numerics-family checks (``rl_engine.drift.metrics.provenance_check``, the audit's gate,
``DriftMonitor.check_families``) on registry reports: one side on plain ``det_gemm`` and the
other on the grouped ``det_gemm_tp`` reduction is a mismatch that names which side runs which
and the fix (issue 44 item 3). The same with real TP 1 / TP 2 Megatron trainers (gloo):
tests/adapters/test_megatron_tp.py."""

from __future__ import annotations

import pytest

from rl_engine.audit import DriftMonitor
from rl_engine.drift.metrics import logp_families, provenance_check, tp_reduction

GEMM = "det_gemm/native-k16"
GROUPED = f"det_gemm_tp/g8[{GEMM}]"


def _rec(op: str, numerics: str, invariant: bool = True) -> dict:
    return {"op": op, "device": "cpu", "provider": "native", "numerics": numerics,
            "invariant": invariant}  # fmt: skip


PLAIN = [_rec("det_gemm", GEMM), _rec("rms_norm", "rms_norm/native-tree")]
TP = [*PLAIN, _rec("det_gemm_tp", GROUPED)]


def test_tp_reduction_names_the_family_of_the_sharded_gemms():
    assert tp_reduction(PLAIN) == [GEMM]
    assert tp_reduction(TP) == [GROUPED]
    assert tp_reduction([_rec("rms_norm", "rms_norm/native-tree")]) == []
    assert tp_reduction([{"pid": 1, "registry": TP}, {"pid": 2, "registry": TP}]) == [GROUPED]


@pytest.mark.parametrize("grouped_side", ["rollout", "trainer"])
def test_plain_vs_grouped_is_a_mismatch_naming_sides_and_fix(grouped_side):
    roll, train = (TP, PLAIN) if grouped_side == "rollout" else (PLAIN, TP)
    check = provenance_check(roll, train)
    assert not check["ok"]
    (mm,) = check["mismatches"]
    assert mm["op"] == "det_gemm_tp"
    assert mm[grouped_side] == [GROUPED]
    plain_side = "trainer" if grouped_side == "rollout" else "rollout"
    (msg,) = check["problems"]
    assert f"{plain_side} runs plain det_gemm ({GEMM}; TP 1 with RL_ENGINE_TP_GROUPS" in msg
    assert f"{grouped_side} runs the grouped TP-invariant reduction ({GROUPED}; TP > 1" in msg
    assert "fix: set RL_ENGINE_TP_GROUPS=8 on both sides" in msg


def test_same_reduction_passes_and_other_mismatches_keep_their_message():
    assert provenance_check(PLAIN, PLAIN)["ok"]
    assert provenance_check(TP, [{"pid": 7, "registry": TP}])["ok"]  # vLLM per-worker form
    assert provenance_check([], TP)["ok"]  # nothing recorded on one side: nothing to compare
    other = [_rec("det_gemm", "det_gemm/stock", invariant=False)]
    check = provenance_check(PLAIN, other)
    assert [m["op"] for m in check["mismatches"]] == ["det_gemm"]
    assert check["problems"] == [
        f"op det_gemm: rollout ran numerics ['{GEMM}'], trainer ran ['det_gemm/stock']",
        "op det_gemm: a non-invariant provider was used",
    ]


def test_audit_gate_reports_the_reduction_mismatch():
    from rl_engine.audit.cli import _gate

    report = {
        "configurations": {
            "rl_engine": {
                "provenance": {"check": provenance_check(PLAIN, TP)},
                "bitwise_equal_fraction": 0.97,
                "max_abs_delta": 1e-3,
            }
        }
    }
    problems = _gate(report)
    assert len(problems) == 2
    assert "rollout runs plain det_gemm" in problems[0] and "RL_ENGINE_TP_GROUPS=8" in problems[0]


def test_drift_monitor_check_families():
    mon = DriftMonitor()
    assert mon.check_families(TP, TP) == []
    with pytest.warns(RuntimeWarning, match="rollout runs plain det_gemm"):
        assert len(mon.check_families(PLAIN, TP)) == 1
    with pytest.raises(RuntimeError, match="trainer runs the grouped TP-invariant reduction"):
        mon.check_families(PLAIN, TP, strict=True)


TRITON_LINEAR = "linear_logp/triton-v1024[det_gemm/triton-kc4096+logp/triton-v1024]"
UNFUSED = "linear_logp/unfused-v1024[logp/triton-v1024]"


def test_logp_families_of_both_token_logprob_ops():
    assert logp_families([_rec("logp", "logp/triton-v1024")]) == ["logp/triton-v1024"]
    assert logp_families([_rec("linear_logp", TRITON_LINEAR)]) == ["logp/triton-v1024"]
    assert logp_families([_rec("linear_logp", "linear_logp/native-v1024")]) == ["logp/native-v1024"]
    assert logp_families([_rec("linear_logp", "linear_logp/stock-torch")]) == ["logp/stock-torch"]
    assert logp_families(PLAIN) == []


def test_rollout_logp_vs_trainer_linear_logp():
    """A rollout's logp and a trainer's fused linear_logp agree where their log-softmax families
    do (the default: both Triton) and are a mismatch otherwise. The case met on an H200
    (2026-11-28): det_gemm pinned to cuda on both sides, linear_logp then native in the trainer
    while the rollout's logp stayed Triton: 83.8% of log-probs equal, same-op families equal."""
    gemm = "det_gemm/cuda-sm90"
    roll = [_rec("det_gemm", gemm), _rec("logp", "logp/triton-v1024")]
    assert provenance_check(roll, [_rec("det_gemm", "det_gemm/triton-kc4096"),
                                   _rec("linear_logp", TRITON_LINEAR)])["mismatches"][0]["op"] == (
        "det_gemm")  # fmt: skip
    ok_train = [_rec("det_gemm", gemm), _rec("linear_logp", "linear_logp/native-v1024")]
    ok_roll = [_rec("det_gemm", gemm), _rec("logp", "logp/native-v1024")]
    assert provenance_check(ok_roll, ok_train)["ok"]
    default = provenance_check(
        [_rec("det_gemm", "det_gemm/triton-kc4096"), _rec("logp", "logp/triton-v1024")],
        [_rec("det_gemm", "det_gemm/triton-kc4096"), _rec("linear_logp", TRITON_LINEAR)],
    )
    assert default["ok"]
    check = provenance_check(roll, ok_train)
    assert not check["ok"]
    (mm,) = check["mismatches"]
    assert (mm["op"], mm["rollout"], mm["trainer"]) == (
        "logp",
        ["logp/triton-v1024"],
        ["logp/native-v1024"],
    )
    (msg,) = check["problems"]
    assert "token log-probs: rollout computes them with log-softmax ['logp/triton-v1024']" in msg
    assert "pin RL_ENGINE_BACKEND_LINEAR_LOGP=unfused in the trainers" in msg
    unfused = [_rec("det_gemm", gemm), _rec("linear_logp", UNFUSED)]
    assert provenance_check(roll, unfused)["ok"]  # the fix: Triton logp on both sides
    # both sides on the same op: the same-op comparison alone (no second message)
    both = provenance_check(roll, [_rec("logp", "logp/native-v1024")])
    assert [m["op"] for m in both["mismatches"]] == ["logp"] and len(both["problems"]) == 1
