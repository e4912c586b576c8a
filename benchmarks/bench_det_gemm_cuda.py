"""Benchmark of ``det_gemm``'s ``cuda`` provider (SM90, CUDA C++) against cuBLAS in the same run.

Usage: ``python benchmarks/bench_det_gemm_cuda.py [--out DIR] [--quick] [--triton]``.

Shapes: ``shapes.CSRC_GEMM_SHAPES`` (the Llama-3-8B projections as vLLM fuses them and a
151,936-vocab LM head) x ``shapes.M_VALUES`` (1..8192 rows), bf16, the weight used as
``nn.Linear`` stores it (``b = w.t()``). Two timings of each (see ``common``): ``ratio`` from
eager calls after an L2 flush, ``graph_ratio`` from CUDA-graph replay over cold operand copies;
ratio = cuBLAS (``torch.mm``) time / our time, so 1.0 is as fast as cuBLAS, lower is slower.
``--triton`` also times the Triton provider (its ratios vs cuBLAS, same method). ``--configs``
also times every tile configuration of ``config.CUDA_CONFIGS`` (``cfg_<name>_ratio`` and its
``graph_`` pair per row, ``best_config`` / ``graph_best_config``: the data the launch choice is
fitted from, by ``fit_cuda_configs.py``; every configuration gives the same bits, so the choice
is speed only). Each case is first checked against cuBLAS (relative Frobenius error) and for row
invariance (row 0 alone == row 0 of the batch, bitwise). Writes ``DIR/det_gemm_cuda.json`` and
prints a table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from bench_det_gemm import gemm_inputs, vs_cublas  # noqa: E402
from shapes import CSRC_GEMM_SHAPES, M_VALUES  # noqa: E402

from rl_engine.ops.det_gemm import config as gemm_config  # noqa: E402
from rl_engine.ops.det_gemm import cuda as gemm_cuda  # noqa: E402

OP = "det_gemm_cuda"


def _extra(p) -> None:
    p.add_argument("--triton", action="store_true", help="also time the Triton provider")
    p.add_argument("--configs", action="store_true", help="also time every tile configuration")


def _with_config(name: str):
    def run(a, b):
        return gemm_cuda.det_gemm_with_config(a, b, None, name)

    return run


def run(args) -> list[dict]:
    ours = gemm_cuda.det_gemm
    more = []
    if args.triton:
        from rl_engine.ops.det_gemm import triton as gemm_triton

        more.append(("triton", gemm_triton.det_gemm))
    if args.configs:
        more += [(f"cfg_{name}", _with_config(name)) for name in gemm_config.CUDA_CONFIGS]
    rows = []
    ms = (1, 64, 256, 4096) if args.quick else M_VALUES
    for shape in CSRC_GEMM_SHAPES:
        for m in ms:
            a, b = gemm_inputs(m, shape.k, shape.n)
            out = ours(a, b)
            ref = torch.mm(a, b)
            rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            row0 = bool(torch.equal(ours(a[:1], b), out[:1]))
            row = {
                "shape": shape.name,
                "m": m,
                "k": shape.k,
                "n": shape.n,
                "config": gemm_config.get_cuda_config(m, shape.n, shape.k, gemm_cuda._sm_count(a)),
                "rel_err_vs_cublas": rel,
                "row0_alone_bitwise": row0,
                **vs_cublas(a, b, args.quick, ("cuda", ours), *more),
            }
            if args.configs:
                for key in ("", "graph_"):
                    times = {c: row[f"{key}cfg_{c}_us"] for c in gemm_config.CUDA_CONFIGS}
                    row[f"{key}best_config"] = min(times, key=times.get)
            rows.append(row)
            common.progress(
                row,
                "{shape:24s} M={m:5d} cfg={config:5s} cuda {cuda_us:9.1f} us cuBLAS "
                "{cublas_us:9.1f} us ratio {ratio:.3f} graph {graph_ratio:.3f} rel {rel:.1e} "
                "row0 {row0_alone_bitwise}",
                rel=rel,
            )
    return rows


def summarize(rows: list[dict]) -> dict:
    out = {}
    for key in ("ratio", "graph_ratio", "triton_ratio", "graph_triton_ratio"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[f"{key}_geomean"] = common.geomean(vals)
            out[f"{key}_worst"] = min(vals)
    out["max_rel_err_vs_cublas"] = max(r["rel_err_vs_cublas"] for r in rows)
    out["row0_alone_bitwise_all"] = all(r["row0_alone_bitwise"] for r in rows)
    return out


def main() -> None:
    args = common.cuda_args(__doc__, f"{OP}: no CUDA device; nothing to measure", _extra)
    if args is None:
        return
    reason = gemm_cuda.PROVIDER.why_not("cuda", triton_interpret=False)
    if reason is not None:
        raise SystemExit(f"{OP}: the cuda provider cannot run: {reason}")
    rows = run(args)
    summary = summarize(rows)
    cols = ["shape", "m", "config", "cuda_us", "cublas_us", "ratio", "graph_ratio"]
    if args.triton:
        cols += ["triton_ratio", "graph_triton_ratio"]
    if args.configs:
        cols += [f"graph_cfg_{c}_ratio" for c in gemm_config.CUDA_CONFIGS] + ["graph_best_config"]
    common.print_table(rows, cols)
    common.finish(
        args.out,
        OP,
        {
            "provider": "cuda",
            "numerics": gemm_cuda.PROVIDER.numerics,
            "library": gemm_cuda.library_info(),
            "baseline": "cublas (torch.mm)",
            "ratio_definition": "cublas_us / cuda_us (higher is better)",
        },
        summary=summary,
        rows=rows,
    )


if __name__ == "__main__":
    main()
