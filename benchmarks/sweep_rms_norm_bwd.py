"""Sweep of launch configurations for the Triton ``rms_norm`` backward (pick the shipped one).

Usage: ``python3 benchmarks/sweep_rms_norm_bwd.py --out DIR [--wide] [--quick]``.

For 16384 rows and H in (2048, 4096, 5120, 8192), bf16, times the fused backward
(``rms_norm.triton._backward``: the one-pass dX + weight-gradient kernel and the partial-combining
kernel) for a handful of :class:`RmsNormBwdConfig` candidates per H (``--wide``: a larger grid,
for exploring; a few minutes). Each candidate's dX and dW are checked against the ``native``
reference (``rl_engine.ops.rms_norm.reference``) within the gradient tolerance, its dX against
the dX kernel launched with the same configuration (bitwise: the fused-vs-separate contract), and
candidates that share a numerics key (block_h, rows, num_warps, wgrad_chunk) against each other
(bitwise: the other fields must not change a bit). For the shipped configuration it also times
the backward as users get it (``torch.autograd.grad`` over a recorded graph, as
``bench_rms_norm.py`` does), the dX kernel alone and stock ``F.rms_norm``'s backward.

``bw_frac`` = (read x, read grad, write dx: 3 * M * H * 2 bytes) / time / measured copy bandwidth
(``limits.json`` in DIR, measured when missing); ``kernel_bw_frac`` adds the fp32 partials written
and read back. Prints a table and writes ``DIR/rms_norm_bwd_sweep.json``. Without CUDA it prints
why and exits 0. To ship a configuration, change :func:`get_bwd_config` (one line per field).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402

from rl_engine.ops import rms_norm  # noqa: E402
from rl_engine.ops.rms_norm import reference as rms_ref  # noqa: E402
from rl_engine.ops.rms_norm import triton as rms_triton  # noqa: E402
from rl_engine.testing.tolerances import tolerance  # noqa: E402

M = 16384
HS = (2048, 4096, 5120, 8192)
EPS = 1e-6
Cfg = rms_triton.RmsNormBwdConfig


def _cand(h: int, rows: int, warps: int, chunk: int, **kw: Any) -> Cfg:
    return dataclasses.replace(
        rms_triton.get_bwd_config(h), rows=rows, num_warps=warps, wgrad_chunk=chunk, **kw
    )


def candidates(h: int, wide: bool) -> list[Cfg]:
    """The shipped configuration first, then alternatives (a function of H only)."""
    base = rms_triton.get_bwd_config(h)
    w = base.num_warps
    rep = dataclasses.replace
    pf = {"prefetch": True, "stages": 1}
    pfrw = {"prefetch": True, "stages": 1, "reload_weight": True}
    piped = {"prefetch": False, "stages": 3}
    fwd = rms_triton.get_config(h)
    v2_chunk = max(fwd.rows, (1 << 18) // fwd.block_h)
    out = [
        base,
        *(rep(base, wgrad_chunk=c) for c in (32, 64, 128)),
        rep(base, **piped),
        rep(base, reload_weight=not base.reload_weight),
        # the version-2 schedule (the forward kernel's tile, its chunk rule), on version-3 math
        _cand(h, fwd.rows, fwd.num_warps, v2_chunk, reload_weight=False, **pf),
    ]
    if 2 * w <= 16:
        out += [rep(base, num_warps=2 * w), rep(base, num_warps=2 * w, wgrad_chunk=128)]
    if w > 1 and h <= 40 * 32 * (w // 2):  # half the warps only where it does not spill
        out.append(rep(base, num_warps=w // 2, reload_weight=True))
    if wide:
        for ww in sorted({max(1, w // 2), w, min(16, 2 * w)}):
            for chunk in (16, 32, 64, 128):
                for sched in (pf, pfrw, piped):
                    out.append(_cand(h, base.rows, ww, chunk, **sched))
        out += [
            rep(base, rows=2 * base.rows, num_warps=min(16, 2 * w)),
            rep(base, combine_block=32, combine_unroll=64, combine_warps=1),
            rep(base, combine_block=128, combine_unroll=16, combine_warps=4),
            rep(base, combine_block=256, combine_unroll=16, combine_warps=4),
        ]
    seen: set[Cfg] = set()
    return [c for c in out if not (c in seen or seen.add(c))]


def _numerics_key(c: Cfg) -> tuple[int, int, int, int]:
    return (c.block_h, c.rows, c.num_warps, c.wgrad_chunk)


def _compiled(kernel: Any) -> set[int]:
    """ids of the compiled variants of a JIT kernel (best effort: Triton-internal layout)."""
    out: set[int] = set()
    for cache in getattr(kernel, "device_caches", {}).values():
        entries = cache[0] if isinstance(cache, tuple) else cache
        out |= {id(v) for v in entries.values()}
    return out


def _regs(kernel: Any, before: set[int]) -> tuple[int | None, int | None]:
    """(registers per thread, spilled bytes) of the variant compiled since ``before``."""
    try:
        for cache in kernel.device_caches.values():
            entries = cache[0] if isinstance(cache, tuple) else cache
            for v in entries.values():
                if id(v) not in before:
                    return int(v.n_regs), int(v.n_spills)
    except Exception:
        pass
    return None, None


def _grad_fn(y: torch.Tensor, inputs: tuple[torch.Tensor, ...], g: torch.Tensor):
    return lambda: torch.autograd.grad([y], inputs, [g], retain_graph=True)


def sweep_h(h: int, args: Any, copy_tb_s: float) -> list[dict]:
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(h)
    x = torch.randn(M, h, device="cuda", dtype=dt, generator=gen)
    g = torch.randn(M, h, device="cuda", dtype=dt, generator=gen)
    w = torch.randn(h, device="cuda", dtype=dt, generator=gen)
    want_dx = rms_ref.rms_norm_dx(g, x, w, EPS)
    want_dw = rms_ref.rms_norm_wgrad(g, x, EPS)
    rtol, atol = tolerance(dt, grad=True)
    min_bytes = 3 * M * h * x.element_size()
    bits: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    rows = []
    for i, c in enumerate(candidates(h, args.wide)):
        r: dict[str, Any] = {"h": h, "m": M, "shipped": i == 0, **dataclasses.asdict(c)}
        r["programs"] = -(-M // c.wgrad_chunk)
        try:
            before = _compiled(rms_triton._rms_norm_bwd_kernel)
            dx, dw = rms_triton._backward(g, x, w, EPS, None, cfg=c)
            torch.cuda.synchronize()
            r["regs"], r["spill_bytes"] = _regs(rms_triton._rms_norm_bwd_kernel, before)
            err_dx = (dx.float() - want_dx.float()).abs()
            lim_dx = atol + rtol * want_dx.float().abs()
            err_dw = (dw - want_dw).abs()
            lim_dw = 1e-4 * M**0.5 + 1e-4 * want_dw.abs()
            r["dx_max_err"] = err_dx.max().item()
            r["dw_max_err"] = err_dw.max().item()
            r["ok_ref"] = bool((err_dx <= lim_dx).all() and (err_dw <= lim_dw).all())
            key = _numerics_key(c)
            if key not in bits:
                bits[key] = (dx, dw)
                sep = rms_triton._dx(g, x, w, EPS, cfg=c)
                r["dx_kernel_bitwise"] = bool(torch.equal(sep, dx))
            else:
                r["same_bits_as_key"] = bool(
                    torch.equal(bits[key][0], dx) and torch.equal(bits[key][1], dw)
                )
            if i == 0:
                wg = rms_triton.rms_norm_wgrad(g, x, EPS)
                r["wgrad_extra_bitwise"] = bool(torch.equal(wg, dw))
            del dx, dw
            t = common.bench(
                lambda c=c: rms_triton._backward(g, x, w, EPS, None, cfg=c), quick=True
            )
            r["us"] = t
            r["bw_frac"] = min_bytes / (t * 1e-6) / 1e12 / copy_tb_s
            kbytes = min_bytes + 2 * r["programs"] * h * 4
            r["kernel_bw_frac"] = kbytes / (t * 1e-6) / 1e12 / copy_tb_s
        except Exception as exc:  # a candidate that does not compile or run is reported
            r["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(r)
        print(_line(r), flush=True)
    # the shipped configuration as users get it
    c0 = rms_triton.get_bwd_config(h)
    xl = x.detach().clone().requires_grad_(True)
    wl = w.detach().clone().requires_grad_(True)
    y = rms_norm(xl, wl, EPS, backend="triton")
    t_auto = common.bench(_grad_fn(y, (xl, wl), g), quick=True)
    t_dx = common.bench(lambda: rms_triton._dx(g, x, w, EPS, cfg=c0), quick=True)
    xs = x.detach().clone().requires_grad_(True)
    ws = w.detach().clone().requires_grad_(True)
    ys = torch.nn.functional.rms_norm(xs, (h,), ws, EPS)
    t_stock = common.bench(_grad_fn(ys, (xs, ws), g), quick=True)
    summary = {
        "h": h,
        "m": M,
        "summary": True,
        "autograd_us": t_auto,
        "autograd_bw_frac": min_bytes / (t_auto * 1e-6) / 1e12 / copy_tb_s,
        "dx_kernel_us": t_dx,
        "dx_kernel_bw_frac": min_bytes / (t_dx * 1e-6) / 1e12 / copy_tb_s,
        "stock_autograd_us": t_stock,
        "stock_bw_frac": min_bytes / (t_stock * 1e-6) / 1e12 / copy_tb_s,
    }
    print(
        f"  H={h}: shipped config through autograd {t_auto:.1f} us "
        f"({summary['autograd_bw_frac']:.3f} copy), dX kernel alone {t_dx:.1f} us "
        f"({summary['dx_kernel_bw_frac']:.3f}), stock F.rms_norm backward {t_stock:.1f} us "
        f"({summary['stock_bw_frac']:.3f})",
        flush=True,
    )
    return rows + [summary]


def _line(r: dict) -> str:
    knobs = (
        f"rows={r['rows']} warps={r['num_warps']:2d} chunk={r['wgrad_chunk']:3d} "
        f"pf={int(r['prefetch'])} st={r['stages']} rw={int(r['reload_weight'])} "
        f"cmb={r['combine_block']}/{r['combine_unroll']}/{r['combine_warps']}"
    )
    head = f"H={r['h']:5d} {'*' if r['shipped'] else ' '} {knobs}"
    if "error" in r:
        return f"{head}  ERROR {r['error']}"
    checks = "ok" if r["ok_ref"] else "REF-MISMATCH"
    if r.get("dx_kernel_bitwise") is False or r.get("same_bits_as_key") is False:
        checks += " BITS-DIFFER"
    if r.get("wgrad_extra_bitwise") is False:
        checks += " WGRAD-DIFFERS"
    return (
        f"{head}  {r['us']:7.1f} us  bw {r['bw_frac']:.3f} (kernel {r['kernel_bw_frac']:.3f})  "
        f"regs {r['regs']} spill {r['spill_bytes']}  {checks}"
    )


def main() -> None:
    def extra(p):
        p.add_argument("--wide", action="store_true", help="a larger candidate grid (minutes)")

    args = common.cuda_args(
        __doc__, "sweep_rms_norm_bwd: no CUDA device; nothing to measure", extra
    )
    if args is None:
        return
    t0 = time.time()
    limits = common.load_or_measure_limits(args.out, quick=True)
    rows: list[dict] = []
    for h in HS:
        rows += sweep_h(h, args, limits["copy_tb_s"])
        torch.cuda.empty_cache()
    best = {}
    for h in HS:
        ok = [r for r in rows if r["h"] == h and "us" in r and r["ok_ref"]]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            best[h] = {k: b[k] for k in ("us", "bw_frac", *Cfg.__dataclass_fields__)}
    print("\nfastest correct candidate per H:")
    common.print_table(
        [{"h": h, **b} for h, b in best.items()],
        ["h", "us", "bw_frac", "rows", "num_warps", "wgrad_chunk", "prefetch", "stages"],
    )
    print(f"sweep took {time.time() - t0:.0f} s")
    common.write_json(
        args.out,
        "rms_norm_bwd_sweep",
        {
            "provider": "triton",
            "what": "fused backward (_backward: bwd kernel + combine) per RmsNormBwdConfig",
            "bw_frac_definition": "3*M*H*2 bytes / time / measured copy bandwidth",
            "limits": limits,
            "best": {str(h): b for h, b in best.items()},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
