"""Benchmark of ``det_gemm`` (Triton provider) against cuBLAS (``torch.mm``) in the same run.

Usage: ``python benchmarks/bench_det_gemm.py [--out DIR] [--quick] [--sweep]``.

Writes ``DIR/det_gemm.json`` (times, TFLOP/s, GB/s, ratio = cuBLAS time / det_gemm time, so 1.0
means as fast as cuBLAS and lower is slower) and ``DIR/det_gemm.png`` (ratio per shape and a
roofline against the measured copy bandwidth and peak matmul rate). The weight is used as
``nn.Linear`` stores it (``b = w.t()``). ``--sweep`` also times candidate tile configs per M and
checks that all of them give bitwise-equal outputs (``DIR/det_gemm_sweep.json``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import GEMM_SHAPES, M_VALUES  # noqa: E402

from rl_engine.ops.det_gemm import config as gemm_config  # noqa: E402
from rl_engine.ops.det_gemm import triton as gemm_triton  # noqa: E402

C = gemm_config.DetGemmConfig

# Candidate configs per M (the sweep); the table's own config is always added.
_SWEEP: dict[str, list[C]] = {
    "tiny": [  # M <= 16
        C(16, 32, 128, 1, 4, 4),
        C(16, 64, 128, 1, 4, 4),
        C(16, 64, 256, 1, 4, 3),
        C(16, 128, 128, 1, 4, 4),
        C(16, 32, 256, 1, 4, 4),
        C(64, 64, 128, 1, 4, 4),
        C(16, 16, 256, 1, 2, 4),
        C(16, 32, 128, 1, 2, 6),
        C(16, 64, 128, 1, 4, 6),
        C(64, 64, 128, 1, 4, 4, True),
    ],
    "small": [  # M <= 64
        C(32, 64, 128, 1, 4, 4),
        C(64, 64, 128, 1, 4, 4),
        C(64, 128, 64, 1, 4, 4),
        C(64, 32, 128, 1, 4, 4),
        C(64, 64, 64, 1, 4, 5),
        C(64, 64, 128, 1, 4, 4, True),
        C(64, 128, 64, 1, 4, 4, True),
        C(64, 32, 256, 1, 4, 3),
    ],
    "mid": [  # M <= 512
        C(64, 128, 64, 8, 4, 4),
        C(128, 128, 64, 8, 8, 4),
        C(128, 128, 64, 8, 4, 4),
        C(64, 64, 128, 8, 4, 4),
        C(128, 64, 64, 8, 4, 4),
        C(128, 256, 64, 8, 8, 3),
        C(64, 256, 64, 8, 4, 4),
        C(128, 128, 64, 8, 8, 4, True),
        C(128, 128, 64, 8, 4, 4, True),
        C(64, 128, 64, 8, 4, 4, True),
        C(128, 256, 64, 8, 8, 3, True),
        C(64, 64, 128, 8, 4, 4, True),
    ],
    "large": [  # M > 512
        C(128, 256, 64, 8, 8, 3),
        C(128, 256, 64, 8, 8, 4),
        C(128, 128, 64, 8, 8, 4),
        C(128, 128, 64, 8, 4, 4),
        C(256, 128, 64, 8, 8, 3),
        C(128, 256, 64, 16, 8, 3),
        C(128, 256, 64, 8, 8, 3, True),
        C(128, 256, 64, 8, 8, 4, True),
        C(256, 128, 64, 8, 8, 3, True),
        C(128, 128, 64, 8, 4, 4, True),
        C(128, 128, 64, 8, 8, 4, True),
        C(128, 256, 64, 8, 8, 5, True),
    ],
}


def _bucket(m: int) -> str:
    return "tiny" if m <= 16 else "small" if m <= 64 else "mid" if m <= 512 else "large"


def _inputs(m: int, k: int, n: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(m * 7919 + n)
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5
    return a, w.t()


def run_bench(args, limits) -> list[dict]:
    rows = []
    ms = (1, 64, 512, 4096) if args.quick else M_VALUES
    for shape in GEMM_SHAPES:
        for m in ms:
            a, b = _inputs(m, shape.k, shape.n, torch.bfloat16)
            out = gemm_triton.det_gemm(a, b)
            ref = torch.mm(a, b)
            rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t_ours = common.bench(lambda a=a, b=b: gemm_triton.det_gemm(a, b), quick=args.quick)
            t_cublas = common.bench(lambda a=a, b=b: torch.mm(a, b), quick=args.quick)
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
                    "triton_us": t_ours,
                    "cublas_us": t_cublas,
                    "ratio": t_cublas / t_ours,
                    "triton_tflop_s": flops / t_ours / 1e6,
                    "cublas_tflop_s": flops / t_cublas / 1e6,
                    "triton_gb_s": nbytes / t_ours / 1e3,
                    "intensity_flop_per_byte": flops / nbytes,
                    "rel_err_vs_cublas": rel,
                    "config": dataclasses.asdict(cfg),
                }
            )
            r = rows[-1]
            print(
                f"{shape.name:22s} M={m:5d} triton {t_ours:9.1f} us  cublas {t_cublas:9.1f} us  "
                f"ratio {r['ratio']:.3f}  {r['triton_tflop_s']:.0f} TFLOP/s",
                flush=True,
            )
            del a, b, out, ref
    return rows


def run_sweep(args) -> dict:
    """Time candidate configs per (M, shape); check all give bitwise-equal outputs."""
    results, mismatches = [], []
    ms = M_VALUES
    for shape in GEMM_SHAPES:
        for m in ms:
            a, b = _inputs(m, shape.k, shape.n, torch.bfloat16)
            table_cfg = gemm_config.get_config(m, shape.n, shape.k, torch.bfloat16)
            cands = [table_cfg] + [c for c in _SWEEP[_bucket(m)] if c != table_cfg]
            t_cublas = common.bench(lambda a=a, b=b: torch.mm(a, b), quick=True)
            first = None
            for cfg in cands:
                try:
                    out = gemm_triton.det_gemm_with_config(a, b, None, cfg)
                except Exception as exc:  # a config that does not compile: record, go on
                    results.append(
                        {
                            "shape": shape.name,
                            "m": m,
                            "config": dataclasses.asdict(cfg),
                            "error": f"{type(exc).__name__}: {exc}"[:300],
                        }
                    )
                    continue
                if first is None:
                    first = out
                elif not torch.equal(out, first):
                    mismatches.append(
                        {"shape": shape.name, "m": m, "config": dataclasses.asdict(cfg)}
                    )
                t = common.bench(
                    lambda a=a, b=b, cfg=cfg: gemm_triton.det_gemm_with_config(a, b, None, cfg),
                    quick=True,
                )
                results.append(
                    {
                        "shape": shape.name,
                        "m": m,
                        "config": dataclasses.asdict(cfg),
                        "us": t,
                        "cublas_us": t_cublas,
                        "ratio": t_cublas / t,
                    }
                )
            best = max(
                (
                    r
                    for r in results
                    if r.get("m") == m and r["shape"] == shape.name and "ratio" in r
                ),
                key=lambda r: r["ratio"],
            )
            print(
                f"sweep {shape.name:22s} M={m:5d} best {best['ratio']:.3f} {best['config']}",
                flush=True,
            )
            del a, b
    # Per M: the config with the best geometric-mean ratio over the shapes.
    per_m = {}
    for m in ms:
        by_cfg: dict[str, list[float]] = {}
        for r in results:
            if r.get("m") == m and "ratio" in r:
                by_cfg.setdefault(str(r["config"]), []).append(r["ratio"])
        full = {c: v for c, v in by_cfg.items() if len(v) == len(GEMM_SHAPES)}
        if full:
            c, v = max(full.items(), key=lambda kv: common.geomean(kv[1]))
            per_m[m] = {"config": c, "geomean_ratio": common.geomean(v), "ratios": v}
            print(f"sweep best for M={m}: geomean {common.geomean(v):.3f} {c} {v}")
    print(f"sweep: {len(mismatches)} bitwise mismatches between configs")
    return {"results": results, "best_per_m": per_m, "mismatches": mismatches}


def plot(rows: list[dict], limits: dict, path: Path) -> None:
    if not common.have_matplotlib():
        return
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    args = common.parse_args(
        __doc__.splitlines()[0],
        lambda p: p.add_argument("--sweep", action="store_true", help="tile-config sweep too"),
    )
    if not torch.cuda.is_available():
        print("bench_det_gemm: no CUDA device; nothing to measure")
        return
    limits = common.load_or_measure_limits(args.out, quick=args.quick)
    if args.sweep:
        sweep = run_sweep(args)
        common.write_json(args.out, "det_gemm_sweep", sweep)
    rows = run_bench(args, limits)
    ratios = [r["ratio"] for r in rows]
    summary = {
        "geomean_ratio": common.geomean(ratios),
        "min_ratio": min(ratios),
        "min_case": min(rows, key=lambda r: r["ratio"])["shape"]
        + f" M={min(rows, key=lambda r: r['ratio'])['m']}",
    }
    common.write_json(
        args.out,
        "det_gemm",
        {
            "provider": "triton",
            "baseline": "cuBLAS (torch.mm)",
            "ratio_definition": "cublas_us / triton_us (higher is better, 1.0 = parity)",
            "limits": limits,
            "summary": summary,
            "rows": rows,
        },
    )
    plot(rows, limits, args.out / "det_gemm.png")
    print(
        f"det_gemm bf16: geomean ratio vs cuBLAS {summary['geomean_ratio']:.3f}, "
        f"min {summary['min_ratio']:.3f} ({summary['min_case']})"
    )


if __name__ == "__main__":
    main()
