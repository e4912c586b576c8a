"""Tile sweep of the ``moe_experts`` Triton kernels at Qwen3-30B-A3B's MoE shape (a launch
choice only: every config gives the same bits, checked here on every candidate).

Usage: ``python benchmarks/sweep_moe_experts.py [--out DIR] [--quick] [--ts 1,4,16]``.

For each token count T (decode 1..256, prefill 1k..16k), starting from the shipped table's
config for T (``triton.get_config``), a coordinate descent over kernel 1 (gate/up + SwiGLU) then
kernel 2 (down), each axis in turn: ``block_m`` (both kernels: the alignment unit), ``block_n``
x 0.5 / x 2, ``block_k`` x 0.5 / x 2, ``num_stages`` +- 1, ``num_warps`` 4 <-> 8; two passes.
Each candidate: ``moe_experts_with_config`` (alignment + both kernels) timed as a CUDA-graph
replay (``common.bench_graph``), its output compared bitwise with the shipped config's (a
failure is recorded and the candidate dropped). A config that does not compile or does not fit
(shared memory) is recorded and skipped. Prints per T the shipped and the best config with
their times; writes ``DIR/moe_experts_sweep.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import QWEN3_30B_A3B_MOE  # noqa: E402

from rl_engine.ops.moe_experts import triton as mt  # noqa: E402
from rl_engine.run_info import code_hash  # noqa: E402

TS = (1, 4, 16, 64, 128, 256, 1024, 4096, 16384)


def _neighbours(cfg: mt.MoeGemmConfig, part: str) -> list[mt.MoeGemmConfig]:
    """Configs one step away from ``cfg`` along each axis of kernel ``part`` ("up" / "down")."""
    out = []
    n, k, w, st = (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    if part == "down":
        n, k, w, st = cfg.down or (n, k, w, st)
    for nn, kk, ww, ss in (
        (n // 2, k, w, st), (n * 2, k, w, st), (n, k // 2, w, st), (n, k * 2, w, st),
        (n, k, w, st - 1), (n, k, w, st + 1), (n, k, 12 - w, st),
    ):  # fmt: skip
        if not (16 <= nn <= 256 and 32 <= kk <= 256 and 1 <= ss <= 6):
            continue
        if part == "up":
            out.append(dataclasses.replace(cfg, block_n=nn, block_k=kk, num_warps=ww,
                                           num_stages=ss, down=cfg.down or (n, k, w, st)))  # fmt: skip
        else:
            out.append(dataclasses.replace(cfg, down=(nn, kk, ww, ss)))
    if part == "up":
        for bm in (cfg.block_m // 2, cfg.block_m * 2):
            if 16 <= bm <= 128:
                out.append(dataclasses.replace(cfg, block_m=bm))
    return out


def _cfg_dict(cfg: mt.MoeGemmConfig) -> dict:
    return dataclasses.asdict(cfg)


def _sweep_t(t: int, c: dict, weights, quick: bool) -> dict:
    w13, w2 = weights
    h, k, e = c["hidden"], c["top_k"], c["experts"]
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
    shipped = mt.get_config(t * k, e, x.dtype)
    ref = mt.moe_experts_with_config(x, ids, w13, w2, None, shipped)
    sets = [(x,)]
    tried: dict[mt.MoeGemmConfig, float | str] = {}

    def time_of(cfg: mt.MoeGemmConfig) -> float | None:
        if cfg in tried:
            v = tried[cfg]
            return v if isinstance(v, float) else None
        try:
            got = mt.moe_experts_with_config(x, ids, w13, w2, None, cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # out of shared memory / registers: not a candidate
            tried[cfg] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            return None
        if not torch.equal(got, ref):
            tried[cfg] = "NOT BITWISE EQUAL to the shipped config"
            return None
        us = common.bench_graph(
            lambda xx, cfg=cfg: mt.moe_experts_with_config(xx, ids, w13, w2, None, cfg),
            sets, quick=True,
        )  # fmt: skip
        tried[cfg] = us
        return us

    best, best_us = shipped, time_of(shipped)
    for _ in range(1 if quick else 2):
        for part in ("up", "down"):
            improved = True
            while improved:
                improved = False
                for cand in _neighbours(best, part):
                    us = time_of(cand)
                    if us is not None and us < best_us * 0.98:
                        best, best_us, improved = cand, us, True
    shipped_us = tried[shipped]
    row = {
        "t": t,
        "avg_rows_per_expert": t * k / e,
        "shipped": _cfg_dict(shipped),
        "shipped_us": shipped_us,
        "best": _cfg_dict(best),
        "best_us": best_us,
        "gain": shipped_us / best_us if isinstance(shipped_us, float) else None,
        "candidates": len(tried),
        "rejected": {str(cf): v for cf, v in tried.items() if isinstance(v, str)},
    }
    print(f"sweep T={t:6d}: shipped {shipped_us:8.1f} us {shipped}\n"
          f"              best    {best_us:8.1f} us {best}  ({len(tried)} tried, "
          f"{len(row['rejected'])} rejected)", flush=True)  # fmt: skip
    return row


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ts", default=None,
                   help="comma-separated token counts (default: all of TS; --quick: 1,64,4096)")  # fmt: skip


@common.gpu_main(__doc__, "sweep_moe_experts", _args)
def main(args: argparse.Namespace, _limits: dict[str, float]) -> None:
    c = QWEN3_30B_A3B_MOE
    g = torch.Generator(device="cuda").manual_seed(0)
    h, e, i = c["hidden"], c["experts"], c["ffn"]
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5).to(torch.bfloat16)
    if args.ts:
        ts = tuple(int(t) for t in args.ts.split(","))
    else:
        ts = (1, 64, 4096) if args.quick else TS
    rows: list[dict] = []
    for t in ts:  # the file is rewritten after each T: a run cut short keeps what it measured
        rows.append(_sweep_t(t, c, (w13, w2), args.quick))
        payload = {"shape": dict(c), "code_hash": code_hash(),
                   "timing": "common.bench_graph (CUDA-graph replay), align + both kernels",
                   "ts": list(ts), "rows": rows}  # fmt: skip
        common.write_json(args.out, "moe_experts_sweep", payload)


if __name__ == "__main__":
    main()
