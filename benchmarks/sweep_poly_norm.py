"""Sweep of launch setups for the Triton ``poly_norm`` kernels (pick the shipped one), with an
optional A/B against an earlier version of the provider in the same process.

Usage: ``python3 benchmarks/sweep_poly_norm.py --out DIR [--old PATH] [--quick]``.

bf16; rows M in (4096, 16384) x H in the shared hidden and intermediate sizes (the rows
``bench_poly_norm.py`` summarises), ``poly_norm`` and ``fused_mul_poly_norm``, forward and
backward. Each candidate :class:`Config` (``lanes``, ``warps``, ``unroll``; the shipped ones of
:func:`launch_config` first) is checked before it is timed, on 37 rows of H = 4160
(16 blocks of 256 and a masked tail) and 14336 (whole blocks):

* row invariance: rows 5..8 run alone give the bits they have inside the 37 (forward, fused
  forward, dx, dmul);
* candidates of the same ``lanes`` give the same bits (``warps`` and ``unroll`` are speed only);
* forward and dx within the dtype's tolerance of the ``native`` reference.

``--old PATH``: a ``triton.py`` of the provider from an earlier commit (``git show
REV:rl_engine/ops/poly_norm/triton.py > PATH``), timed on the same rows as row ``old``; its
forward is also compared bitwise with the candidates of its lane count (same lanes, same bits
unless the forward's numerics changed).

``bw_frac`` = minimum bytes / time / measured copy bandwidth (``bench_poly_norm.py``'s
definition; ``limits.json`` in DIR, measured when missing). Prints a table and writes
``DIR/poly_norm_sweep.json``. Without CUDA it prints why and exits 0. To ship a setup, change
:func:`launch_config` (and :data:`LANES`, a numerics change: a new version).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import HIDDEN_SIZES, INTERMEDIATE_SIZES  # noqa: E402

from rl_engine.ops.poly_norm import reference as pn_ref  # noqa: E402
from rl_engine.ops.poly_norm import triton as pn  # noqa: E402
from rl_engine.testing.tolerances import tolerance  # noqa: E402

EPS = 1e-6
ROWS = (4096, 16384)
CHECK_HS = (4160, 14336)  # a masked tail (4160 = 16 x 256 + 64) and none; 16-aligned
Cfg = pn.Config


def candidates() -> list[Cfg | None]:
    """``None`` = the shipped setups (launch_config per H), then alternatives."""
    out: list[Cfg | None] = [None]
    grid = [(256, 1, 2), (256, 1, 4), (256, 1, 8), (256, 2, 4), (512, 1, 4), (512, 2, 4),
            (1024, 2, 1), (1024, 4, 2), (128, 1, 8)]  # fmt: skip
    out += [Cfg(*c) for c in grid]
    return out


def _load_old(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("poly_norm_triton_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _runner(cfg: Cfg | None, old: Any):
    """(fwd(x, mul, w, b), bwd(g, x, mul, w, b)) for a candidate, the shipped setups or ``old``."""
    if old is not None:
        return (
            lambda x, m, w, b: (
                old.poly_norm(x, w, b, EPS)
                if m is None
                else old.fused_mul_poly_norm(x, m, w, b, EPS)
            ),
            lambda g, x, m, w, b: old.poly_norm_backward(g, x, w, b, EPS, m),
        )
    return (
        lambda x, m, w, b: pn._launch_fwd(x, w, b, EPS, m, cfg),
        lambda g, x, m, w, b: pn._launch_bwd(g, x, w, b, EPS, m, cfg),
    )


def _lanes(cfg: Cfg | None, h: int, old: Any) -> int:
    if old is not None:
        return old.block_for(h)
    return pn.block_for(h, (cfg or pn.launch_config(h)).lanes)


def _inputs(m: int, h: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(m, h, device="cuda", generator=gen)).to(torch.bfloat16)

    return {"x": r(1.5), "mul": r(), "g": r(),
            "w": torch.tensor([0.3, -0.7, 1.1], device="cuda"),
            "b": torch.tensor([0.05], device="cuda")}  # fmt: skip


def _outputs(fwd, bwd, t: dict[str, torch.Tensor], rows: slice | None = None) -> list[torch.Tensor]:
    sl = rows if rows is not None else slice(None)
    x, m, g = (t[k][sl] for k in ("x", "mul", "g"))
    y = fwd(x, None, t["w"], t["b"])
    yf = fwd(x, m, t["w"], t["b"])
    dx, _, dw, db = bwd(g, x, None, t["w"], t["b"])
    dxf, dmf, _, _ = bwd(g, x, m, t["w"], t["b"])
    return [y, yf, dx, dxf, dmf, dw, db]


def check(cfg: Cfg | None, old: Any, bits: dict, rtol_atol) -> dict[str, Any]:
    """Row invariance, same bits per lane count, closeness to the reference (module doc)."""
    fwd, bwd = _runner(cfg, old)
    res: dict[str, Any] = {"row_invariant": True, "same_bits_per_lanes": True, "ref_ok": True}
    for h in CHECK_HS:
        t = _inputs(37, h, seed=h)
        full = _outputs(fwd, bwd, t)
        alone = _outputs(fwd, bwd, t, slice(5, 9))
        if not all(torch.equal(a, f[5:9]) for a, f in zip(alone[:5], full[:5])):
            res["row_invariant"] = False
        key = (_lanes(cfg, h, old), h)
        if key in bits:
            n = 2 if old is not None else len(full)  # the old provider: its forwards only
            prev = bits[key]
            if not all(torch.equal(a, b) for a, b in zip(full[:n], prev[:n])):
                res["same_bits_per_lanes"] = False
        elif old is None:
            bits[key] = full
        (rt, at), (rg, ag) = rtol_atol
        y_ref = pn_ref.poly_norm(t["x"], t["w"], t["b"], EPS)
        dx_ref = pn_ref.poly_norm_backward(t["g"], t["x"], t["w"], t["b"], EPS)[0]
        scale = max(1.0, float(dx_ref.float().abs().max()))
        ok_y = ((full[0].float() - y_ref.float()).abs() <= at + rt * y_ref.float().abs()).all()
        ok_dx = (
            (full[2].float() - dx_ref.float()).abs() <= ag * scale + rg * dx_ref.float().abs()
        ).all()
        res["ref_ok"] = res["ref_ok"] and bool(ok_y) and bool(ok_dx)
    return res


def _bytes(m: int, h: int, fused: bool) -> dict[str, float]:
    n_in = 2 if fused else 1
    return {"fwd": (n_in + 1) * m * h * 2, "bwd": (2 * n_in + 1) * m * h * 2 + 16 * m}


def time_rows(cfg: Cfg | None, old: Any, copy_tb_s: float, quick: bool) -> list[dict]:
    fwd, bwd = _runner(cfg, old)
    rows = []
    for m in ROWS:
        for h in (*HIDDEN_SIZES, *INTERMEDIATE_SIZES):
            t = _inputs(m, h, seed=0)
            for fused in (False, True):
                mm = t["mul"] if fused else None
                x, g, w, b = (t[k] for k in ("x", "g", "w", "b"))
                us = {
                    "fwd": common.bench(lambda: fwd(x, mm, w, b), quick=quick),  # noqa: B023
                    "bwd": common.bench(lambda: bwd(g, x, mm, w, b), quick=quick),  # noqa: B023
                }
                nb = _bytes(m, h, fused)
                r = {"m": m, "h": h, "fused_mul": fused}
                for k in ("fwd", "bwd"):
                    r[f"{k}_us"] = us[k]
                    r[f"{k}_bw_frac"] = common.bw_frac(nb[k], us[k], copy_tb_s)
                rows.append(r)
    return rows


def _name(cfg: Cfg | None, old: Any) -> str:
    if old is not None:
        return "old"
    if cfg is None:
        return "shipped"
    return f"l{cfg.lanes}_w{cfg.warps}_u{cfg.unroll}"


def _extra(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--old", default=None, help="triton.py of an earlier provider version")


@common.gpu_main(__doc__, "sweep_poly_norm", _extra)
def main(args: argparse.Namespace, limits: dict[str, float]) -> None:
    copy = limits["copy_tb_s"]
    tol = (tolerance(torch.bfloat16), tolerance(torch.bfloat16, grad=True))
    setups: list[tuple[Cfg | None, Any]] = [(c, None) for c in candidates()]
    if args.old:
        setups.insert(0, (None, _load_old(args.old)))
    bits: dict = {}
    results = []
    for cfg, old in setups[1:] + setups[:1] if args.old else setups:  # the old one checked last
        name = _name(cfg, old)
        t0 = time.time()
        r: dict[str, Any] = {"name": name, "config": None if cfg is None else cfg._asdict()}
        try:
            r.update(check(cfg, old, bits, tol))
            rows = time_rows(cfg, old, copy, args.quick)
            r["rows"] = rows
            for f in (False, True):
                for k in ("fwd", "bwd"):
                    r[f"{k}{'_fused' if f else ''}"] = common.geomean(
                        [x[f"{k}_bw_frac"] for x in rows if x["fused_mul"] == f]
                    )
        except Exception as exc:  # a candidate that does not compile or run is reported
            r["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        r["seconds"] = time.time() - t0
        results.append(r)
        print(
            f"{name:16s} " + ("ERROR " + r["error"] if "error" in r else
            f"fwd {r['fwd']:.3f} bwd {r['bwd']:.3f} fused fwd {r['fwd_fused']:.3f} "
            f"bwd {r['bwd_fused']:.3f}  row-inv {r['row_invariant']} same-bits "
            f"{r['same_bits_per_lanes']} ref {r['ref_ok']}  ({r['seconds']:.0f} s)"),
            flush=True,
        )  # fmt: skip
        common.write_json(args.out, "poly_norm_sweep", {
            "definition": "geomean of bw_frac over rows M in (4096, 16384) x H in the shared "
                          "sizes (bench_poly_norm's large-row summary)",
            "limits": limits, "results": results})  # fmt: skip
    ok = [r for r in results if "error" not in r]
    common.print_table(
        ok, ["name", "fwd", "bwd", "fwd_fused", "bwd_fused", "row_invariant",
             "same_bits_per_lanes", "ref_ok"],
    )  # fmt: skip


if __name__ == "__main__":
    main()
