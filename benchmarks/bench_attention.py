"""Benchmark of ``attention`` (Triton provider) against torch SDPA (flash) and copy bandwidth.

Usage: ``python benchmarks/bench_attention.py [--out DIR] [--quick]``.

Writes ``DIR/attention.json`` and ``DIR/attention.png``. bf16, heads from ``shapes.py``
(Llama-3-8B: 32 q / 8 kv heads, D=128):

* prefill, causal, the grid of issue 17 (GQA 32 / 8 and 16 / 8 heads, D=128; 4k and 16k tokens:
  1 x 4096, 4 x 4096 packed, 1 x 16384): forward, and forward + backward, of the ``triton`` provider (public ``rl_engine.ops.attention``, packed varlen) vs
  ``torch.nn.functional.scaled_dot_product_attention`` restricted to the flash backend
  (``enable_gqa=True`` when the flash kernel takes it, else K/V heads repeated beforehand, outside
  the timing; the JSON says which). ``ratio`` = sdpa_us / ours_us (higher is better), TFLOP/s
  count the causal half (``2 * 2 * B * L^2 / 2 * Hq * D`` forward, 2.5x that for the backward);
* decode, 64 sequences x 4096 context, pages of 16 (scattered blocks), one query token each:
  ``paged_attention`` time, KV bytes read / time as a fraction of the measured device copy
  bandwidth (``limits.json``), and SDPA (flash / memory-efficient) over a *contiguous* KV cache
  as a reference point;
* a bitwise check at benchmark scale: the decode output of sequence 0 equals the prefill row of
  its last token (``decode_equals_prefill``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import ATTENTION_HEADS  # noqa: E402

from rl_engine.ops import attention, paged_attention  # noqa: E402

HQ, HKV, D = ATTENTION_HEADS[0]  # Llama-3-8B
SEQ = 4096
# (query heads, KV heads, sequences, tokens per sequence); --quick: the first only
PREFILL_CASES = (
    (HQ, HKV, 1, SEQ),
    (HQ, HKV, 4, SEQ),
    (HQ, HKV, 1, 4 * SEQ),
    (16, HKV, 1, SEQ),
    (16, HKV, 4, SEQ),
    (16, HKV, 1, 4 * SEQ),
)
DECODE_SEQS, DECODE_CTX, PAGE = 64, 4096, 16
DT = torch.bfloat16
DEV = "cuda"  # (a smoke test may point this at the CPU with TRITON_INTERPRET=1)


def _sdpa_flash(q4, k4, v4, gqa: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        if gqa:
            return torch.nn.functional.scaled_dot_product_attention(
                q4, k4, v4, is_causal=True, enable_gqa=True
            )
        return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True)


def _sdpa_setup(q, k, v, b, seq):
    """[B*L, H, D] packed -> [B, H, L, D] views; GQA through enable_gqa or repeated heads."""
    q4, k4, v4 = (x.view(b, seq, x.shape[1], D).transpose(1, 2) for x in (q, k, v))
    try:
        _sdpa_flash(q4, k4, v4, gqa=True)
        return q4, k4, v4, True, "sdpa_flash_enable_gqa"
    except RuntimeError:
        rep = q.shape[1] // k.shape[1]
        k4 = k4.repeat_interleave(rep, dim=1)
        v4 = v4.repeat_interleave(rep, dim=1)
        _sdpa_flash(q4, k4, v4, gqa=False)
        return q4, k4, v4, False, "sdpa_flash_repeat_kv"


def prefill(args, case: tuple[int, int, int, int], backend: str = "triton") -> dict:
    hq, hkv, b, seq = case
    t = b * seq
    q = torch.randn(t, hq, D, device=DEV, dtype=DT)
    k = torch.randn(t, hkv, D, device=DEV, dtype=DT)
    v = torch.randn(t, hkv, D, device=DEV, dtype=DT)
    g = torch.randn(t, hq, D, device=DEV, dtype=DT)
    cu = torch.arange(0, t + 1, seq, device=DEV, dtype=torch.int32)

    def ours_fwd():
        return attention(q, k, v, cu, backend=backend)

    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

    def ours_fwd_bwd():
        out = attention(qg, kg, vg, cu, backend=backend)
        torch.autograd.grad(out, (qg, kg, vg), g)

    q4, k4, v4, gqa, baseline = _sdpa_setup(q, k, v, b, seq)
    g4 = g.view(b, seq, hq, D).transpose(1, 2)
    q4g, k4g, v4g = (x.detach().clone().requires_grad_(True) for x in (q4, k4, v4))

    def sdpa_fwd():
        return _sdpa_flash(q4, k4, v4, gqa)

    def sdpa_fwd_bwd():
        out = _sdpa_flash(q4g, k4g, v4g, gqa)
        torch.autograd.grad(out, (q4g, k4g, v4g), g4)

    tm = {
        "fwd": common.bench(ours_fwd, quick=args.quick),
        "fwd_bwd": common.bench(ours_fwd_bwd, quick=args.quick),
        "sdpa_fwd": common.bench(sdpa_fwd, quick=args.quick),
        "sdpa_fwd_bwd": common.bench(sdpa_fwd_bwd, quick=args.quick),
    }
    flops_fwd = 4.0 * b * seq * seq / 2 * hq * D
    flops_fb = flops_fwd * 3.5  # forward + backward (2.5x the forward)
    r = {
        "case": "prefill",
        "provider": backend,
        "batch": b,
        "seq": seq,
        "heads": [hq, hkv, D],
        "dtype": "bf16",
        "baseline": baseline,
        **{f"{n}_us": val for n, val in tm.items()},
        "fwd_tflop_s": flops_fwd / (tm["fwd"] * 1e-6) / 1e12,
        "fwd_bwd_tflop_s": flops_fb / (tm["fwd_bwd"] * 1e-6) / 1e12,
        "sdpa_fwd_tflop_s": flops_fwd / (tm["sdpa_fwd"] * 1e-6) / 1e12,
        "sdpa_fwd_bwd_tflop_s": flops_fb / (tm["sdpa_fwd_bwd"] * 1e-6) / 1e12,
        "fwd_ratio_vs_sdpa": tm["sdpa_fwd"] / tm["fwd"],
        "fwd_bwd_ratio_vs_sdpa": tm["sdpa_fwd_bwd"] / tm["fwd_bwd"],
    }
    return common.progress(
        r,
        "attention[{provider}] prefill {heads} B={batch} L={seq}: fwd {fwd_us:9.1f} us "
        "({fwd_tflop_s:.0f} TFLOP/s, {fwd_ratio_vs_sdpa:.2f}x sdpa)  fwd+bwd {fwd_bwd_us:9.1f} us "
        "({fwd_bwd_ratio_vs_sdpa:.2f}x sdpa) [{baseline}]",
    )


def decode(args, copy_tb_s: float, backend: str = "triton") -> dict:
    n, ctx, bs = DECODE_SEQS, DECODE_CTX, PAGE
    pages = ctx // bs
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(n * pages, generator=gen).to(DEV)
    block_table = perm.view(n, pages).to(torch.int32)
    k_cache = torch.randn(n * pages, bs, HKV, D, device=DEV, dtype=DT)
    v_cache = torch.randn(n * pages, bs, HKV, D, device=DEV, dtype=DT)
    q = torch.randn(n, HQ, D, device=DEV, dtype=DT)
    seq_lens = torch.full((n,), ctx, device=DEV, dtype=torch.int32)
    qsl = torch.arange(n + 1, device=DEV, dtype=torch.int32)

    def ours():
        return paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl, backend=backend)

    # the same KV, contiguous [n, Hkv, ctx, D], for SDPA
    kc = k_cache[block_table.long()].reshape(n, ctx, HKV, D).transpose(1, 2).contiguous()
    vc = v_cache[block_table.long()].reshape(n, ctx, HKV, D).transpose(1, 2).contiguous()
    q4 = q.view(n, HQ, 1, D)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(kk=kc, vv=vc, gqa=True):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=gqa)

    baseline = "sdpa_contiguous_enable_gqa"
    try:
        sdpa()
        t_sdpa = common.bench(sdpa, quick=args.quick)
    except RuntimeError:
        baseline = "sdpa_contiguous_repeat_kv"
        kr, vr = (x.repeat_interleave(HQ // HKV, dim=1) for x in (kc, vc))
        t_sdpa = common.bench(lambda: sdpa(kr, vr, False), quick=args.quick)
        del kr, vr
    t = common.bench(ours, quick=args.quick)
    kv_bytes = 2 * n * ctx * HKV * D * k_cache.element_size()
    r = {
        "case": "decode",
        "provider": backend,
        "seqs": n,
        "context": ctx,
        "page": bs,
        "heads": [HQ, HKV, D],
        "dtype": "bf16",
        "us": t,
        "baseline": baseline,
        "sdpa_contiguous_us": t_sdpa,
        "kv_bytes": kv_bytes,
        "kv_tb_s": kv_bytes / (t * 1e-6) / 1e12,
        "kv_bw_frac": kv_bytes / (t * 1e-6) / 1e12 / copy_tb_s,
        "ratio_vs_sdpa_contiguous": t_sdpa / t,
    }
    # bitwise: decode of sequence 0 == its prefill's last row
    pos = torch.arange(ctx, device=DEV)
    k0 = k_cache[block_table[0].long()[pos // bs], pos % bs]
    v0 = v_cache[block_table[0].long()[pos // bs], pos % bs]
    q0 = torch.randn(ctx, HQ, D, device=DEV, dtype=DT)
    q0[-1] = q[0]
    cu = torch.tensor([0, ctx], device=DEV, dtype=torch.int32)
    full = attention(q0, k0, v0, cu, backend=backend)
    r["decode_equals_prefill"] = bool(torch.equal(ours()[0], full[-1]))
    return common.progress(
        r,
        "attention[{provider}] decode {seqs} x {context} page {page}: {us:9.1f} us, "
        "KV {kv_tb_s:.2f} TB/s ({kv_bw_frac:.2f} of copy), sdpa(contiguous) "
        "{sdpa_contiguous_us:9.1f} us; decode == prefill: {decode_equals_prefill}",
    )


def plot(rows: list[dict], path: Path) -> None:
    def draw(axes):
        pre = [r for r in rows if r["case"] == "prefill"]
        labels = [
            f"{'split ' if r['provider'] != 'triton' else ''}{r['heads'][0]}/{r['heads'][1]}\n"
            f"{r['batch']}x{r['seq'] // 1024}k"
            for r in pre
        ]
        x = range(len(pre))
        axes[0].bar([i - 0.2 for i in x], [r["fwd_ratio_vs_sdpa"] for r in pre], 0.4, label="fwd")
        axes[0].bar(
            [i + 0.2 for i in x], [r["fwd_bwd_ratio_vs_sdpa"] for r in pre], 0.4, label="fwd+bwd"
        )
        axes[0].set_xticks(list(x), labels)
        axes[0].axhline(1.0, color="k", lw=0.8)
        axes[0].axhline(0.9, color="C0", lw=0.8, ls="--", label="target fwd")
        axes[0].axhline(0.8, color="C1", lw=0.8, ls="--", label="target fwd+bwd")
        axes[0].set_ylabel("SDPA flash time / rl_engine time")
        axes[0].set_title(f"causal prefill, q/kv heads, sequences x tokens, D={D}, bf16")
        axes[0].legend(loc="lower right")
        dec = [r for r in rows if r["case"] == "decode"]
        axes[1].bar([r["provider"] for r in dec], [r["kv_bw_frac"] for r in dec])
        axes[1].axhline(1.0, color="k", lw=0.8)
        axes[1].set_ylabel("KV bytes / time / copy bandwidth")
        axes[1].set_title(f"decode {DECODE_SEQS} x {DECODE_CTX}, page {PAGE}")

    common.save_figure(path, draw, ncols=2, figsize=(14, 4))


def run(args, copy_tb_s: float) -> list[dict]:
    """Prefill rows (one batch with ``--quick``), the decode row, then the split family's
    prefill and decode rows (KV splits fixed in positions: split-KV decode, same bits as its
    prefill)."""
    rows = [prefill(args, c) for c in (PREFILL_CASES[:1] if args.quick else PREFILL_CASES)]
    rows.append(decode(args, copy_tb_s))
    rows.append(prefill(args, PREFILL_CASES[0], "triton_split"))
    rows.append(decode(args, copy_tb_s, "triton_split"))
    return rows


def summarize(rows: list[dict]) -> dict:
    pre, dec = rows[0], rows[-3]  # the first triton prefill row, the triton decode row
    pre_s, dec_s = rows[-2], rows[-1]
    grid = [r for r in rows if r["case"] == "prefill" and r["provider"] == "triton"]
    return {
        "grid_fwd_ratio_min": min(r["fwd_ratio_vs_sdpa"] for r in grid),
        "grid_fwd_ratio_geomean": common.geomean([r["fwd_ratio_vs_sdpa"] for r in grid]),
        "grid_fwd_bwd_ratio_min": min(r["fwd_bwd_ratio_vs_sdpa"] for r in grid),
        "grid_fwd_bwd_ratio_geomean": common.geomean([r["fwd_bwd_ratio_vs_sdpa"] for r in grid]),
        "target_fwd_ratio": 0.9,
        "target_fwd_bwd_ratio": 0.8,
        "prefill_fwd_ratio_vs_sdpa": pre["fwd_ratio_vs_sdpa"],
        "prefill_fwd_bwd_ratio_vs_sdpa": pre["fwd_bwd_ratio_vs_sdpa"],
        "prefill_fwd_tflop_s": pre["fwd_tflop_s"],
        "decode_kv_bw_frac": dec["kv_bw_frac"],
        "decode_ratio_vs_sdpa_contiguous": dec["ratio_vs_sdpa_contiguous"],
        "decode_equals_prefill": dec["decode_equals_prefill"],
        "split_prefill_fwd_ratio_vs_sdpa": pre_s["fwd_ratio_vs_sdpa"],
        "split_prefill_fwd_bwd_ratio_vs_sdpa": pre_s["fwd_bwd_ratio_vs_sdpa"],
        "split_decode_kv_bw_frac": dec_s["kv_bw_frac"],
        "split_decode_equals_prefill": dec_s["decode_equals_prefill"],
    }


def main() -> None:
    common.op_main(
        __doc__, "bench_attention", "attention", run, summarize, plot=plot, digits=None,
        provider="triton (and triton_split rows)",
        baseline="torch SDPA flash (prefill); SDPA flash/efficient over contiguous KV (decode)",
        ratio="baseline_us / ours_us (higher is better)",
        bw="KV bytes read / time / measured device copy bandwidth",
    )  # fmt: skip


if __name__ == "__main__":
    main()
