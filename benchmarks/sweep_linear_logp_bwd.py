"""Tuning sweep of the fused LM-head backward (``linear_logp``'s ``det_gemm_wgrad`` launches).

Usage: ``python benchmarks/sweep_linear_logp_bwd.py [--out DIR] [--quick]``.

One backward block of the benchmark shape (8192 tokens x a 16384-column vocabulary slice,
H = 4096, bf16): the two weight-gradient-style products it runs (``dW = dlogits.t() @ h`` and
``dX = dlogits @ W``, fp32 out) with every candidate ``WgradConfig`` (launch choices only: the
outputs must be bitwise equal, checked here) against cuBLAS on the same products; then the
whole ``linear_logp`` forward + backward (T = 8192, V = 151936) with each candidate as the
table's config, against the three cuBLAS GEMMs. Writes ``DIR/linear_logp_bwd_sweep.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402

from rl_engine.ops import linear_logp  # noqa: E402
from rl_engine.ops.det_gemm import config as gemm_config  # noqa: E402
from rl_engine.ops.det_gemm import triton as gemm_triton  # noqa: E402

W = gemm_config.WgradConfig
CANDIDATES = {
    "128x128x64 w8 s4 (table)": gemm_config._WGRAD_16BIT,
    "128x256x64 w8 s3": W(128, 256, 64, num_warps=8, num_stages=3, tma=True),
    "128x256x64 w8 s4": W(128, 256, 64, num_warps=8, num_stages=4, tma=True),
    "256x128x64 w8 s3": W(256, 128, 64, num_warps=8, num_stages=3, tma=True),
}


def main() -> None:
    args = common.cuda_args(__doc__, "sweep_linear_logp_bwd: no CUDA device; nothing to measure")
    if args is None:
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    t, vs, h = 8192, 16384, 4096
    block = (torch.randn(t, vs, device="cuda", generator=g) * 1e-3).bfloat16()
    hid = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vs, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    rows, outs = [], {}
    base = {
        "cublas dW": common.bench(lambda b=block, x=hid: b.t() @ x, quick=args.quick),
        "cublas dX": common.bench(lambda b=block, x=w: b @ x, quick=args.quick),
    }
    print(base, flush=True)
    for name, cfg in CANDIDATES.items():
        r = {"config": name}
        for what, a, grad in (("dW", block, hid), ("dX", block.t(), w)):
            fn = lambda a=a, grad=grad, cfg=cfg: gemm_triton.det_gemm_wgrad_with_plan(  # noqa: E731
                a, grad, split=None, cfg=cfg, tma=True
            )
            out = fn()
            ref = outs.setdefault(what, out)
            r[f"{what}_bitwise_equal_table"] = bool(torch.equal(out, ref))
            r[f"{what}_us"] = common.bench(fn, quick=args.quick)
            r[f"{what}_vs_cublas"] = base[f"cublas {what}"] / r[f"{what}_us"]
        rows.append(r)
        print(r, flush=True)
    del block, hid, w, outs
    torch.cuda.empty_cache()

    # whole op with each candidate as the table's config
    tt, vv = 8192, 151936
    hh = torch.randn(tt, h, device="cuda", generator=g).bfloat16().requires_grad_(True)
    ww = (torch.randn(vv, h, device="cuda", generator=g) * h**-0.5).bfloat16().requires_grad_(True)
    tok = torch.randint(0, vv, (tt,), device="cuda", generator=g)
    gl = torch.randn(tt, device="cuda", generator=g)
    big = {"dlogits": (torch.randn(tt, vv, device="cuda", generator=g) * 1e-3).bfloat16()}

    def three() -> None:
        hh.detach() @ ww.detach().t()
        big["dlogits"] @ ww.detach()
        big["dlogits"].t() @ hh.detach()

    t3 = common.bench(three, quick=args.quick)
    big.clear()
    torch.cuda.empty_cache()
    whole = {"three_cublas_gemms_us": t3}
    saved = gemm_config._WGRAD_16BIT
    try:
        for name, cfg in CANDIDATES.items():
            gemm_config._WGRAD_16BIT = cfg

            def fused() -> None:
                lp = linear_logp(hh, ww, tok, 1.0, backend="triton")
                torch.autograd.grad(lp, (hh, ww), gl)

            us = common.bench(fused, quick=args.quick)
            whole[name] = {"fwd_bwd_us": us, "vs_three_gemms": us / t3}
            print(name, whole[name], flush=True)
    finally:
        gemm_config._WGRAD_16BIT = saved
    common.write_json(
        args.out,
        "linear_logp_bwd_sweep",
        {
            "block": {"tokens": t, "vocab_slice": vs, "hidden": h},
            "cublas_us": base,
            "rows": rows,
            "whole_op": whole,
        },  # fmt: skip
    )


if __name__ == "__main__":
    main()
