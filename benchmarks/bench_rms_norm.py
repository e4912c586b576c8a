"""Benchmark of ``rms_norm`` (Triton provider) against stock torch and the measured copy bandwidth.

Usage: ``python benchmarks/bench_rms_norm.py [--out DIR] [--quick]``.

Writes ``DIR/rms_norm.json`` and ``DIR/rms_norm.png``. Per (rows, H), bf16: forward, fused
residual forward and backward (dX + dweight kernels, as the autograd runs them) of the ``triton``
provider; ``torch.nn.functional.rms_norm`` (forward) and its autograd (backward) as the stock
baseline. ``bw_frac`` = achieved bytes/s over the measured device copy bandwidth, counting the
bytes the op must move (forward: read x, write y; fused: read x + residual, write y + sum;
backward: read x + grad, write dx, plus the fp32 weight-gradient partials the kernels move).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import HIDDEN_SIZES  # noqa: E402

from rl_engine.ops.rms_norm import triton as rms_triton  # noqa: E402

EPS = 1e-6
ROWS = (1, 64, 1024, 4096, 16384)
ACCEPT = (16384, 8192)  # the acceptance shape: forward >= 0.90x copy, backward >= 0.75x


def _stock_bwd(x, w, g):
    xx = x.detach().requires_grad_(True)
    ww = w.detach().requires_grad_(True)
    y = torch.nn.functional.rms_norm(xx, (x.shape[-1],), ww, EPS)
    return torch.autograd.grad(y, (xx, ww), g)


def run(args, copy_tb_s: float) -> list[dict]:
    rows = []
    hs = sorted({*HIDDEN_SIZES, 8192})
    grid = [(m, h) for m in ((1, 1024, 16384) if args.quick else ROWS) for h in hs]
    if ACCEPT not in grid:
        grid.append(ACCEPT)
    for m, h in grid:
        rows.append(_case(args, copy_tb_s, m, h))
    return rows


def _case(args, copy_tb_s: float, m: int, h: int) -> dict:
    dt = torch.bfloat16
    x = torch.randn(m, h, device="cuda", dtype=dt)
    res = torch.randn(m, h, device="cuda", dtype=dt)
    w = torch.randn(h, device="cuda", dtype=dt)
    g = torch.randn(m, h, device="cuda", dtype=dt)
    e = x.element_size()
    cfg = rms_triton.get_config(h)
    n_parts = -(-m // cfg.wgrad_chunk)
    nbytes = {
        "fwd": 2 * m * h * e,
        "fused_fwd": 4 * m * h * e,
        "bwd": 3 * m * h * e,  # the minimum: read x, grad; write dx
        "bwd_kernels": 5 * m * h * e + 2 * n_parts * h * 4,  # what dX + dW kernels move
    }
    t = {
        "fwd": common.bench(lambda: rms_triton.rms_norm(x, w, EPS), quick=args.quick),
        "fused_fwd": common.bench(lambda: rms_triton.rms_norm(x, w, EPS, res), quick=args.quick),
        "bwd": common.bench(
            lambda: (
                rms_triton.rms_norm_dx(g, x, w, EPS),
                rms_triton.rms_norm_wgrad(g, x, EPS),
            ),
            quick=args.quick,
        ),
        "dx": common.bench(lambda: rms_triton.rms_norm_dx(g, x, w, EPS), quick=args.quick),
        "stock_fwd": common.bench(
            lambda: torch.nn.functional.rms_norm(x, (h,), w, EPS), quick=args.quick
        ),
        "stock_fused_fwd": common.bench(
            lambda: torch.nn.functional.rms_norm(x + res, (h,), w, EPS), quick=args.quick
        ),
        "stock_bwd": common.bench(lambda: _stock_bwd(x, w, g), quick=args.quick),
    }
    r = {"m": m, "h": h, "dtype": "bf16", **{f"{k}_us": v for k, v in t.items()}}
    for k in ("fwd", "fused_fwd", "bwd"):
        r[f"{k}_bw_frac"] = nbytes[k] / (t[k] * 1e-6) / 1e12 / copy_tb_s
        r[f"{k}_ratio_vs_stock"] = t[f"stock_{k}"] / t[k]
    r["bwd_kernels_bw_frac"] = nbytes["bwd_kernels"] / (t["bwd"] * 1e-6) / 1e12 / copy_tb_s
    r["dx_bw_frac"] = nbytes["bwd"] / (t["dx"] * 1e-6) / 1e12 / copy_tb_s
    print(
        f"rms_norm M={m:6d} H={h:5d}  fwd {t['fwd']:8.1f} us ({r['fwd_bw_frac']:.2f} copy, "
        f"{r['fwd_ratio_vs_stock']:.2f}x stock)  fused {r['fused_fwd_bw_frac']:.2f}  "
        f"bwd {t['bwd']:8.1f} us ({r['bwd_bw_frac']:.2f} min-bytes, "
        f"{r['bwd_kernels_bw_frac']:.2f} kernel-bytes, {r['bwd_ratio_vs_stock']:.2f}x stock)",
        flush=True,
    )
    return r


def plot(rows: list[dict], path: Path) -> None:
    if not common.have_matplotlib():
        return
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, k in zip(axes, ("fwd", "fused_fwd", "bwd")):
        for h in sorted({r["h"] for r in rows}):
            rs = sorted((r for r in rows if r["h"] == h), key=lambda r: r["m"])
            ax.plot([r["m"] for r in rs], [r[f"{k}_bw_frac"] for r in rs], "o-", label=f"H={h}")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.9 if k != "bwd" else 0.75, color="g", ls="--", lw=0.8)
        ax.set_xlabel("rows")
        ax.set_ylabel("fraction of measured copy bandwidth")
        ax.set_title(f"rms_norm triton bf16: {k}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    if not torch.cuda.is_available():
        print("bench_rms_norm: no CUDA device; nothing to measure")
        return
    limits = common.load_or_measure_limits(args.out, quick=args.quick)
    rows = run(args, limits["copy_tb_s"])
    acc = next(r for r in rows if (r["m"], r["h"]) == ACCEPT)
    summary = {
        "accept_fwd_bw_frac": acc["fwd_bw_frac"],
        "accept_fused_fwd_bw_frac": acc["fused_fwd_bw_frac"],
        "accept_bwd_bw_frac": acc["bwd_bw_frac"],
        "accept_bwd_kernels_bw_frac": acc["bwd_kernels_bw_frac"],
        "accept_dx_bw_frac": acc["dx_bw_frac"],
        "geomean_fwd_vs_stock": common.geomean([r["fwd_ratio_vs_stock"] for r in rows]),
        "geomean_bwd_vs_stock": common.geomean([r["bwd_ratio_vs_stock"] for r in rows]),
    }
    common.write_json(
        args.out,
        "rms_norm",
        {
            "provider": "triton",
            "baseline": "torch.nn.functional.rms_norm (+ autograd for backward)",
            "ratio_definition": "stock_us / triton_us (higher is better)",
            "bw_frac_definition": "minimum bytes of the op / time / measured copy bandwidth",
            "limits": limits,
            "summary": summary,
            "rows": rows,
        },
    )
    plot(rows, args.out / "rms_norm.png")
    print("rms_norm summary: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
