"""Benchmark of ``rope`` (Triton provider) against stock torch and the copy bandwidth.

Usage: ``python benchmarks/bench_rope.py [--out DIR] [--quick]``.

Writes ``DIR/rope.json`` and ``DIR/rope.png``. bf16 q and k of the shared attention shapes
(heads x head_dim), Llama-3 scaling, per token count: the ``triton`` provider (tables computed
inside the kernel) vs the ``stock`` provider (torch cos/sin tables + rotation) and vs the
``native`` reference (same bits as triton). ``bw_frac`` = (read x + write y + positions) / time /
measured device copy bandwidth. ``qk_rows``: the q and k of one attention layer (strided views
of a fused QKV output) in one ``rope_qk`` launch vs two ``rope`` launches, CUDA-graph timed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import ATTENTION_HEADS  # noqa: E402

from rl_engine.ops.rope import reference as rope_ref  # noqa: E402
from rl_engine.ops.rope import stock as rope_stock  # noqa: E402
from rl_engine.ops.rope import triton as rope_triton  # noqa: E402

TOKENS = (1, 64, 1024, 4096, 16384)
THETA = 500000.0
SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def run(args, copy_tb_s: float) -> list[dict]:
    rows = []
    heads = sorted(
        {(q, d) for q, _, d in ATTENTION_HEADS} | {(k, d) for _, k, d in ATTENTION_HEADS}
    )
    for t in (1, 1024, 16384) if args.quick else TOKENS:
        for nh, hd in heads:
            rows.append(_case(args, copy_tb_s, t, nh, hd))
    return rows


def _case(args, copy_tb_s: float, t: int, nh: int, hd: int) -> dict:
    x = torch.randn(t, nh, hd, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 131072, (t,), device="cuda")
    args_ = (pos, THETA, hd, True, SCALING)
    y = rope_triton.rope(x, *args_)
    same = torch.equal(y, rope_ref.rope(x, *args_))
    tm = {
        "triton": common.bench(lambda: rope_triton.rope(x, *args_), quick=args.quick),
        "stock": common.bench(lambda: rope_stock.rope(x, *args_), quick=args.quick),
        "native": common.bench(lambda: rope_ref.rope(x, *args_), quick=args.quick),
    }
    nbytes = 2 * x.numel() * x.element_size() + pos.numel() * 8
    r = {
        "tokens": t,
        "heads": nh,
        "head_dim": hd,
        "dtype": "bf16",
        **{f"{k}_us": v for k, v in tm.items()},
        "bw_frac": nbytes / (tm["triton"] * 1e-6) / 1e12 / copy_tb_s,
        "ratio_vs_stock": tm["stock"] / tm["triton"],
        "ratio_vs_native": tm["native"] / tm["triton"],
        "bitwise_equal_native": same,
    }
    return common.progress(
        r,
        "rope T={tokens:6d} heads={heads:3d}x{head_dim}  triton {triton_us:8.1f} us "
        "({bw_frac:.2f} copy, {ratio_vs_stock:.2f}x stock, {ratio_vs_native:.1f}x native, "
        "== native: {bitwise_equal_native})",
    )


# q / k of one attention layer (bench_rollout's ~1B Qwen2: 16 query, 8 KV heads of 128)
QK_HEADS = (16, 8, 128)


def run_qk(args) -> list[dict]:
    """q and k of one layer: two ``rope`` launches vs one ``rope_qk`` launch (CUDA-graph replay,
    GPU time only, as vLLM's decode runs them), on the strided views of a fused QKV output."""
    tokens = (1, 64, 256, 4096) if args.quick else (1, 16, 64, 256, 1024, 4096, 16384)
    return [_qk_case(args, t) for t in tokens]


def _qk_case(args, t: int) -> dict:
    hq, hk, hd = QK_HEADS
    qkv = torch.randn(t, (hq + 2 * hk) * hd, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * hd].view(t, hq, hd)
    k = qkv[:, hq * hd : (hq + hk) * hd].view(t, hk, hd)
    pos = torch.randint(0, 32768, (t,), device="cuda")
    kw = (10000.0, hd, True, None)
    yq, yk = rope_triton.rope_qk(q, k, pos, *kw)
    same = torch.equal(yq, rope_ref.rope(q, pos, *kw)) and torch.equal(
        yk, rope_ref.rope(k, pos, *kw)
    )
    sets = common.cold_copies([qkv, pos])

    def views(qkv_, pos_):
        return (
            qkv_[:, : hq * hd].view(t, hq, hd),
            qkv_[:, hq * hd : (hq + hk) * hd].view(t, hk, hd),
            pos_,
        )

    def two(qkv_, pos_):
        q_, k_, p_ = views(qkv_, pos_)
        return rope_triton.rope(q_, p_, *kw), rope_triton.rope(k_, p_, *kw)

    def one(qkv_, pos_):
        q_, k_, p_ = views(qkv_, pos_)
        return rope_triton.rope_qk(q_, k_, p_, *kw)

    tm = {
        name: common.bench_graph(fn, sets, quick=args.quick)
        for name, fn in (("two_launches", two), ("rope_qk", one))
    }
    r = {
        "tokens": t,
        "q_heads": hq,
        "k_heads": hk,
        "head_dim": hd,
        **{f"{k}_us": v for k, v in tm.items()},
        "speedup_vs_two_launches": tm["two_launches"] / tm["rope_qk"],
        "bitwise_equal_native": same,
    }
    return common.progress(
        r,
        "rope_qk T={tokens:6d} {q_heads}+{k_heads}x{head_dim}: one launch {rope_qk_us:7.1f} us, "
        "two {two_launches_us:7.1f} us (== native: {bitwise_equal_native})",
    )


def plot(rows: list[dict], path: Path) -> None:
    def draw(ax):
        common.bw_lines(ax, rows, group=lambda r: (r["heads"], r["head_dim"]),
                        label=lambda g: f"{g[0]}x{g[1]}", x="tokens", y="bw_frac",
                        title="rope triton bf16 (llama3 scaling)", xlabel="tokens")  # fmt: skip

    common.save_figure(path, draw)


def summarize(rows: list[dict], qk_rows: list[dict]) -> dict:
    big = [r for r in rows if r["tokens"] >= 4096]
    return {
        "bw_frac_large": common.geomean([r["bw_frac"] for r in big]),
        "geomean_vs_stock": common.geomean([r["ratio_vs_stock"] for r in rows]),
        "geomean_vs_native": common.geomean([r["ratio_vs_native"] for r in rows]),
        "all_bitwise_equal_native": all(r["bitwise_equal_native"] for r in rows + qk_rows),
        "rope_qk_speedup_vs_two_launches": {
            r["tokens"]: round(r["speedup_vs_two_launches"], 3) for r in qk_rows
        },
    }


def main() -> None:
    common.op_main(
        __doc__, "bench_rope", "rope", run, summarize, plot=plot, digits=None,
        more=lambda args: {"qk_rows": run_qk(args)},
        baseline="rl_engine rope stock provider (torch cos/sin + rotation)",
        ratio="baseline_us / triton_us (higher is better)",
        bw="bytes moved / time / measured copy bandwidth",
        qk_definition="q and k of one layer from a fused QKV buffer (strided views): two rope "
        "launches vs one rope_qk launch; CUDA-graph replay over cold copies (GPU time per "
        "layer; the stock provider builds its tables on the host, so it is not "
        "graph-capturable and is compared in rows instead)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
