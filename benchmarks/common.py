"""Helpers shared by the benchmark scripts: timing, device info, physical limits, JSON + PNG.

Every script writes ``<out>/<op>.json`` (device, versions, date, every figure, ratios against the
baseline measured in the same run) and, when matplotlib is importable, ``<out>/<op>.png``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

LIMITS_FILE = "limits.json"


def gpu_slug() -> str:
    """Short folder name of the GPU (``h100``, ``h200``, ...), ``cpu`` without one."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "a100", "b200", "l40s", "mi300"):
        if key in name:
            return key
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def default_out_dir() -> Path:
    return Path(__file__).resolve().parent / "results" / gpu_slug()


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=None, help="output folder (default results/<gpu>)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    if extra is not None:
        extra(p)
    args = p.parse_args()
    args.out = Path(args.out) if args.out is not None else default_out_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def device_info() -> dict[str, Any]:
    """Date, the package's code hash (``scripts/status.py`` compares it with the code now),
    versions and the device of a result."""
    from rl_engine.run_info import code_hash

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "code_hash": code_hash(),
        "host_python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(),
            gpu=gpu_slug(),
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        )
    else:
        info.update(device="cpu", gpu="cpu")
    return info


def bench(fn: Callable[[], Any], *, quick: bool = False) -> float:
    """Median time of ``fn`` in microseconds (``triton.testing.do_bench``: warm-up, L2 flush
    before each call, CUDA events), over at least 5 timed calls (``quick``: 3).

    ``do_bench`` times as many calls as fit in its ``rep`` budget (25 / 100 ms), at least one: a
    70-ms call (an LM head's forward + backward) got a single timed call and its median was that
    call. The budget now grows to fit the minimum count (from one timed call first)."""
    from triton.testing import do_bench

    warmup, rep = (10, 30) if quick else (25, 100)
    min_calls = 3 if quick else 5
    est_ms = one_call_ms(fn)
    rep = max(rep, min_calls * est_ms * 1.2)
    warmup = max(warmup, est_ms * 1.2)
    return 1e3 * do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def one_call_ms(fn: Callable[[], Any]) -> float:
    """One call of ``fn``, timed with CUDA events (after a synchronize)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def cold_copies(tensors: Sequence[torch.Tensor], *, max_sets: int = 16) -> list[tuple]:
    """Enough copies of ``tensors`` that cycling through them keeps every call's operands out of
    L2: the copies together span >= 4x the L2 size (at most ``max_sets`` sets; the originals are
    the first set)."""
    per_set = sum(t.numel() * t.element_size() for t in tensors)
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    n = max(1, min(max_sets, math.ceil(4 * l2 / max(per_set, 1))))
    return [tuple(tensors)] + [tuple(t.clone() for t in tensors) for _ in range(n - 1)]


def bench_graph(fn: Callable[..., Any], sets: Sequence[tuple], *, quick: bool = False) -> float:
    """Median GPU time per call of ``fn(*set)`` in microseconds, replayed from one CUDA graph
    that calls it once per set of ``sets`` (see :func:`cold_copies`; at least 8 calls).

    What this takes out that :func:`bench` keeps: the host's launch time. ``bench`` starts its
    clock before ``fn`` runs on the host, so a call whose Python launch path is longer than the
    L2 flush in front of it is timed partly on the CPU (tens of microseconds for a Triton launch;
    the size of a whole small GEMM). Under a graph the kernels run back to back, as vLLM's
    decode runs them. Same method for every baseline.
    """
    for st in sets[:2]:
        fn(*st)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    calls = max(8, len(sets))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5 if quick else 15):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    times.sort()
    return times[len(times) // 2]


def peak_mib(fn: Callable[[], Any]) -> float:
    """Peak memory (MiB) that one call allocates above what is live before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def geomean(values: Sequence[float]) -> float:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def measure_limits(quick: bool = False) -> dict[str, float]:
    """Measured ceilings: device copy bandwidth (bytes read + written) and peak bf16 matmul."""
    n = 1 << 28  # 512 MiB of bf16 per side
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src), quick=quick)
    copy_tbs = 2 * src.numel() * src.element_size() / (t_copy * 1e-6) / 1e12
    s = 8192
    a = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    t_mm = bench(lambda: torch.mm(a, b), quick=quick)
    mm_tflops = 2 * s**3 / (t_mm * 1e-6) / 1e12
    return {
        "copy_tb_s": copy_tbs,
        "copy_us_512mib": t_copy,
        "bf16_mm_tflop_s": mm_tflops,
        "bf16_mm_8192_us": t_mm,
    }


def load_or_measure_limits(out_dir: Path, quick: bool = False) -> dict[str, float]:
    path = Path(out_dir) / LIMITS_FILE
    if path.exists():
        try:
            return json.loads(path.read_text())["limits"]
        except Exception:
            pass
    limits = measure_limits(quick=quick)
    write_json(out_dir, "limits", {"limits": limits})
    return limits


