"""The benchmarks' figures are drawn only after a GPU run; this draws each one on the CPU from the
rows of a committed H100 result (benchmarks/results/h100/), so a plotting error shows here
first and not at the end of a device call."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "h100"


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def _rows(op: str) -> list[dict]:
    return json.loads((RESULTS / f"{op}.json").read_text())["rows"]


def _bench(name: str):
    return importlib.import_module(f"bench_{name}")


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "rope", "attention", "poly_norm"])
def test_plot_from_committed_rows(op, tmp_path):
    path = tmp_path / f"{op}.png"
    _bench(op).plot(_rows(op), path)
    assert path.stat().st_size > 1000


def test_det_gemm_plot(tmp_path):
    limits = json.loads((RESULTS / "limits.json").read_text())
    limits = limits.get("limits", limits)
    path = tmp_path / "det_gemm.png"
    _bench("det_gemm").plot(_rows("det_gemm"), limits, path)
    assert path.stat().st_size > 1000


def test_grpo_loss_and_linear_logp_plots(tmp_path):
    rows = _rows("grpo_loss")
    _bench("grpo_loss")._plot(
        tmp_path, [r for r in rows if r["part"] == "loss"], [r for r in rows if r["part"] != "loss"]
    )
    _bench("linear_logp")._plot(tmp_path, _rows("linear_logp"), 8192)
    for name in ("grpo_loss.png", "linear_logp.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_trainer_hf_plot(tmp_path):
    # the committed H100 run (an unavailable row, min / max step times) and the H200 one
    for gpu in ("h100", "h200"):
        payload = json.loads((RESULTS.parent / gpu / "trainer_hf.json").read_text())
        path = tmp_path / f"trainer_hf_{gpu}.png"
        _bench("trainer_hf").plot(path, payload)
        assert path.stat().st_size > 1000


def test_save_figure_without_matplotlib_writes_nothing(tmp_path, monkeypatch, capsys):
    common = importlib.import_module("common")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    common.save_figure(tmp_path / "x.png", lambda ax: None)
    assert not (tmp_path / "x.png").exists()
    assert "skipping the PNG" in capsys.readouterr().out


def test_rollout_rounds_merge_every_timed_generate():
    """``bench_rollout.py --rounds``: a row is the median over every timed generate of every
    engine process; each process's tokens/s is kept."""
    import bench_rollout

    def run(start, secs):
        row = dict(prompts=64, prompt_len=128, new_tokens=512, all_seconds=secs)
        row["seconds"] = sorted(secs)[len(secs) // 2]
        row["tokens_per_s"] = round(64 * 512 / row["seconds"], 1)
        return {"engine_start_s": start, "rows": [row]}

    one = run(30.0, [2.0, 2.2, 2.1])
    assert bench_rollout._merge_rounds([one]) is one
    merged = bench_rollout._merge_rounds([one, run(40.0, [1.0, 1.1, 1.2]), run(50.0, [3.0])])
    (row,) = merged["rows"]
    assert row["seconds"] == 2.0 and row["tokens_per_s"] == round(64 * 512 / 2.0, 1)
    assert sorted(row["all_seconds"]) == [1.0, 1.1, 1.2, 2.0, 2.1, 2.2, 3.0]
    assert row["round_tokens_per_s"] == [15603.8, 29789.1, 10922.7]
    assert merged["engine_start_s"] == 40.0 and len(merged["rounds"]) == 3


def test_poly_norm_plot_and_summary_line(tmp_path, capsys):
    """No committed GPU rows yet: synthetic rows in the benchmark's layout."""
    rows = [
        {"m": m, "h": h, "fused_mul": f, "fwd_bw_frac": 0.5 + 0.01 * i, "bwd_bw_frac": 0.4}
        for i, (m, h, f) in enumerate(
            (m, h, f) for f in (False, True) for m in (1, 1024, 16384) for h in (4096, 14336)
        )
    ]
    path = tmp_path / "poly_norm.png"
    _bench("poly_norm").plot(rows, path)
    assert path.stat().st_size > 1000
    common = importlib.import_module("common")
    common.finish(tmp_path, "poly_norm_t", {"a": 1}, summary={"x": 0.123456}, rows=rows)
    assert "poly_norm_t summary: x 0.123" in capsys.readouterr().out
    assert json.loads((tmp_path / "poly_norm_t.json").read_text())["rows"] == rows


def test_op_main_runs_summarizes_and_writes(tmp_path, monkeypatch, capsys):
    """``common.op_main``: ``run(args, copy_tb_s)``, then ``more(args)``, the summary of both, and
    one JSON with the fields in ``finish_op``'s order (``more``'s after the given ones)."""
    import argparse

    common = importlib.import_module("common")
    args = argparse.Namespace(out=tmp_path, quick=True)
    limits = {"copy_tb_s": 2.5}
    monkeypatch.setattr(common, "start", lambda doc, name, extra=None: (args, limits))
    calls = []
    rows = [{"m": 1, "fwd_bw_frac": 0.5}, {"m": 2, "fwd_bw_frac": 0.25}]

    def run(a, copy_tb_s):
        calls.append(("run", a, copy_tb_s))
        return rows

    def more(a):
        calls.append(("more", a))
        return {"qk_rows": [{"tokens": 1}]}

    def summarize(rs, qk_rows):
        calls.append(("summarize", rs, qk_rows))
        return {"frac": common.geomean([r["fwd_bw_frac"] for r in rs]), "qk": len(qk_rows)}

    common.op_main(
        "Doc line.\n\nMore.",
        "bench_fake",
        "fake",
        run,
        summarize,
        more=more,
        plot=lambda rs, path: calls.append(("plot", rs, path.name)),
        baseline="b",
        ratio="r",
        bw="w",
        qk_definition="q",
    )
    assert calls == [
        ("run", args, 2.5),
        ("more", args),
        ("summarize", rows, [{"tokens": 1}]),
        ("plot", rows, "fake.png"),
    ]
    out = json.loads((tmp_path / "fake.json").read_text())
    order = "provider baseline ratio_definition bw_frac_definition qk_definition qk_rows limits"
    fields = [*order.split(), "summary", "rows"]
    assert [k for k in out if k in fields] == fields
    assert out["provider"] == "triton" and out["limits"] == limits and out["rows"] == rows
    assert out["qk_rows"] == [{"tokens": 1}]
    assert "fake summary: frac 0.354, qk 1" in capsys.readouterr().out


def test_op_main_without_cuda_measures_nothing(tmp_path, monkeypatch, capsys):
    """Without a CUDA device ``op_main`` says so once (``common.start``'s line) and returns."""
    common = importlib.import_module("common")
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_fake.py", "--out", str(tmp_path)])

    def never(*a, **k):
        raise AssertionError("called without a device")

    common.op_main("Doc.", "bench_fake", "fake", never, never, more=never, plot=never)
    assert capsys.readouterr().out == "bench_fake: no CUDA device; nothing to measure\n"
    assert not (tmp_path / "fake.json").exists()


def test_vs_baseline_columns_and_geomeans():
    """``common.vs_baseline``: per key the bandwidth fraction and the baseline / ours ratio, named
    as the op benchmarks write them; ``ratio_geomeans`` and ``ratio_definition`` name the same."""
    common = importlib.import_module("common")
    t = {"fwd": 2.0, "bwd": 4.0, "compiled_fwd": 3.0, "compiled_bwd": 2.0}
    row: dict = {"m": 1}
    common.vs_baseline(row, t, {"fwd": 5e6, "bwd": 8e6}, 2.5, ("fwd", "bwd"), "compiled")
    assert list(row) == ["m", "fwd_bw_frac", "fwd_ratio_vs_compiled", "bwd_bw_frac",
                         "bwd_ratio_vs_compiled"]  # fmt: skip
    assert row["fwd_bw_frac"] == 5e6 / (2.0 * 1e-6) / 1e12 / 2.5 == common.bw_frac(5e6, 2.0, 2.5)
    assert row["fwd_ratio_vs_compiled"] == 1.5 and row["bwd_ratio_vs_compiled"] == 0.5
    other = {"fwd_ratio_vs_compiled": 6.0, "bwd_ratio_vs_compiled": 2.0}
    got = common.ratio_geomeans([row, other], ("fwd", "bwd"), "compiled")
    assert list(got) == ["geomean_fwd_vs_compiled", "geomean_bwd_vs_compiled"]
    assert got["geomean_fwd_vs_compiled"] == common.geomean([1.5, 6.0])
    assert common.ratio_definition("stock") == "stock_us / triton_us (higher is better)"


def test_progress_prints_the_row_and_returns_it(capsys):
    """``common.progress``: a case's line formatted from its row (and extra fields), flushed."""
    common = importlib.import_module("common")
    row = {"m": 16, "fwd_us": 12.345, "same": True}
    line = "{name} M={m:6d} fwd {fwd_us:8.1f} us (== native: {same})"
    assert common.progress(row, line, name="op") is row
    assert capsys.readouterr().out == "op M=    16 fwd     12.3 us (== native: True)\n"
