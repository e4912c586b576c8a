"""Benchmark of ``silu_and_mul`` (Triton provider) against stock torch and the copy bandwidth.

Usage: ``python benchmarks/bench_silu_and_mul.py [--out DIR] [--quick]``.

Writes ``DIR/silu_and_mul.json`` and ``DIR/silu_and_mul.png``. bf16, per (rows, D) with D from
the shared intermediate sizes: forward (read 2D, write D per row) and backward (read 2D + D,
write 2D) of the ``triton`` provider vs stock ``F.silu(a) * b`` and its autograd. ``bw_frac`` =
bytes moved / time / measured device copy bandwidth.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import INTERMEDIATE_SIZES  # noqa: E402

from rl_engine.ops.silu_and_mul import triton as silu_triton  # noqa: E402

ROWS = (1, 64, 1024, 4096, 16384)


def _stock(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def _stock_bwd(x, g):
    xx = x.detach().requires_grad_(True)
    return torch.autograd.grad(_stock(xx), xx, g)


def run(args, copy_tb_s: float) -> list[dict]:
    rows = []
    for m in (1, 1024, 16384) if args.quick else ROWS:
        for d in INTERMEDIATE_SIZES:
            rows.append(_case(args, copy_tb_s, m, d))
    return rows


def _case(args, copy_tb_s: float, m: int, d: int) -> dict:
    x = torch.randn(m, 2 * d, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    e = x.element_size()
    t = {
        "fwd": common.bench(lambda: silu_triton.silu_and_mul(x), quick=args.quick),
        "bwd": common.bench(lambda: silu_triton.silu_and_mul_backward(g, x), quick=args.quick),
        "stock_fwd": common.bench(lambda: _stock(x), quick=args.quick),
        "stock_bwd": common.bench(lambda: _stock_bwd(x, g), quick=args.quick),
    }
    nbytes = {"fwd": 3 * m * d * e, "bwd": 5 * m * d * e}
    r = {"m": m, "d": d, "dtype": "bf16", **{f"{k}_us": v for k, v in t.items()}}
    common.vs_baseline(r, t, nbytes, copy_tb_s, ("fwd", "bwd"))
    return common.progress(
        r,
        "silu_and_mul M={m:6d} D={d:5d}  fwd {fwd_us:8.1f} us ({fwd_bw_frac:.2f} copy, "
        "{fwd_ratio_vs_stock:.2f}x stock)  bwd {bwd_us:8.1f} us ({bwd_bw_frac:.2f} copy, "
        "{bwd_ratio_vs_stock:.2f}x stock)",
    )


def plot(rows: list[dict], path: Path) -> None:
    panels = [(rows, k, f"silu_and_mul triton bf16: {k}") for k in ("fwd", "bwd")]
    common.bw_panels(path, panels, group="d")


def summarize(rows: list[dict]) -> dict:
    big = [r for r in rows if r["m"] >= 4096]
    return {
        **common.geomeans(big, fwd_bw_frac_large_rows="fwd_bw_frac",
                          bwd_bw_frac_large_rows="bwd_bw_frac"),
        **common.ratio_geomeans(rows, ("fwd", "bwd")),
    }  # fmt: skip


def main() -> None:
    common.op_main(
        __doc__, "bench_silu_and_mul", "silu_and_mul", run, summarize, plot=plot,
        baseline="F.silu(x[..., :D]) * x[..., D:] (+ autograd for backward)",
        ratio=common.ratio_definition("stock"),
        bw="bytes moved / time / measured copy bandwidth",
    )  # fmt: skip


if __name__ == "__main__":
    main()