def write_json(out_dir: Path, op: str, payload: dict[str, Any]) -> Path:
    payload = {"op": op, **device_info(), **payload}
    path = Path(out_dir) / f"{op}.json"
    path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    print(f"wrote {path}")
    return path


def have_matplotlib() -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        return True
    except Exception as exc:
        print(f"matplotlib is not importable ({exc}); skipping the PNG")
        return False


def save_figure(path: Path, draw: Callable[[Any], None], *, ncols: int = 1,
                figsize: tuple[float, float] = (6, 4.5), dpi: int = 110) -> None:  # fmt: skip
    """A one-row figure of ``ncols`` axes drawn by ``draw(axes)`` (one axis when ``ncols`` is 1),
    saved as ``path``; without matplotlib a line says so and nothing is written."""
    if not have_matplotlib():
        return
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    try:
        draw(axes)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    print(f"wrote {path}")


def bw_lines(ax: Any, rows: Sequence[dict[str, Any]], *, group: Callable[[dict], Any],
             label: Callable[[Any], str], x: str, y: str, title: str, xlabel: str = "rows",
             target: float | None = None) -> None:  # fmt: skip
    """One line per ``group(row)`` value: ``row[y]`` (a fraction of the measured copy bandwidth)
    over ``row[x]`` on a log2 axis, the copy line at 1 and an optional dashed ``target``."""
    for g in sorted({group(r) for r in rows}):
        rs = sorted((r for r in rows if group(r) == g), key=lambda r: r[x])
        ax.plot([r[x] for r in rs], [r[y] for r in rs], "o-", label=label(g))
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="k", lw=0.8)
    if target is not None:
        ax.axhline(target, color="g", ls="--", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of measured copy bandwidth")
    ax.set_title(title)
    ax.legend(fontsize=7)


def bw_panels(path: Path, panels: Sequence[tuple[Sequence[dict[str, Any]], str, str]], *,
              group: str, x: str = "m", target: Callable[[str], float | None] | None = None,
              xlabel: str = "rows") -> None:  # fmt: skip
    """One :func:`bw_lines` panel per ``(rows, key, title)``: ``row[f"{key}_bw_frac"]`` over
    ``row[x]``, a line per ``row[group]`` value (labelled ``f"{group.upper()}={value}"``),
    ``target(key)`` dashed where given; saved as ``path``."""

    def draw(axes):
        for ax, (rows, key, title) in zip(axes if len(panels) > 1 else [axes], panels):
            bw_lines(ax, rows, group=lambda r: r[group], label=lambda v: f"{group.upper()}={v}",
                     x=x, y=f"{key}_bw_frac", title=title, xlabel=xlabel,
                     target=target(key) if target else None)  # fmt: skip

    save_figure(path, draw, ncols=len(panels), figsize=(5 * len(panels) + 1, 4.5))


def geomeans(rows: Sequence[dict[str, Any]], **keys: str) -> dict[str, float]:
    """``{name: geomean of row[key] over rows}`` for each ``name=key``."""
    return {name: geomean([r[key] for r in rows]) for name, key in keys.items()}


def bw_frac(nbytes: float, us: float, copy_tb_s: float) -> float:
    """``nbytes`` moved in ``us`` microseconds, as a fraction of the measured copy bandwidth."""
    return nbytes / (us * 1e-6) / 1e12 / copy_tb_s


def vs_baseline(row: dict[str, Any], t: dict[str, float], nbytes: dict[str, float],
                copy_tb_s: float, keys: Sequence[str], baseline: str = "stock") -> None:  # fmt: skip
    """For each ``k`` of ``keys``: ``row[f"{k}_bw_frac"]`` (:func:`bw_frac` of ``nbytes[k]`` in
    ``t[k]``) and ``row[f"{k}_ratio_vs_{baseline}"]`` = ``t[f"{baseline}_{k}"] / t[k]`` (higher:
    faster than the baseline)."""
    for k in keys:
        row[f"{k}_bw_frac"] = bw_frac(nbytes[k], t[k], copy_tb_s)
        row[f"{k}_ratio_vs_{baseline}"] = t[f"{baseline}_{k}"] / t[k]


def ratio_geomeans(rows: Sequence[dict[str, Any]], keys: Sequence[str],
                   baseline: str = "stock") -> dict[str, float]:  # fmt: skip
    """``geomean_{k}_vs_{baseline}``: the geomean of the :func:`vs_baseline` ratio of each ``k``
    of ``keys`` over ``rows``."""
    names = {f"geomean_{k}_vs_{baseline}": f"{k}_ratio_vs_{baseline}" for k in keys}
    return geomeans(rows, **names)


def ratio_definition(baseline: str) -> str:
    """The JSON's ``ratio_definition`` of :func:`vs_baseline`'s ratios."""
    return f"{baseline}_us / triton_us (higher is better)"


def progress(row: dict[str, Any], line: str, **extra: Any) -> dict[str, Any]:
    """Print a measured case's progress line, ``line.format(**row, **extra)`` (flushed, so a
    long sweep shows where it is), and return ``row``."""
    print(line.format(**row, **extra), flush=True)
    return row


def finish_op(args: argparse.Namespace, limits: dict[str, float], op: str, *, baseline: str,
              ratio: str, bw: str, summary: dict[str, Any], rows: list[dict],
              plot: Callable[[list[dict], Path], None] | None, digits: int | None = 3,
              provider: str = "triton", **extra: Any) -> Path:  # fmt: skip
    """:func:`finish` of a Triton op's benchmark: the provider, the baseline it is measured
    against and how the ratio and bandwidth columns are defined (``extra``: more fields), the
    measured limits last."""
    fields = {"provider": provider, "baseline": baseline, "ratio_definition": ratio,
              "bw_frac_definition": bw, **extra, "limits": limits}  # fmt: skip
    return finish(args.out, op, fields, summary=summary, rows=rows, plot=plot, digits=digits)


def print_table(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "" if v is None else str(v)


def finish(
    out_dir: Path,
    op: str,
    fields: dict[str, Any],
    *,
    summary: dict[str, Any],
    rows: list[dict],
    plot: Callable[[list[dict], Path], None] | None = None,
    digits: int | None = 3,
) -> Path:
    """A benchmark's last step: ``<out>/<op>.json`` (``fields``, the summary and the rows, with
    the device and versions), ``plot(rows, <out>/<op>.png)`` when given, and the one-line
    summary (numbers to ``digits`` places; ``None``: as they are)."""
    path = write_json(out_dir, op, {**fields, "summary": summary, "rows": rows})
    if plot is not None:
        plot(rows, Path(out_dir) / f"{op}.png")

    def fmt(v: Any) -> str:
        return f"{v:.{digits}f}" if digits is not None and isinstance(v, float) else f"{v}"

    print(f"{op} summary: " + ", ".join(f"{k} {fmt(v)}" for k, v in summary.items()))
    return path


def cuda_args(
    doc: str, no_cuda: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace | None:
    """A GPU script's arguments (described by the first line of ``doc``; ``extra`` adds its own,
    as in :func:`parse_args`); ``None`` after printing the line ``no_cuda`` without a CUDA
    device."""
    args = parse_args(doc.splitlines()[0], extra)
    if not torch.cuda.is_available():
        print(no_cuda)
        return None
    return args


def start(
    doc: str, name: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> tuple[argparse.Namespace, dict[str, float]] | None:
    """A GPU benchmark's first step: its arguments (described by the first line of ``doc``;
    ``extra`` adds its own, as in :func:`parse_args`) and the device's measured limits; ``None``
    (said once) without a CUDA device."""
    args = cuda_args(doc, f"{name}: no CUDA device; nothing to measure", extra)
    if args is None:
        return None
    return args, load_or_measure_limits(args.out, quick=args.quick)


def gpu_main(
    doc: str, name: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> Callable[[Callable[[argparse.Namespace, dict[str, float]], None]], Callable[[], None]]:
    """Decorator: a GPU benchmark's ``body(args, limits)`` as its no-argument ``main``, which
    :func:`start`s first (``doc``, ``name``, ``extra`` as there) and runs nothing more without
    a CUDA device."""

    def wrap(body: Callable[[argparse.Namespace, dict[str, float]], None]) -> Callable[[], None]:
        def main() -> None:
            started = start(doc, name, extra)
            if started is not None:
                body(*started)

        main.__doc__ = body.__doc__
        return main

    return wrap


def op_main(
    doc: str,
    name: str,
    op: str,
    run: Callable[[argparse.Namespace, float], list[dict]],
    summarize: Callable[..., dict[str, Any]],
    *,
    more: Callable[[argparse.Namespace], dict[str, list[dict]]] | None = None,
    **fields: Any,
) -> None:
    """A Triton op benchmark's whole ``main``: :func:`start` (nothing more without a CUDA
    device), ``rows = run(args, copy_tb_s)``, then ``more(args)`` where given (further rows
    measured apart, by field name: rope's ``qk_rows``), and :func:`finish_op` of ``op`` with
    ``summarize(rows, **more)`` as the summary and ``fields`` (``baseline``, ``ratio``, ``bw``,
    ``plot``, ``digits``, ... as :func:`finish_op` takes them) followed by ``more``'s fields."""

    @gpu_main(doc, name)
    def main(args: argparse.Namespace, limits: dict[str, float]) -> None:
        rows = run(args, limits["copy_tb_s"])
        measured = more(args) if more is not None else {}
        summary = summarize(rows, **measured)
        finish_op(args, limits, op, summary=summary, rows=rows, **fields, **measured)

    main()
