"""The benchmarks' figures are drawn only after a GPU run; this draws each one on the CPU from the
rows of a committed H100 result (benchmarks/results/h100/), so a plotting error shows here
first and not at the end of a device call. Each test reads back what was drawn (the figure's
axes: titles, lines and bars with their data, reference lines), not the PNG's size."""

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


@pytest.fixture
def figures(monkeypatch):
    """The figures drawn during the test, in order: ``plt.close`` keeps them open to be read
    back (closed at teardown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for fig in kept:
        close(fig)


def _one(figures, path: Path):
    assert path.stat().st_size > 0 and len(figures) == 1, "one figure drawn and saved"
    return figures[0]


def _data_lines(ax) -> list:
    """The lines drawn in data coordinates (not ``axhline`` / ``axvline``)."""
    return [ln for ln in ax.get_lines() if ln.get_transform() == ax.transData]


def _ref_lines(ax) -> list[float]:
    """The positions of the horizontal / vertical reference lines (``axhline``, ``axvline``)."""
    out = []
    for ln in ax.get_lines():
        if ln.get_transform() != ax.transData:
            xs, ys = ln.get_xdata(), ln.get_ydata()
            out.append(float(ys[0]) if ys[0] == ys[-1] and xs[0] != xs[-1] else float(xs[0]))
    return sorted(out)


def _bars(ax, horizontal: bool = False) -> list[float]:
    return [p.get_width() if horizontal else p.get_height() for p in ax.patches]


def _check_bw_lines(ax, rows, *, group, x, y, title, target=None):
    """``common.bw_lines``: one line per group value with that group's ``row[y]`` over
    ``row[x]`` (sorted by x), the copy-bandwidth line at 1 and the dashed target."""
    assert ax.get_title() == title
    assert ax.get_xscale() == "log" and ax.get_ylabel() == "fraction of measured copy bandwidth"
    groups = sorted({group(r) for r in rows})
    lines = _data_lines(ax)
    assert len(lines) == len(groups), (title, len(lines), groups)
    for ln, g in zip(lines, groups):
        rs = sorted((r for r in rows if group(r) == g), key=lambda r: r[x])
        assert list(ln.get_xdata()) == [r[x] for r in rs]
        assert list(ln.get_ydata()) == [r[y] for r in rs], (title, g)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [ln.get_label() for ln in lines]
    assert _ref_lines(ax) == sorted([1.0] + ([target] if target is not None else []))


# (group field, x, [(rows filter, key, title, target)]) of each op's bw_panels figure
def _panels(op: str, rows: list[dict]):
    if op == "rms_norm":
        return "h", [
            (rows, k, f"rms_norm triton bf16: {k}", 0.75 if "bwd" in k else 0.9)
            for k in ("fwd", "fused_fwd", "bwd", "fused_bwd")
        ]
    if op == "silu_and_mul":
        return "d", [(rows, k, f"silu_and_mul triton bf16: {k}", None) for k in ("fwd", "bwd")]
    assert op == "poly_norm"
    return "h", [
        ([r for r in rows if r["fused_mul"] == f],
         k, f"{'fused_mul_poly_norm' if f else 'poly_norm'} triton bf16: {k}", 0.85)
        for f in (False, True) for k in ("fwd", "bwd")
    ]  # fmt: skip


def _check_bw_panels(fig, op: str, rows: list[dict]) -> None:
    group, panels = _panels(op, rows)
    assert len(fig.axes) == len(panels)
    for ax, (rs, key, title, target) in zip(fig.axes, panels):
        assert rs, title
        _check_bw_lines(ax, rs, group=lambda r: r[group], x="m", y=f"{key}_bw_frac",
                        title=title, target=target)  # fmt: skip
        labels = [ln.get_label() for ln in _data_lines(ax)]
        assert labels == [f"{group.upper()}={v}" for v in sorted({r[group] for r in rs})]


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "poly_norm"])
def test_bw_panels_from_committed_rows(op, tmp_path, figures):
    rows = _rows(op)
    path = tmp_path / f"{op}.png"
    _bench(op).plot(rows, path)
    _check_bw_panels(_one(figures, path), op, rows)


def test_rope_plot(tmp_path, figures):
    rows = _rows("rope")
    path = tmp_path / "rope.png"
    _bench("rope").plot(rows, path)
    (ax,) = _one(figures, path).axes
    _check_bw_lines(ax, rows, group=lambda r: (r["heads"], r["head_dim"]), x="tokens",
                    y="bw_frac", title="rope triton bf16 (llama3 scaling)")  # fmt: skip
    assert ax.get_xlabel() == "tokens"


def test_attention_plot(tmp_path, figures):
    rows = _rows("attention")
    path = tmp_path / "attention.png"
    _bench("attention").plot(rows, path)
    ax0, ax1 = _one(figures, path).axes
    pre = [r for r in rows if r["case"] == "prefill"]
    dec = [r for r in rows if r["case"] == "decode"]
    assert pre and dec
    # forward bars then forward + backward bars, one per prefill row; decode: one per provider
    assert _bars(ax0) == [r["fwd_ratio_vs_sdpa"] for r in pre] + [
        r["fwd_bwd_ratio_vs_sdpa"] for r in pre
    ]
    assert len(ax0.get_xticklabels()) == len(pre)
    assert _ref_lines(ax0) == [0.8, 0.9, 1.0]
    assert ax0.get_title().startswith("causal prefill")
    assert _bars(ax1) == [r["kv_bw_frac"] for r in dec]
    assert [t.get_text() for t in ax1.get_xticklabels()] == [r["provider"] for r in dec]
    assert ax1.get_title().startswith("decode")


def test_det_gemm_plot(tmp_path, figures):
    limits = json.loads((RESULTS / "limits.json").read_text())
    limits = limits.get("limits", limits)
    rows = _rows("det_gemm")
    path = tmp_path / "det_gemm.png"
    mod = _bench("det_gemm")
    mod.plot(rows, limits, path)
    ax1, ax2 = _one(figures, path).axes
    shapes = [s.name for s in mod.GEMM_SHAPES]
    # the ratio panel: a line per GEMM shape, cuBLAS time / det_gemm time over M
    lines = _data_lines(ax1)
    assert [ln.get_label() for ln in lines] == shapes
    for ln, name in zip(lines, shapes):
        rs = [r for r in rows if r["shape"] == name]
        assert rs and list(ln.get_ydata()) == [r["ratio"] for r in rs], name
    assert _ref_lines(ax1) == [0.9, 1.0] and ax1.get_title() == "det_gemm (triton, bf16) vs cuBLAS"
    # the roofline: det_gemm and cuBLAS points per shape, then the roofline at the measured peak
    pts = _data_lines(ax2)
    assert len(pts) == 2 * len(shapes) + 2
    for i, name in enumerate(shapes):
        rs = [r for r in rows if r["shape"] == name]
        assert list(pts[2 * i].get_ydata()) == [r["triton_tflop_s"] for r in rs]
        assert list(pts[2 * i + 1].get_ydata()) == [r["cublas_tflop_s"] for r in rs]
    assert max(pts[-1].get_ydata()) == limits["bf16_mm_tflop_s"]


def test_grpo_loss_and_linear_logp_plots(tmp_path, figures):
    rows = _rows("grpo_loss")
    loss = [r for r in rows if r["part"] == "loss"]
    head = [r for r in rows if r["part"] != "loss"]
    _bench("grpo_loss")._plot(tmp_path, loss, head)
    (fig,) = figures
    ax0, ax1, twin = fig.axes
    assert _bars(ax0) == [r["triton_us"] for r in loss] + [r["torch_us"] for r in loss]
    assert ax0.get_title() == "grpo_loss (bf16 logp)"
    ok = [r for r in head if "us" in r]
    assert ok and _bars(ax1) == [r["us"] / 1e3 for r in ok]
    (peak,) = _data_lines(twin)
    assert list(peak.get_ydata()) == [r["peak_mib"] / 1024 for r in ok]
    ll = _rows("linear_logp")
    _bench("linear_logp")._plot(tmp_path, ll, 8192)
    ax0, ax1 = figures[1].axes
    ok = [r for r in ll if "us" in r]
    assert ok and _bars(ax0, horizontal=True) == [r["us"] / 1e3 for r in ok]
    assert _bars(ax1, horizontal=True) == [r["peak_mib"] / 1024 for r in ok]
    assert ax0.get_title().startswith("linear_logp, T=8192")
    for name in ("grpo_loss.png", "linear_logp.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_trainer_hf_plot(tmp_path, figures):
    # the committed H100 run (an unavailable row, min / max step times) and the H200 one
    for i, gpu in enumerate(("h100", "h200")):
        payload = json.loads((RESULTS.parent / gpu / "trainer_hf.json").read_text())
        path = tmp_path / f"trainer_hf_{gpu}.png"
        _bench("trainer_hf").plot(path, payload)
        ax0, ax1 = figures[i].axes
        res = payload["results"]
        fastest = res[payload["fastest_baseline"]]
        assert _bars(ax0, horizontal=True) == [r["step_ms"] for r in res.values()]
        assert [t.get_text() for t in ax0.get_yticklabels()] == list(res)
        assert _ref_lines(ax0) == [1.10 * fastest["step_ms"]]
        assert _bars(ax1, horizontal=True) == [r["peak_above_resident_gib"] for r in res.values()]
        assert _ref_lines(ax1) == [fastest["peak_above_resident_gib"]]
        assert ax0.get_title().endswith(f"{payload['model']['seq']} tokens")


def test_grpo_figure_draws_both_configurations(tmp_path, figures):
    """``rl-engine grpo``'s figure: reward per step and the ratio range per configuration."""
    from rl_engine.grpo.plots import grpo_figure

    def steps(lo, hi):
        return [dict(step=s, reward_mean=0.1 * s, ratio_min=lo, ratio_max=hi) for s in (1, 2, 3)]

    report = dict(model="tiny", trainer="hf", dtype="bf16", configurations={
        "rl_engine": {"steps": steps(1.0, 1.0)}, "stock": {"steps": steps(0.5, 2.0)}})  # fmt: skip
    grpo_figure(report, str(tmp_path / "grpo.png"))
    ax1, ax2 = _one(figures, tmp_path / "grpo.png").axes
    assert [ln.get_label() for ln in _data_lines(ax1)] == ["rl_engine", "stock"]
    rewards = [0.1 * s for s in (1, 2, 3)]
    assert [list(ln.get_ydata()) for ln in _data_lines(ax1)] == [rewards, rewards]
    labels = [t.get_text() for t in ax2.get_legend().get_texts()]
    assert labels == ["rl_engine (exactly 1.0 on every token)", "stock (min..max)"]
    assert [list(ln.get_ydata()) for ln in _data_lines(ax2)] == [[1.0] * 3] * 2 + [
        [0.5] * 3, [2.0] * 3]  # fmt: skip


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


