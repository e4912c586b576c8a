"""Benchmark of ``rms_norm`` (Triton provider) against stock torch and the measured copy bandwidth.

Usage: ``python benchmarks/bench_rms_norm.py [--out DIR] [--quick]``.

Writes ``DIR/rms_norm.json`` and ``DIR/rms_norm.png``. Per (rows, H), bf16: forward and fused
residual forward of the ``triton`` provider; backward as users get it: ``torch.autograd.grad`` of
``rms_norm(x, w)`` w.r.t. ``(x, w)`` over a recorded graph (the one-pass fused backward kernel +
the partial-combining kernel), and of the fused residual op w.r.t. ``(x, residual, w)`` with a
gradient into both outputs (``fused_bwd``); for comparison the two separate kernels (dX +
weight gradient, ``bwd_separate``) and the dX kernel alone. Baseline: ``F.rms_norm`` forward and
its autograd backward (also over a recorded graph, forward not timed). ``bw_frac`` = achieved
bytes/s over the measured device copy bandwidth, counting the bytes the op must move (forward:
read x, write y; fused: read x + residual, write y + sum; backward: read x + grad, write dx;
fused backward: read sum + both grads, write dx), ``bwd_kernels_bw_frac`` adding the fp32
weight-gradient partials the kernels write and read back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import HIDDEN_SIZES  # noqa: E402

from rl_engine.ops import rms_norm  # noqa: E402
from rl_engine.ops.rms_norm import triton as rms_triton  # noqa: E402

EPS = 1e-6
ROWS = (1, 64, 1024, 4096, 16384)
ACCEPT = (16384, 8192)  # the acceptance shape: forward >= 0.90x copy, backward >= 0.75x


def _grad_fn(y, inputs, grads):
    """Backward only: autograd over the recorded graph of ``y`` (kept for repeats)."""
    outs = list(y) if isinstance(y, tuple) else [y]
    return lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True)


def _leaves(*ts):
    return tuple(t.detach().clone().requires_grad_(True) for t in ts)


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
        "fused_bwd": 4 * m * h * e,  # read sum, grad_y, grad_sum; write dx (= dresidual)
        "bwd_kernels": 3 * m * h * e + 2 * n_parts * h * 4,  # + fp32 partials written, read
    }
    xl, wl = _leaves(x, w)
    y_tri = rms_norm(xl, wl, EPS, backend="triton")
    xf, rf, wf = _leaves(x, res, w)
    yf_tri = rms_norm(xf, wf, EPS, rf, backend="triton")
    xs, ws = _leaves(x, w)
    y_stock = torch.nn.functional.rms_norm(xs, (h,), ws, EPS)
    xsf, rsf, wsf = _leaves(x, res, w)
    s_stock = xsf + rsf
    yf_stock = torch.nn.functional.rms_norm(s_stock, (h,), wsf, EPS)
    t = {
        "fwd": common.bench(lambda: rms_triton.rms_norm(x, w, EPS), quick=args.quick),
        "fused_fwd": common.bench(lambda: rms_triton.rms_norm(x, w, EPS, res), quick=args.quick),
        "bwd": common.bench(_grad_fn(y_tri, (xl, wl), [g]), quick=args.quick),
        "fused_bwd": common.bench(_grad_fn(yf_tri, (xf, rf, wf), [g, res]), quick=args.quick),
        "bwd_separate": common.bench(
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
        "stock_bwd": common.bench(_grad_fn(y_stock, (xs, ws), [g]), quick=args.quick),
        "stock_fused_bwd": common.bench(
            _grad_fn((yf_stock, s_stock), (xsf, rsf, wsf), [g, res]), quick=args.quick
        ),
    }
    r = {"m": m, "h": h, "dtype": "bf16", **{f"{k}_us": v for k, v in t.items()}}
    common.vs_baseline(r, t, nbytes, copy_tb_s, ("fwd", "fused_fwd", "bwd", "fused_bwd"))
    r["bwd_kernels_bw_frac"] = common.bw_frac(nbytes["bwd_kernels"], t["bwd"], copy_tb_s)
    r["bwd_separate_bw_frac"] = common.bw_frac(nbytes["bwd"], t["bwd_separate"], copy_tb_s)
    r["dx_bw_frac"] = common.bw_frac(nbytes["bwd"], t["dx"], copy_tb_s)
    return common.progress(
        r,
        "rms_norm M={m:6d} H={h:5d}  fwd {fwd_us:8.1f} us ({fwd_bw_frac:.2f} copy, "
        "{fwd_ratio_vs_stock:.2f}x stock)  fused {fused_fwd_bw_frac:.2f}  bwd {bwd_us:8.1f} us "
        "({bwd_bw_frac:.2f} min-bytes, {bwd_kernels_bw_frac:.2f} kernel-bytes, "
        "{bwd_ratio_vs_stock:.2f}x stock; separate kernels {bwd_separate_bw_frac:.2f})  "
        "fused bwd {fused_bwd_bw_frac:.2f} ({fused_bwd_ratio_vs_stock:.2f}x stock)",
    )


def plot(rows: list[dict], path: Path) -> None:
    keys = ("fwd", "fused_fwd", "bwd", "fused_bwd")
    common.bw_panels(path, [(rows, k, f"rms_norm triton bf16: {k}") for k in keys], group="h",
                     target=lambda k: 0.75 if "bwd" in k else 0.9)  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    acc = next(r for r in rows if (r["m"], r["h"]) == ACCEPT)
    return {
        "accept_fwd_bw_frac": acc["fwd_bw_frac"],
        "accept_fused_fwd_bw_frac": acc["fused_fwd_bw_frac"],
        "accept_bwd_bw_frac": acc["bwd_bw_frac"],
        "accept_bwd_kernels_bw_frac": acc["bwd_kernels_bw_frac"],
        "accept_bwd_separate_bw_frac": acc["bwd_separate_bw_frac"],
        "accept_fused_bwd_bw_frac": acc["fused_bwd_bw_frac"],
        "accept_dx_bw_frac": acc["dx_bw_frac"],
        **common.ratio_geomeans(rows, ("fwd", "bwd", "fused_bwd")),
    }


def main() -> None:
    common.op_main(
        __doc__, "bench_rms_norm", "rms_norm", run, summarize, plot=plot,
        baseline="torch.nn.functional.rms_norm (+ autograd for backward)",
        ratio=common.ratio_definition("stock"),
        bw="minimum bytes of the op / time / measured copy bandwidth",
        backward_definition="torch.autograd.grad over a recorded graph (forward not timed)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
