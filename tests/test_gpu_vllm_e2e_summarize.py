"""scripts/gpu_vllm_e2e.py --summarize: the verdict of a GPU run recomputed from its result files.

A device call that runs past its limit loses the run's summary; its result files (the rollouts',
the trainers') come back and ``--summarize`` recomputes the rows and the verdict from them with the
same comparison code, running nothing. These tests write small result files of the shape the
rollout and trainer modes write and check the verdict: every check 100% passes, one differing
log-prob fails, a missing trainer result is an error, not a pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_vllm_e2e.py"
REGISTRY = [
    {"op": "det_gemm", "numerics": "det_gemm/triton-kc4096", "invariant": True},
    {"op": "rms_norm", "numerics": "rms_norm/triton", "invariant": True},
]


def _rollout(logprobs: list[list[float]], plugin: bool) -> dict:
    tokens = [[7] * len(row) for row in logprobs]
    res = {
        "plugin": plugin,
        "engine_start_s": 1.0,
        "batch_tokens": tokens,
        "batch_logprobs": logprobs,
        "alone_tokens": tokens,
        "alone_logprobs": logprobs,
        "again_tokens": tokens,
        "again_logprobs": logprobs,
        "vllm_version": "0.24.0",
        "device": "NVIDIA H200",
        "environment": {
            "code_hash": "0123456789abcdef",
            "date": "2026-11-29T03:00:00+00:00",
            "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0"},
        },
    }
    if plugin:
        res["require_routing"] = "ok"
        res["provenance"] = [
            {
                "models": [{"unroutable": [], "routed": {"RMSNorm": 3}, "model_runner": "v2"}],
                "executed": {"logp_calls": 5},
                "registry": REGISTRY,
            }
        ]
    return res


def _write(work: Path, arch: str, plugin_lp, stock_lp, trainer_lp, trainer: bool = True) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{arch}_plugin.json").write_text(json.dumps(_rollout(plugin_lp, True)))
    (work / f"{arch}_stock.json").write_text(json.dumps(_rollout(stock_lp, False)))
    if trainer:
        side = {"plugin": trainer_lp, "stock": trainer_lp}
        (work / f"{arch}_trainer.json").write_text(
            json.dumps({"hf": side, "megatron": side, "errors": {}, "registry": REGISTRY})
        )


def _summarize(out: Path, arch: str) -> tuple[int, dict, str]:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--summarize", "--archs", arch, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    summary = json.loads((out / "gpu_vllm_e2e.json").read_text())
    return r.returncode, summary, r.stdout + r.stderr


LP = [[-0.5, -1.25, -2.0], [-0.125, -3.5]]


@pytest.mark.parametrize("arch", ["qwen2_moe"])
def test_summarize_passes_equal_results(tmp_path, arch):
    stock = [[-0.5, -1.25, -2.5], [-0.125, -3.0]]  # stock differs from the trainer
    _write(tmp_path / "gpu_vllm_e2e", arch, LP, stock, LP)
    rc, s, out = _summarize(tmp_path, arch)
    assert rc == 0, out
    assert s["ok"] is True and s["complete"] is True
    # the run's machine and code, not this machine's
    assert s["device"] == "NVIDIA H200" and s["code_hash"] == "0123456789abcdef"
    assert s["torch"] == "2.11.0+cu130" and s["date"] == "2026-11-29T03:00:00+00:00"
    plugin, stock_row = s["archs"][arch]["plugin"], s["archs"][arch]["stock"]
    for k in ("a_batch_vs_alone", "b_vs_hf", "b_vs_megatron", "c_prefix_hit_rerun"):
        assert plugin[k]["equal_pct"] == 100.0
    assert plugin["e_provenance"]["ok"] is True
    assert stock_row["b_vs_hf"]["equal_pct"] < 100.0
    assert "overall: PASS" in out


def test_summarize_fails_one_differing_logprob(tmp_path):
    trainer = [[-0.5, -1.25, -2.0], [-0.125, -3.5000002]]
    _write(tmp_path / "gpu_vllm_e2e", "qwen2", LP, LP, trainer)
    rc, s, out = _summarize(tmp_path, "qwen2")
    assert rc == 1, out
    assert s["ok"] is False
    row = s["archs"]["qwen2"]["plugin"]
    assert row["b_vs_hf"]["equal"] == 4 and row["b_vs_hf"]["total"] == 5
    assert row["all_100"] is False
    assert "overall: FAIL" in out


def test_summarize_missing_trainer_is_an_error(tmp_path):
    _write(tmp_path / "gpu_vllm_e2e", "llama", LP, LP, LP, trainer=False)
    rc, s, out = _summarize(tmp_path, "llama")
    assert rc == 1, out
    assert s["ok"] is False
    assert "--summarize: no" in s["archs"]["llama"]["trainer_error"]
    assert "b_vs_hf" not in s["archs"]["llama"]["plugin"]
