"""Benchmark of an MoE layer (rl_engine: router, ``moe_experts`` Triton, combine) against vLLM's
fused_moe Triton kernels.

Usage: ``python benchmarks/bench_moe.py [--out DIR] [--quick]``.

Qwen3-30B-A3B's MoE layer (``shapes.QWEN3_30B_A3B_MOE``: hidden 2048, 128 experts, top-8,
expert FFN 768), bf16:

* ``layer``: rl_engine's ``moe_router`` (det_gemm logits + ``moe_topk``, renormalised),
  ``moe_experts`` (the resolved provider: ``triton`` on CUDA) and ``moe_combine``, vs vLLM's
  stock ``F.linear`` gate + ``fused_topk`` + ``fused_experts`` (which also combines);
* ``experts``: the experts alone on the same routing (``moe_experts`` + ``moe_combine`` vs
  ``fused_experts``).

Decode token counts (1..256) are timed as CUDA-graph replays (``common.bench_graph``: no host
launch time, as vLLM decodes), prefill counts (4096..16384) with ``common.bench`` (eager).
``ratio_vs_vllm`` = vllm_us / rl_engine_us (higher is better). ``bw_frac`` (decode): the bytes
of the expert weights the step must read (distinct experts hit x 3 x H x FFN x 2 bytes) / time
/ measured copy bandwidth; ``tflop_s``: 6 x T x k x H x FFN / time. vLLM exists only on the GPU
machine (``scripts`` bring it); without it the baseline columns are empty and the JSON says why.
Writes ``DIR/moe.json`` (device, versions, date, rl_engine code hash, every figure) and prints a
table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import QWEN3_30B_A3B_MOE  # noqa: E402

from rl_engine import KernelRegistry  # noqa: E402
from rl_engine.ops import moe_combine, moe_experts, moe_router  # noqa: E402
from rl_engine.ops.moe_experts import triton as moe_triton  # noqa: E402
from rl_engine.run_info import code_hash  # noqa: E402

DECODE_T = (1, 8, 32, 64, 128, 256)
PREFILL_T = (4096, 8192, 16384)


def _vllm():
    """``(fused_topk, fused_experts, None)`` or ``(None, None, reason)``."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk
    except Exception as exc:  # not installed (CPU machine), or no MoE extension
        return None, None, f"vLLM fused_moe not importable ({type(exc).__name__}: {exc})"
    return fused_topk, fused_experts, None


def _weights(c):
    g = torch.Generator(device="cuda").manual_seed(0)
    h, e, i = c["hidden"], c["experts"], c["ffn"]

    def rnd(*shape, scale):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    return rnd(e, h, scale=h**-0.5), rnd(e, 2 * i, h, scale=h**-0.5), rnd(e, h, i, scale=i**-0.5)


def _ours_layer(x, gate, w13, w2, k):
    w, ids, _ = moe_router(x, gate, k, renormalize=True)
    return moe_combine(moe_experts(x, ids, w13, w2), w)


def _ours_experts(x, w, ids, w13, w2):
    return moe_combine(moe_experts(x, ids, w13, w2), w)


def _vllm_layer(fused_topk, fused_experts, x, gate, w13, w2, k):
    logits = F.linear(x, gate)
    w, ids = fused_topk(x, logits, k, True)[:2]
    return fused_experts(x, w13, w2, w, ids)


def _time(fn, sets, decode: bool, quick: bool) -> float:
    if decode:
        return common.bench_graph(fn, sets, quick=quick)
    return common.bench(lambda: fn(*sets[0]), quick=quick)


