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
is speed only). ``--split-k 2,4,8`` also times each split-K count S (forced: the provider's split
table is off) on the rows with M <= ``--split-k-max-m`` (256) whose K cuts into S slices of whole
64-blocks: ``splitk_<S>_ratio`` and its ``graph_`` pair, ``splitk_<S>_config`` (the tile config
it ran), ``splitk_<S>_rel_err_vs_cublas`` and ``splitk_<S>_row0_alone_bitwise`` (row 0 alone ==
row 0 of the batch, at that S), ``graph_best_split`` (the fastest S, 1 = unsplit, per row), and
per S in the summary the geomean / worst ratios. Each case is first checked against cuBLAS
(relative Frobenius error) and for row invariance (row 0 alone == row 0 of the batch, bitwise).
Writes ``DIR/det_gemm_cuda.json`` and prints a table.
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
    p.add_argument(
        "--split-k",
        type=_split_counts,
        default=(),
        metavar="S,S,...",
        help="also time these split-K counts (forced) on the rows with M <= --split-k-max-m",
    )
    p.add_argument("--split-k-max-m", type=int, default=256, help="row limit of --split-k")


def _split_counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(v) for v in text.split(",") if v.strip())
    if not counts or any(s < 2 for s in counts):
        raise ValueError(f"--split-k {text!r}: a comma list of counts >= 2")
    return counts


def _with_config(name: str):
    def run(a, b):
        return gemm_cuda.det_gemm_with_config(a, b, None, name)

    return run


def _with_split(s: int):
    def run(a, b):
        return gemm_cuda.det_gemm_with_config(a, b, None, None, split_k=s)

    return run


def _splits_for(args, m: int, k: int) -> list[int]:
    """The forced split counts of a row: M <= --split-k-max-m and K a multiple of 64 * S."""
    if m > args.split_k_max_m:
        return []
    return [s for s in args.split_k if k % (gemm_config.CUDA_SPLIT_K_BLOCK * s) == 0]


def _split_checks(a, b, ref, splits: list[int], sms: int) -> dict:
    """Per S: the tile config it runs, the error vs cuBLAS, row 0 alone == row 0 in the batch."""
    row = {}
    for s in splits:
        fn = _with_split(s)
        out = fn(a, b)
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        m, k = a.shape
        row[f"splitk_{s}_config"] = gemm_config.get_cuda_config(m, b.shape[1], k, sms, splits=s)
        row[f"splitk_{s}_rel_err_vs_cublas"] = rel
        row[f"splitk_{s}_row0_alone_bitwise"] = bool(torch.equal(fn(a[:1], b), out[:1]))
    return row


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
            splits = _splits_for(args, m, shape.k)
            sms = gemm_cuda._sm_count(a)
            row = {
                "shape": shape.name,
                "m": m,
                "k": shape.k,
                "n": shape.n,
                "config": gemm_config.get_cuda_config(m, shape.n, shape.k, sms),
                "rel_err_vs_cublas": rel,
                "row0_alone_bitwise": row0,
                **_split_checks(a, b, ref, splits, sms),
                **vs_cublas(
                    a, b, args.quick, ("cuda", ours), *more,
                    *[(f"splitk_{s}", _with_split(s)) for s in splits],
                ),
            }  # fmt: skip
            if args.configs:
                for key in ("", "graph_"):
                    times = {c: row[f"{key}cfg_{c}_us"] for c in gemm_config.CUDA_CONFIGS}
                    row[f"{key}best_config"] = min(times, key=times.get)
            if splits:
                for key in ("", "graph_"):
                    times = {1: row[f"{key}cuda_us"]}
                    times.update({s: row[f"{key}splitk_{s}_us"] for s in splits})
                    row[f"{key}best_split"] = min(times, key=times.get)
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
    for s in _split_keys(rows):
        split_rows = [r for r in rows if f"splitk_{s}_ratio" in r]
        for key in ("ratio", "graph_ratio"):
            pre = "graph_" if key.startswith("graph_") else ""
            vals = [r[f"{pre}splitk_{s}_ratio"] for r in split_rows]
            out[f"{pre}splitk_{s}_ratio_geomean"] = common.geomean(vals)
            out[f"{pre}splitk_{s}_ratio_worst"] = min(vals)
            # the unsplit kernel on the same rows, for comparison
            out[f"{pre}splitk_{s}_unsplit_ratio_geomean"] = common.geomean(
                [r[key] for r in split_rows]
            )
        out[f"splitk_{s}_max_rel_err_vs_cublas"] = max(
            r[f"splitk_{s}_rel_err_vs_cublas"] for r in split_rows
        )
        out[f"splitk_{s}_row0_alone_bitwise_all"] = all(
            r[f"splitk_{s}_row0_alone_bitwise"] for r in split_rows
        )
    return out


def _split_keys(rows: list[dict]) -> list[int]:
    """The split counts timed in ``rows`` (``splitk_<S>_ratio``), ascending."""
    found = {int(k.split("_")[1]) for r in rows for k in r if k.startswith("splitk_")}
    return sorted(found)


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
    if args.split_k:
        cols += [f"graph_splitk_{s}_ratio" for s in args.split_k] + ["graph_best_split"]
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
