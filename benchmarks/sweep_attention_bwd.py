"""Sweep of launch configurations for the Triton attention backward (pick the shipped ones).

Usage: ``python3 benchmarks/sweep_attention_bwd.py --out DIR [--quick]``.

Causal varlen attention, bf16, head dim 128, the trainer's shapes: 2 x 4096 tokens with 16 / 8
heads (``bench_trainer_hf.py``'s model) and 1 x 16384 tokens with 32 / 8. The backward's two main
kernels are timed separately (``attention_bwd(..., kernels=("dkdv",))`` / ``("dq",)``) for each
:class:`BwdKernelConfig` candidate (rows / KV positions per tile, warps, pipeline stages). Each
candidate's gradients are checked against the shipped configuration's (gradient tolerance of
bf16: only the order of the fp32 sums differs) and against themselves run twice (bitwise: the
backward is deterministic for every configuration). TFLOP/s counts the causal half
(dK/dV: 3 GEMMs of the tile, dQ: 2, 2 * d flops each). For reference it times SDPA's
(flash / cuDNN) forward + backward on the same tensors. Prints a table per kernel and writes
``DIR/attention_bwd_sweep.json`` with the best candidate of each. To ship one, edit
``_BWD_CONFIGS`` in ``rl_engine/ops/attention/triton.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402

from rl_engine.ops.attention import triton as at  # noqa: E402
from rl_engine.testing.tolerances import tolerance  # noqa: E402

Cfg = at.BwdKernelConfig
SHAPES = [  # (batch, seq, q heads, kv heads, head dim)
    (2, 4096, 16, 8, 128),
    (1, 16384, 32, 8, 128),
]


def candidates(kind: str, quick: bool) -> list[Cfg]:
    shipped = at._BWD_CONFIGS[128][0 if kind == "dkdv" else 1]
    if kind == "dkdv":  # block_n: KV positions held by a program; block_m: row tile of the loop
        tiles = [(32, 128), (64, 128), (64, 64), (16, 128)]
    else:  # block_m: rows held by a program; block_n: KV tile of the loop
        tiles = [(128, 64), (128, 32), (64, 64), (64, 128)]
    warps = (4, 8)
    stages = (1, 2, 3) if not quick else (1, 3)
    out = [shipped]
    for (bm, bn), w, st in itertools.product(tiles, warps, stages):
        c = Cfg(bm, bn, w, st)
        if c not in out:
            out.append(c)
    return out


def _inputs(b: int, s: int, hq: int, hkv: int, d: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = b * s
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
    scale = d**-0.5
    out, lse = at.attention(q, k, v, cu, scale, True)
    return dict(q=q, k=k, v=v, do=do, cu=cu, scale=scale, out=out, lse=lse)


def _run(x: dict[str, Any], kind: str, cfgs: tuple[Cfg, Cfg]) -> tuple[torch.Tensor, ...]:
    dq, dk, dv = at.attention_bwd(
        x["do"],
        x["q"],
        x["k"],
        x["v"],
        x["out"],
        x["lse"],
        x["cu"],
        x["scale"],
        True,
        bwd_configs=cfgs,
        kernels=("delta", kind),
    )
    return (dk, dv) if kind == "dkdv" else (dq,)


def _sdpa_ms(x: dict[str, Any], b: int, s: int, quick: bool) -> dict[str, float]:
    import torch.nn.functional as F

    def lay(t):  # [b*s, h, d] -> [b, h, s, d]
        return t.view(b, s, t.shape[1], t.shape[2]).transpose(1, 2).detach().requires_grad_()

    q, k, v = lay(x["q"]), lay(x["k"]), lay(x["v"])
    do = x["do"].view(b, s, -1, x["do"].shape[-1]).transpose(1, 2)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwdbwd():
        fwd().backward(do)

    return {
        "sdpa_fwd_ms": common.bench(fwd, quick=quick) / 1e3,
        "sdpa_fwd_bwd_ms": common.bench(fwdbwd, quick=quick) / 1e3,
    }


def main() -> None:
    args = common.cuda_args(__doc__, "sweep_attention_bwd.py needs a CUDA device; nothing measured")
    if args is None:
        return
    rtol, atol = tolerance(torch.bfloat16, grad=True)
    shipped = at._BWD_CONFIGS[128]
    report: dict[str, Any] = {"shapes": [], "best": {}}
    # (kernel, config) -> times of the shapes where it ran deterministic and close
    times: dict[tuple[str, Cfg], list[float]] = {}
    for b, s, hq, hkv, d in SHAPES:
        x = _inputs(b, s, hq, hkv, d)
        flop_tile = 2 * d * b * hq * s * s / 2  # one causal [s, s] GEMM per head, 2*d flops
        entry: dict[str, Any] = {"shape": [b, s, hq, hkv, d], "rows": []}
        entry.update(_sdpa_ms(x, b, s, args.quick))
        for kind in ("dkdv", "dq"):
            ref = _run(x, kind, shipped)
            n_gemm = 3 if kind == "dkdv" else 2
            for c in candidates(kind, args.quick):
                cfgs = (c, shipped[1]) if kind == "dkdv" else (shipped[0], c)
                row: dict[str, Any] = {"kernel": kind, **dataclasses.asdict(c)}
                try:
                    got = _run(x, kind, cfgs)
                    again = _run(x, kind, cfgs)
                    row["deterministic"] = all(torch.equal(a, b2) for a, b2 in zip(got, again))
                    row["max_rel_err_vs_shipped"] = max(
                        float((a.float() - r.float()).abs().max() / r.float().abs().max())
                        for a, r in zip(got, ref)
                    )
                    row["close"] = all(
                        torch.allclose(a.float(), r.float(), rtol=rtol, atol=atol)
                        for a, r in zip(got, ref)
                    )
                    ms = (
                        common.bench(functools.partial(_run, x, kind, cfgs), quick=args.quick) / 1e3
                    )
                    row["ms"] = ms
                    row["tflop_s"] = n_gemm * flop_tile / (ms * 1e-3) / 1e12
                    if row["deterministic"] and row["close"]:
                        times.setdefault((kind, c), []).append(ms)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile / fit
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                entry["rows"].append(row)
                print(
                    {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                    flush=True,
                )
        report["shapes"].append(entry)
        print(
            f"SDPA {b}x{s} {hq}/{hkv}: fwd {entry['sdpa_fwd_ms']:.2f} ms, "
            f"fwd+bwd {entry['sdpa_fwd_bwd_ms']:.2f} ms",
            flush=True,
        )
    n_shapes = len(SHAPES)
    for kind in ("dkdv", "dq"):
        # ranked by the summed time; a candidate must have run well on every shape
        full = {c: sum(ts) for (k, c), ts in times.items() if k == kind}
        ranked = sorted(
            ((sum(ts), c) for (k, c), ts in times.items() if k == kind and len(ts) == n_shapes),
            key=lambda tc: tc[0],
        )
        shipped_c = shipped[0 if kind == "dkdv" else 1]
        report["best"][kind] = {
            "config": dataclasses.asdict(ranked[0][1]) if ranked else None,
            "total_ms": ranked[0][0] if ranked else None,
            "shipped_total_ms": full.get(shipped_c),
            "top5": [{"total_ms": t, **dataclasses.asdict(c)} for t, c in ranked[:5]],
        }
        print(
            kind,
            "best:",
            report["best"][kind]["top5"][:3],
            "shipped:",
            report["best"][kind]["shipped_total_ms"],
            flush=True,
        )
    common.write_json(args.out, "attention_bwd_sweep", report)


if __name__ == "__main__":
    main()