def _case(args, copy_tb_s, c, weights, vllm, t: int) -> dict:
    gate, w13, w2 = weights
    fused_topk, fused_experts, why_not = vllm
    h, k, i = c["hidden"], c["top_k"], c["ffn"]
    decode = t <= max(DECODE_T)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids, _ = moe_router(x, gate, k, renormalize=True)
    xs = common.cold_copies([x]) if decode else [(x,)]
    r = {"t": t, "phase": "decode" if decode else "prefill", "dtype": "bf16"}
    r["layer_us"] = _time(lambda xx: _ours_layer(xx, gate, w13, w2, k), xs, decode, args.quick)
    r["experts_us"] = _time(lambda xx: _ours_experts(xx, w, ids, w13, w2), xs, decode, args.quick)
    flops = 6.0 * t * k * h * i
    hit = int(torch.unique(ids).numel())
    wbytes = hit * 3 * h * i * w13.element_size()
    r["experts_hit"] = hit
    r["experts_tflop_s"] = flops / (r["experts_us"] * 1e-6) / 1e12
    r["experts_bw_frac"] = common.bw_frac(wbytes, r["experts_us"], copy_tb_s)
    if decode:  # the slot alignment alone, both paths (sets _ALIGN_KERNEL_MAX_SLOTS)
        bm = moe_triton.get_config(t * k, c["experts"], x.dtype).block_m
        for name, fn in (("torch", moe_triton.align_torch), ("triton", moe_triton.align_triton)):
            r[f"align_{name}_us"] = common.bench_graph(
                lambda ii, fn=fn: fn(ii, c["experts"], bm), [(ids,)], quick=args.quick
            )
    if why_not is None:
        vid = ids.to(torch.int32)
        r["vllm_layer_us"] = _time(
            lambda xx: _vllm_layer(fused_topk, fused_experts, xx, gate, w13, w2, k),
            xs, decode, args.quick,
        )  # fmt: skip
        r["vllm_experts_us"] = _time(
            lambda xx: fused_experts(xx, w13, w2, w, vid), xs, decode, args.quick
        )
        r["layer_ratio_vs_vllm"] = r["vllm_layer_us"] / r["layer_us"]
        r["experts_ratio_vs_vllm"] = r["vllm_experts_us"] / r["experts_us"]
        # sanity: the same routing through both expert paths agrees to bf16 accuracy
        ours = _ours_experts(x, w, ids, w13, w2).float()
        theirs = fused_experts(x, w13, w2, w, vid).float()
        r["experts_max_abs_diff_vs_vllm"] = float((ours - theirs).abs().max())
    return common.progress(
        r,
        "moe T={t:6d} ({phase:7s}) layer {layer_us:9.1f} us, experts {experts_us:9.1f} us "
        "({experts_tflop_s:6.1f} TFLOP/s, {experts_bw_frac:.2f} copy){vs}",
        al=(
            f"  align torch {r['align_torch_us']:.1f} / triton {r['align_triton_us']:.1f} us"
            if "align_torch_us" in r
            else ""
        ),
        vs=(
            f"  vLLM layer {r['vllm_layer_us']:9.1f} us ({r['layer_ratio_vs_vllm']:.2f}x), "
            f"experts {r['vllm_experts_us']:9.1f} us ({r['experts_ratio_vs_vllm']:.2f}x)"
            if "vllm_layer_us" in r
            else ""
        ),
    )


@common.gpu_main(__doc__, "bench_moe")
def main(args: argparse.Namespace, limits: dict[str, float]) -> None:
    c = QWEN3_30B_A3B_MOE
    vllm = _vllm()
    if vllm[2] is not None:
        print(f"bench_moe: {vllm[2]}; measuring rl_engine only (no baseline)")
    weights = _weights(c)
    ts = (1, 64, 256, 4096) if args.quick else DECODE_T + PREFILL_T
    rows = [_case(args, limits["copy_tb_s"], c, weights, vllm, t) for t in ts]
    experts_provider = KernelRegistry.get_op("moe_experts", device="cuda").provider.name
    common.print_table(
        rows,
        ["t", "phase", "layer_us", "vllm_layer_us", "layer_ratio_vs_vllm", "experts_us",
         "vllm_experts_us", "experts_ratio_vs_vllm", "experts_tflop_s", "experts_bw_frac",
         "align_torch_us", "align_triton_us"],
    )  # fmt: skip
    with_base = [r for r in rows if "layer_ratio_vs_vllm" in r]
    summary = {
        **common.geomeans(
            [r for r in with_base if r["phase"] == "decode"],
            geomean_decode_layer_vs_vllm="layer_ratio_vs_vllm",
            geomean_decode_experts_vs_vllm="experts_ratio_vs_vllm",
        ),
        **common.geomeans(
            [r for r in with_base if r["phase"] == "prefill"],
            geomean_prefill_layer_vs_vllm="layer_ratio_vs_vllm",
            geomean_prefill_experts_vs_vllm="experts_ratio_vs_vllm",
        ),
    }
    common.finish_op(
        args, limits, "moe", summary=summary, rows=rows, plot=None,
        provider=experts_provider,
        baseline=(
            "vLLM fused_moe (F.linear gate + fused_topk + fused_experts, Triton)"
            if vllm[2] is None else f"none: {vllm[2]}"
        ),
        ratio="vllm_us / rl_engine_us (higher is better)",
        bw="expert weight bytes read (distinct experts hit) / time / measured copy bandwidth",
        shape=dict(c), code_hash=code_hash(),
        timing="decode: CUDA-graph replay (common.bench_graph); prefill: common.bench (eager)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