def test_rollout_plot_shows_every_timed_generate_and_the_medians(tmp_path, figures):
    """``bench_rollout.py``'s figure from the committed TP 4 result (4 x H200, 3 rounds): per
    configuration and round one marker line whose points are that round's timed generates
    (tokens / s), and the configuration's median (the reported figure) as a reference line."""
    import bench_rollout

    src = RESULTS.parent / "h200" / "session20_gpu" / "rollout_llama8b_width_tp4.json"
    payload = json.loads(src.read_text())
    path = tmp_path / "rollout.png"
    bench_rollout.plot(path, payload)
    (ax,) = _one(figures, path).axes
    runs = payload["runs"]
    want = [
        [
            r["rows"][0]["prompts"] * r["rows"][0]["new_tokens"] / t
            for t in rnd["rows"][0]["all_seconds"]
        ]
        for r in runs.values()
        for rnd in r["rounds"]
    ]
    assert [list(ln.get_ydata()) for ln in _data_lines(ax)] == want
    assert len(want) == 6 and all(len(w) == 2 for w in want)
    assert _ref_lines(ax) == sorted(r["rows"][0]["tokens_per_s"] for r in runs.values())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(runs)
    assert ax.get_title() == "llama8b_width TP 4: 256 prompts (h200)"


def test_poly_norm_plot_and_summary_line(tmp_path, capsys, figures):
    """No committed GPU rows yet: synthetic rows in the benchmark's layout."""
    rows = [
        {"m": m, "h": h, "fused_mul": f, "fwd_bw_frac": 0.5 + 0.01 * i, "bwd_bw_frac": 0.4}
        for i, (m, h, f) in enumerate(
            (m, h, f) for f in (False, True) for m in (1, 1024, 16384) for h in (4096, 14336)
        )
    ]
    path = tmp_path / "poly_norm.png"
    _bench("poly_norm").plot(rows, path)
    _check_bw_panels(_one(figures, path), "poly_norm", rows)
    common = importlib.import_module("common")
    common.finish(tmp_path, "poly_norm_t", {"a": 1}, summary={"x": 0.123456}, rows=rows)
    assert "poly_norm_t summary: x 0.123" in capsys.readouterr().out
    written = json.loads((tmp_path / "poly_norm_t.json").read_text())
    assert written["rows"] == rows
    from rl_engine.run_info import code_hash

    assert written["code_hash"] == code_hash()  # every result names the code it measured


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
