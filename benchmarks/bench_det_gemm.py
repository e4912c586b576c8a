"""Benchmark of ``det_gemm`` (Triton provider) against cuBLAS (``torch.mm``) in the same run.

Usage: ``python benchmarks/bench_det_gemm.py [--out DIR] [--quick] [--sweep]``.

Writes ``DIR/det_gemm.json`` (times, TFLOP/s, GB/s, ratio = cuBLAS time / det_gemm time, so 1.0
means as fast as cuBLAS and lower is slower; two timings of each: ``ratio`` from eager calls
after an L2 flush (``common.bench``), ``graph_ratio`` from CUDA-graph replay over cold operand
copies (``common.bench_graph``), which leaves out the host's launch time) and ``DIR/det_gemm.png`` (ratio per shape and a
roofline against the measured copy bandwidth and peak matmul rate). The weight is used as
``nn.Linear`` stores it (``b = w.t()``). ``--sweep`` also times candidate tile configs per M and
checks that all of them give bitwise-equal outputs (``DIR/det_gemm_sweep.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import GEMM_SHAPES, M_VALUES, ROLLOUT_GEMM_SHAPES  # noqa: E402

from rl_engine.ops.det_gemm import config as gemm_config  # noqa: E402
from rl_engine.ops.det_gemm import triton as gemm_triton  # noqa: E402

C = gemm_config.DetGemmConfig

# Candidate configs per M (the sweep); the table's own config is always added. Each is written as
# the sweep's JSON names it (``_cname``): the kind, block_m x block_n x block_k, ``g`` group_m,
# ``w`` num_warps, ``s`` num_stages. Kinds: ``P`` pointer kernel, ``S`` = split over K chunks (one
# program per tile and chunk + the ordered combine), ``T`` = persistent TMA, ``TS`` = both,
# ``F`` = one flat K loop per program.
_KINDS = {
    "P": {},
    "S": {"split_k": True},
    "T": {"tma": True},
    "TS": {"tma": True, "split_k": True},
    "F": {"flat_k": True},
}
_NAME = re.compile(r"(P|S|TS|T|F)(\d+)x(\d+)x(\d+)g(\d+)w(\d+)s(\d+)")


def _cname(c: C) -> str:
    kind = (
        "TS"
        if c.tma and c.split_k
        else "T"
        if c.tma
        else "S"
        if c.split_k
        else "F"
        if c.flat_k
        else "P"
    )
    return f"{kind}{c.block_m}x{c.block_n}x{c.block_k}g{c.group_m}w{c.num_warps}s{c.num_stages}"


def _configs(*names: str) -> list[C]:
    """The configs of whitespace-separated ``_cname`` names (``S16x32x128g1w2s6``), in order."""
    out = []
    for name in " ".join(names).split():
        kind, *sizes = _NAME.fullmatch(name).groups()
        cfg = C(*map(int, sizes), **_KINDS[kind])
        assert _cname(cfg) == name, name
        out.append(cfg)
    return out


_SWEEP: dict[str, list[C]] = {
    "tiny": _configs(  # M <= 16
        "S16x32x128g1w2s6 S16x64x128g1w4s4 S16x32x256g1w4s4 S16x128x128g1w4s4",
        "S16x16x256g1w2s4 S16x64x256g1w4s3 F16x32x128g1w2s6 F16x64x128g1w4s6",
    ),
    "small": _configs(  # M <= 64
        "S64x64x128g1w4s4 S32x64x128g1w4s4 S64x32x128g1w4s4 S64x128x64g1w4s4 S16x64x128g1w4s4",
        "S64x64x64g1w4s5 F64x32x128g1w4s4 F16x64x128g1w4s6 T64x128x64g1w4s4",
        # narrow output tiles (small N with K in one chunk: programs = N / block_n)
        "S64x32x128g8w4s4 S64x32x256g8w4s3 S64x32x64g8w4s6 S64x16x128g8w4s4 S64x16x256g8w4s3",
        "S32x32x128g8w4s4 S32x16x256g8w2s4 S16x32x128g8w2s6 S16x16x256g8w2s4",
        "F64x32x128g8w4s4 F64x16x128g8w4s4",
    ),
    "mid": _configs(  # M <= 512
        "S64x128x64g8w4s4 S128x128x64g8w8s4 S128x64x64g8w4s4 S64x64x128g8w4s4 S64x256x64g8w8s4",
        "T128x128x64g8w8s4 T64x128x64g8w4s4 T64x256x64g8w8s4",
        "P128x128x64g8w8s4 P64x128x64g8w4s4 T128x256x64g8w8s3 P128x256x64g8w8s3",
        # narrow output tiles: more programs when K is one chunk (no split to lean on)
        "S128x64x64g1w4s4 S128x32x128g1w4s4 S128x64x128g1w8s3 S64x64x128g1w4s4 S64x32x256g1w4s3",
        "S32x128x128g1w4s4 S64x32x128g8w4s4 S128x32x64g8w4s5 S64x64x64g8w4s6 S128x64x64g8w8s4",
        "T128x64x64g8w4s4 T64x64x128g8w4s4",
        # persistent TMA over (K chunk, tile) items: deep K with few rows
        "TS128x128x64g8w8s4 TS64x128x64g8w4s4 TS128x256x64g8w8s3 TS64x64x128g8w4s4",
    ),
    "large": _configs(  # M > 512
        "T128x128x64g8w8s4 T128x128x64g8w8s5 T128x128x64g8w8s3 T128x128x64g16w8s4",
        "T128x128x128g8w8s3 T64x256x64g8w8s4 T128x64x64g8w4s4 P128x128x64g8w8s4",
        "S128x128x64g8w8s4 T128x256x64g8w8s3 T128x256x64g8w8s4",
    ),
}


def _bucket(m: int) -> str:
    return "tiny" if m <= 16 else "small" if m <= 64 else "mid" if m <= 512 else "large"


def gemm_inputs(m: int, k: int, n: int, dtype: torch.dtype = torch.bfloat16):
    """Seeded ``a`` [m, k] and ``b = w.t()`` [k, n] (the weight as ``nn.Linear`` stores it)."""
    g = torch.Generator(device="cuda").manual_seed(m * 7919 + n)
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5
    return a, w.t()


def vs_cublas(a, b, quick: bool, ours: tuple[str, Any], *more: tuple[str, Any]) -> dict:
    """``a @ b`` timed two ways (see ``common``: eager after an L2 flush, CUDA-graph replay over
    cold operand copies) for ``ours`` (``(name, fn)``), cuBLAS (``torch.mm``) and ``more``
    providers: ``<name>_us``, ``cublas_us``, ``ratio`` (cuBLAS / ours), the ``graph_`` three,
    ``<name>_tflop_s`` and ``cublas_tflop_s``; each of ``more`` adds ``<n>_us``, ``<n>_ratio``
    and their ``graph_`` pair (ratios vs cuBLAS too)."""
    name, fn = ours
    t_ours = common.bench(lambda: fn(a, b), quick=quick)
    t_cublas = common.bench(lambda: torch.mm(a, b), quick=quick)
    sets = common.cold_copies([a, b])
    g_ours = common.bench_graph(fn, sets, quick=quick)
    g_cublas = common.bench_graph(torch.mm, sets, quick=quick)
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    row = {
        f"{name}_us": t_ours,
        "cublas_us": t_cublas,
        "ratio": t_cublas / t_ours,
        f"graph_{name}_us": g_ours,
        "graph_cublas_us": g_cublas,
        "graph_ratio": g_cublas / g_ours,
        f"{name}_tflop_s": flops / t_ours / 1e6,
        "cublas_tflop_s": flops / t_cublas / 1e6,
    }
    for n, f in more:
        t, g = (
            common.bench(lambda f=f: f(a, b), quick=quick),
            common.bench_graph(f, sets, quick=quick),
        )
        row.update({f"{n}_us": t, f"{n}_ratio": t_cublas / t, f"graph_{n}_us": g,
                    f"graph_{n}_ratio": g_cublas / g})  # fmt: skip
    return row


def run_bench(args, limits) -> list[dict]:
    rows = []
    ms = (1, 64, 512, 4096) if args.quick else M_VALUES
    for shape in GEMM_SHAPES:
        for m in ms:
            a, b = gemm_inputs(m, shape.k, shape.n)
            out = gemm_triton.det_gemm(a, b)
            ref = torch.mm(a, b)
            rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            r = vs_cublas(a, b, args.quick, ("triton", gemm_triton.det_gemm))
            flops = 2 * m * shape.k * shape.n
            nbytes = 2 * (m * shape.k + shape.k * shape.n + m * shape.n)
            cfg = gemm_config.get_config(m, shape.n, shape.k, torch.bfloat16)
            rows.append(
                {
                    "shape": shape.name,
                    "m": m,
                    "k": shape.k,
                    "n": shape.n,
                    "dtype": "bf16",
                    **r,
                    "triton_gb_s": nbytes / r["triton_us"] / 1e3,
                    "intensity_flop_per_byte": flops / nbytes,
                    "rel_err_vs_cublas": rel,
                    "config": dataclasses.asdict(cfg),
                }
            )
            print(
                f"{shape.name:22s} M={m:5d} triton {r['triton_us']:9.1f} us  cublas "
                f"{r['cublas_us']:9.1f} us  ratio {r['ratio']:.3f}  {r['triton_tflop_s']:.0f} "
                f"TFLOP/s | graph: triton {r['graph_triton_us']:9.1f} us  cublas "
                f"{r['graph_cublas_us']:9.1f} us  ratio {r['graph_ratio']:.3f}",
                flush=True,
            )
            del a, b, out, ref
    return rows


def _sweep_shapes(args):
    return ROLLOUT_GEMM_SHAPES if args.sweep_shapes == "rollout" else GEMM_SHAPES


def run_sweep(args) -> dict:
    """Time candidate configs per (M, shape) and K chunk; check that all configs of one K chunk
    give bitwise-equal outputs. Prints, per K chunk, the geometric mean over the grid of the best
    config per (shape, M) (what a table keyed by shape and M could reach)."""
    results, mismatches = [], []
    ms = [int(x) for x in args.sweep_m.split(",")] if args.sweep_m else M_VALUES
    kcs = [int(x) for x in args.k_chunks.split(",")]
    for kc in kcs:
        for shape in _sweep_shapes(args):
            for m in ms:
                a, b = gemm_inputs(m, shape.k, shape.n)
                table_cfg = gemm_config.get_config(m, shape.n, shape.k, torch.bfloat16)
                cands = [table_cfg] + [c for c in _SWEEP[_bucket(m)] if c != table_cfg]
                sets = common.cold_copies([a, b])
                t_cublas = common.bench_graph(torch.mm, sets, quick=True)
                first = None
                mine = []
                for cfg in cands:
                    key = {"shape": shape.name, "m": m, "k_chunk": kc, "config": _cname(cfg)}
                    try:
                        out = gemm_triton.det_gemm_with_config(a, b, None, cfg, k_chunk=kc)
                    except Exception as exc:  # a config that does not compile: record, go on
                        results.append({**key, "error": f"{type(exc).__name__}: {exc}"[-300:]})
                        continue
                    if first is None:
                        first = out
                    elif not torch.equal(out, first):
                        mismatches.append(key)
                    t = common.bench_graph(
                        lambda a, b, cfg=cfg, kc=kc: gemm_triton.det_gemm_with_config(
                            a, b, None, cfg, k_chunk=kc
                        ),
                        sets,
                        quick=True,
                    )
                    results.append({**key, "us": t, "cublas_us": t_cublas, "ratio": t_cublas / t})
                    mine.append(results[-1])
                if mine:
                    best = max(mine, key=lambda r: r["ratio"])
                    print(
                        f"sweep kc={kc} {shape.name:20s} M={m:5d} best {best['ratio']:.3f} "
                        f"{best['config']}  "
                        + " ".join(f"{r['config']}:{r['ratio']:.2f}" for r in mine),
                        flush=True,
                    )
                del a, b, sets
        bests = []
        for shape in _sweep_shapes(args):
            for m in ms:
                rs = [
                    r["ratio"]
                    for r in results
                    if r["k_chunk"] == kc
                    and r["shape"] == shape.name
                    and r["m"] == m
                    and "ratio" in r
                ]
                if rs:
                    bests.append(max(rs))
        print(
            f"sweep kc={kc}: best-per-case geomean {common.geomean(bests):.3f} "
            f"min {min(bests):.3f}",
            flush=True,
        )
    print(f"sweep: {len(mismatches)} bitwise mismatches between configs")
    return {"results": results, "mismatches": mismatches}


def plot(rows: list[dict], limits: dict, path: Path) -> None:
    def draw(axes):
        ax1, ax2 = axes
        for shape in GEMM_SHAPES:
            rs = [r for r in rows if r["shape"] == shape.name]
            ax1.plot([r["m"] for r in rs], [r["ratio"] for r in rs], "o-", label=shape.name)
            ax2.loglog(
                [r["intensity_flop_per_byte"] for r in rs],
                [r["triton_tflop_s"] for r in rs],
                "o",
                label=f"det_gemm {shape.name}",
            )
            ax2.loglog(
                [r["intensity_flop_per_byte"] for r in rs],
                [r["cublas_tflop_s"] for r in rs],
                "x",
                alpha=0.6,
            )
        ax1.set_xscale("log", base=2)
        ax1.axhline(1.0, color="k", lw=0.8)
        ax1.axhline(0.9, color="g", ls="--", lw=0.8)
        ax1.set_xlabel("M (tokens)")
        ax1.set_ylabel("cuBLAS time / det_gemm time")
        ax1.set_title("det_gemm (triton, bf16) vs cuBLAS")
        ax1.legend(fontsize=7)
        xs = [0.5, 1e4]
        peak, bw = limits["bf16_mm_tflop_s"], limits["copy_tb_s"]
        ax2.loglog(xs, [min(peak, x * bw) for x in xs], "k-", lw=0.8)
        ridge = peak / bw
        ax2.loglog([0.5, ridge, 1e4], [0.5 * bw, peak, peak], "k-", lw=1, label="measured roofline")
        ax2.set_xlabel("FLOP / byte")
        ax2.set_ylabel("TFLOP/s (o det_gemm, x cuBLAS)")
        ax2.set_title("roofline")
        ax2.legend(fontsize=6)

    common.save_figure(path, draw, ncols=2, figsize=(13, 5))


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", action="store_true", help="tile-config sweep too")
    p.add_argument("--k-chunks", default=str(gemm_config.K_CHUNK), help="sweep K chunks")
    p.add_argument("--sweep-only", action="store_true", help="no benchmark after it")
    p.add_argument("--sweep-m", default="", help="sweep these M only (comma list)")
    p.add_argument(
        "--sweep-shapes",
        choices=("acceptance", "rollout"),
        default="acceptance",
        help="sweep the acceptance grid (8B projections, LM head) or the rollout "
        "benchmark's ~1B Qwen2 projections",
    )


@common.gpu_main(__doc__, "bench_det_gemm", _extra)
def main(args: argparse.Namespace, limits: dict[str, float]) -> None:
    if args.sweep:
        sweep = run_sweep(args)
        common.write_json(args.out, "det_gemm_sweep", sweep)
        if args.sweep_only:
            return
    rows = run_bench(args, limits)
    ratios = [r["ratio"] for r in rows]
    g_ratios = [r["graph_ratio"] for r in rows]
    g_min = min(rows, key=lambda r: r["graph_ratio"])
    summary = {
        "geomean_ratio": common.geomean(ratios),
        "min_ratio": min(ratios),
        "min_case": min(rows, key=lambda r: r["ratio"])["shape"]
        + f" M={min(rows, key=lambda r: r['ratio'])['m']}",
        "graph_geomean_ratio": common.geomean(g_ratios),
        "graph_min_ratio": g_min["graph_ratio"],
        "graph_min_case": f"{g_min['shape']} M={g_min['m']}",
    }
    common.write_json(
        args.out,
        "det_gemm",
        {
            "provider": "triton",
            "baseline": "cuBLAS (torch.mm)",
            "ratio_definition": "cublas_us / triton_us (higher is better, 1.0 = parity); "
            "ratio: eager calls after an L2 flush (triton.testing.do_bench, host launch time "
            "included where it exceeds the flush); graph_ratio: CUDA-graph replay over cold "
            "operand copies (GPU time only), both sides the same way",
            "limits": limits,
            "summary": summary,
            "rows": rows,
        },
    )
    plot(rows, limits, args.out / "det_gemm.png")
    print(
        f"det_gemm bf16: geomean ratio vs cuBLAS {summary['geomean_ratio']:.3f}, "
        f"min {summary['min_ratio']:.3f} ({summary['min_case']}); CUDA graph: geomean "
        f"{summary['graph_geomean_ratio']:.3f}, min {summary['graph_min_ratio']:.3f} "
        f"({summary['graph_min_case']})"
    )


if __name__ == "__main__":
    main()
