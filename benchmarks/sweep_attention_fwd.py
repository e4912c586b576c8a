"""Sweep of launch configurations for the Triton attention forward (prefill and paged decode).

Usage: ``python3 benchmarks/sweep_attention_fwd.py --out DIR [--quick]``.

The forward's numerics are its KV tile (``block_n``, aligned to position 0), the order of the
tiles, and the register layout of the score tile that the row tile (``block_m``) and the warp
count set (the order of the softmax row sums); the pipeline depth is free. This script checks
every candidate against the shipped launch (``torch.equal`` of the output, and of the
log-sum-exp in prefill) and times it. Equal bits on these shapes do not make a launch safe to
mix with the shipped one (a 16-row decode launch equal here differed by 1 ulp on chunked
prefill of short sequences: ``docs/operators/attention.md``); only the pipeline depth may
change without a new numerics family.

* prefill, causal varlen, bf16, head dim 128: 1 x 4096 tokens (32 / 8 heads), 2 x 4096 (16 / 8),
  1 x 16384 (32 / 8); SDPA's forward on the same tensors for reference (its default backend,
  cuDNN where torch picks it: ``bench_attention.py`` is the flash-only comparison);
* decode: 64 sequences x 4096 context, pages of 16 (scattered), one query token each (32 / 8),
  reported as KV bandwidth.

Prints each candidate and the best per case, and writes ``DIR/attention_fwd_sweep.json``. A
candidate that changes a bit is reported and never ranked. To ship one, edit ``_CONFIGS`` in
``rl_engine/ops/attention/triton.py``.
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

Cfg = at.AttentionConfig
D = 128
PREFILL = [(1, 4096, 32, 8), (2, 4096, 16, 8), (1, 16384, 32, 8)]  # (batch, seq, Hq, Hkv)
DECODE = (64, 4096, 16, 32, 8)  # (sequences, context, page, Hq, Hkv)


def candidates(decode: bool, quick: bool) -> list[Cfg]:
    shipped = at.get_config(D)
    rows = (16, 32, 64) if decode else (64, 128)
    warps = (4, 8)
    stages = (1, 2, 3, 4) if not quick else (1, 3)
    out = [shipped]
    for bm, w, st in itertools.product(rows, warps, stages):
        c = Cfg(bm, shipped.block_n, w, st)
        if c not in out:
            out.append(c)
    return out


def _prefill_inputs(b: int, s: int, hq: int, hkv: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = b * s
    q = torch.randn(t, hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
    return dict(q=q, k=k, v=v, cu=cu, b=b, s=s)


def _prefill(x: dict[str, Any], cfg: Cfg) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x["q"])
    lse = torch.empty(x["q"].shape[:2], dtype=torch.float32, device="cuda")
    at._launch_fwd(x["q"], x["k"], x["v"], out, lse, x["cu"], None, None, D**-0.5, True, config=cfg)
    return out, lse


def _decode_inputs() -> dict[str, Any]:
    n, ctx, bs, hq, hkv = DECODE
    pages = ctx // bs
    gen = torch.Generator().manual_seed(0)
    bt = torch.randperm(n * pages, generator=gen).view(n, pages).to("cuda", torch.int32)
    g = torch.Generator(device="cuda").manual_seed(1)
    kc = torch.randn(n * pages, bs, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(n * pages, bs, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(n, hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((n,), ctx, device="cuda", dtype=torch.int32)
    qsl = torch.arange(n + 1, device="cuda", dtype=torch.int32)
    return dict(q=q, k=kc, v=vc, bt=bt, lens=lens, qsl=qsl)


def _decode(x: dict[str, Any], cfg: Cfg) -> tuple[torch.Tensor]:
    out = torch.zeros_like(x["q"])
    at._launch_fwd(
        x["q"], x["k"], x["v"], out, None, x["qsl"], x["lens"], x["bt"], D**-0.5, True, config=cfg
    )
    return (out,)


def _sdpa_fwd_us(x: dict[str, Any], quick: bool) -> float:
    import torch.nn.functional as F

    b, s = x["b"], x["s"]

    def lay(t):
        return t.view(b, s, t.shape[1], D).transpose(1, 2)

    q, k, v = lay(x["q"]), lay(x["k"]), lay(x["v"])
    return common.bench(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        quick=quick,
    )


def _sweep(
    name: str, launch, x: dict[str, Any], decode: bool, quick: bool, work: float, unit: str
) -> dict:
    """Every candidate of :func:`candidates` (``decode`` or prefill) launched by
    ``launch(x, cfg)``: bitwise vs the shipped launch, run twice, timed; ``work`` / time in
    ``unit`` (TFLOP/s or TB/s)."""
    cands = candidates(decode, quick)
    run = functools.partial(launch, x)
    ref = run(cands[0])
    rows = []
    for c in cands:
        row: dict[str, Any] = {**dataclasses.asdict(c)}
        try:
            got, again = run(c), run(c)
            row["bitwise_vs_shipped"] = all(torch.equal(a, r) for a, r in zip(got, ref))
            row["deterministic"] = all(torch.equal(a, b) for a, b in zip(got, again))
            us = common.bench(functools.partial(run, c), quick=quick)
            row["us"] = us
            row[unit] = work / (us * 1e-6) / 1e12
        except Exception as exc:  # noqa: BLE001 - a launch that does not compile / fit
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
              flush=True)  # fmt: skip
    ok = [r for r in rows if r.get("bitwise_vs_shipped") and r.get("deterministic")]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    return {"case": name, "rows": rows, "best": best, "shipped": rows[0]}


def main() -> None:
    args = common.cuda_args(__doc__, "sweep_attention_fwd.py needs a CUDA device; nothing measured")
    if args is None:
        return
    report: dict[str, Any] = {"cases": []}
    for b, s, hq, hkv in PREFILL:
        x = _prefill_inputs(b, s, hq, hkv)
        flop = 4 * D * b * hq * s * s / 2  # QK^T and PV, causal half
        res = _sweep(f"prefill {b}x{s} {hq}/{hkv}", _prefill, x, False, args.quick, flop, "tflop_s")
        res["sdpa_fwd_us"] = _sdpa_fwd_us(x, args.quick)
        report["cases"].append(res)
        del x
    x = _decode_inputs()
    n, ctx, _, _, hkv = DECODE
    kv_bytes = 2 * n * ctx * hkv * D * 2
    report["cases"].append(
        _sweep(f"decode {n}x{ctx}", _decode, x, True, args.quick, kv_bytes, "tb_s")
    )
    for c in report["cases"]:
        best, shipped = c["best"], c["shipped"]
        extra = f", SDPA {c['sdpa_fwd_us']:.1f} us" if "sdpa_fwd_us" in c else ""
        print(
            f"{c['case']}: shipped {shipped.get('us', float('nan')):.1f} us, best "
            f"{best and {k: best[k] for k in ('block_m', 'num_warps', 'num_stages', 'us')}}{extra}",
            flush=True,
        )
    common.write_json(args.out, "attention_fwd_sweep", report)


if __name__ == "__main__":
    main()
