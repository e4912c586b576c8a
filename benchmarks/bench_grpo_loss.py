"""Benchmark of ``grpo_loss`` (Triton provider) against torch baselines measured in the same run.

Usage: ``python benchmarks/bench_grpo_loss.py [--out DIR] [--quick]`` (needs a CUDA device; on
a machine without one it prints why and exits 0 without writing anything).

Two parts, forward + backward each, time (``triton.testing.do_bench`` median) and peak memory
(``torch.cuda.max_memory_allocated`` above what the inputs hold):

1. **Loss only** on [B, T] bf16 log-probs (clip-higher, k3 KL penalty, token-mean and
   seq-mean-token-mean): ``grpo_loss(backend="triton")`` vs the same math in eager torch
   (autograd; stock ``torch.sum`` reductions, not invariant), and the effective bandwidth of the
   Triton path against the measured copy bandwidth.
2. **From the LM head** (B*T = 8192 tokens, H = 4096, V = 151936, bf16): materialised torch
   (``h @ W.T`` -> fp32 ``log_softmax`` -> gather -> loss) and chunked torch (the same per
   1024-token chunk under activation checkpointing, the usual memory-bounded trainer path) as
   baselines; and, when ``rl_engine.ops.linear_logp`` has a ``triton`` provider, the fused
   ``linear_logp`` + ``grpo_loss`` path (no [tokens, vocab] tensor).

Writes ``DIR/grpo_loss.json`` (device, versions, every figure; ``ratio`` = baseline time /
rl_engine time, > 1 means rl_engine is faster) and ``DIR/grpo_loss.png`` when matplotlib is
importable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import HIDDEN_SIZES, VOCAB_SIZES  # noqa: E402

from rl_engine import KernelRegistry  # noqa: E402
from rl_engine.ops import grpo_loss  # noqa: E402

# [B, T] of the loss-only part: 8192 tokens in three layouts, and a 64k-token step.
LOSS_SHAPES = ((16, 512), (8, 1024), (64, 128), (64, 1024))
LOSS_AGGS = ("token-mean", "seq-mean-token-mean")
OPTS = dict(clip_low=0.2, clip_high=0.28, kl_beta=0.04)
# LM-head part: 8192 tokens, Llama-3-8B / Qwen3-8B hidden size, Qwen vocabulary.
HEAD_B, HEAD_T = 16, 512
HEAD_H = HIDDEN_SIZES[1]  # 4096
HEAD_V = VOCAB_SIZES[1]  # 151936
CHUNK = 1024


def _inputs(b: int, t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    lp = torch.randn(b, t, device="cuda", generator=g) * 0.5 - 1.5
    old = lp + torch.randn(b, t, device="cuda", generator=g) * 0.1
    ref = lp + torch.randn(b, t, device="cuda", generator=g) * 0.1
    return dict(
        logp=lp.bfloat16(),
        old_logp=old.bfloat16(),
        ref_logp=ref.bfloat16(),
        advantages=torch.randn(b, device="cuda", generator=g),
        mask=torch.rand(b, t, device="cuda", generator=g) > 0.1,
    )


def torch_grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor,
    loss_agg: str,
    clip_low: float,
    clip_high: float,
    kl_beta: float,
) -> torch.Tensor:
    """The usual eager-torch GRPO / DAPO loss (verl / TRL style; stock reductions)."""
    m = mask.float()
    lr = (logp.float() - old_logp.float()).clamp(-20.0, 20.0)
    r = torch.exp(lr)
    a = advantages.float()[:, None]
    pg = torch.maximum(-a * r, -a * r.clamp(1 - clip_low, 1 + clip_high))
    d = (ref_logp.float() - logp.float()).clamp(-20.0, 20.0)
    per_tok = pg + kl_beta * (torch.exp(d) - d - 1)
    if loss_agg == "token-mean":
        return (per_tok * m).sum() / m.sum().clamp(min=1)
    n = m.sum(-1)
    seq = (per_tok * m).sum(-1) / n.clamp(min=1)
    return seq.sum() / (n > 0).sum().clamp(min=1)


def _triton_loss(lp: torch.Tensor, x: dict[str, torch.Tensor], agg: str) -> torch.Tensor:
    """rl_engine's Triton ``grpo_loss`` of the log-probs ``lp`` against the other inputs in
    ``x`` (the benchmark's options)."""
    return grpo_loss(
        lp,
        x["old_logp"],
        x["advantages"],
        x["mask"],
        ref_logp=x["ref_logp"],
        loss_agg=agg,
        backend="triton",
        **OPTS,
    ).loss


def _torch_loss(lp: torch.Tensor, x: dict[str, torch.Tensor], agg: str) -> torch.Tensor:
    """:func:`torch_grpo_loss` of the log-probs ``lp`` against the other inputs in ``x``."""
    return torch_grpo_loss(
        lp, x["old_logp"], x["advantages"], x["mask"], x["ref_logp"], agg, **OPTS
    )


def _loss_fns(x: dict[str, torch.Tensor], agg: str) -> tuple[Callable[[], None], ...]:
    """(rl_engine triton, eager torch): forward + backward wrt logp."""
    lp = x["logp"].clone().requires_grad_(True)

    def ours() -> None:
        torch.autograd.grad(_triton_loss(lp, x, agg), lp)

    def base() -> None:
        torch.autograd.grad(_torch_loss(lp, x, agg), lp)

    return ours, base


def _loss_rows(quick: bool, copy_tb_s: float | None) -> list[dict[str, Any]]:
    rows = []
    shapes = LOSS_SHAPES[:2] if quick else LOSS_SHAPES
    for b, t in shapes:
        x = _inputs(b, t)
        for agg in LOSS_AGGS:
            ours, base = _loss_fns(x, agg)
            t_ours, t_base = common.bench(ours, quick=quick), common.bench(base, quick=quick)
            # bytes the Triton path must move at least: forward reads logp, old, ref (bf16) and
            # the mask; backward reads them again and writes d logp (bf16)
            min_bytes = b * t * (2 * (3 * 2 + 1) + 2)
            row = {
                "part": "loss",
                "B": b,
                "T": t,
                "loss_agg": agg,
                "triton_us": t_ours,
                "torch_us": t_base,
                "ratio": t_base / t_ours,
                "triton_peak_mib": common.peak_mib(ours),
                "torch_peak_mib": common.peak_mib(base),
                "triton_gb_s": min_bytes / (t_ours * 1e-6) / 1e9,
            }
            if copy_tb_s:
                row["triton_frac_of_copy_bw"] = row["triton_gb_s"] / (copy_tb_s * 1e3)
            rows.append(row)
    return rows


def _head_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    n = HEAD_B * HEAD_T
    x = _inputs(HEAD_B, HEAD_T, seed=2)
    x.pop("logp")
    x["hidden"] = torch.randn(n, HEAD_H, device="cuda", generator=g).bfloat16()
    x["weight"] = (
        torch.randn(HEAD_V, HEAD_H, device="cuda", generator=g) * HEAD_H**-0.5
    ).bfloat16()
    x["tokens"] = torch.randint(0, HEAD_V, (n,), device="cuda", generator=g)
    return x


def _torch_logp(h: torch.Tensor, w: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    logits = (h @ w.t()).float()
    return torch.log_softmax(logits, dim=-1).gather(1, tok[:, None])[:, 0]


def _head_rows(quick: bool) -> tuple[list[dict[str, Any]], str | None]:
    x = _head_inputs()
    h = x["hidden"].requires_grad_(True)
    w = x["weight"].requires_grad_(True)
    tok = x["tokens"]
    agg = "token-mean"

    def loss_of(lp: torch.Tensor) -> torch.Tensor:
        return _torch_loss(lp.view(HEAD_B, HEAD_T), x, agg)

    def materialised() -> None:
        torch.autograd.grad(loss_of(_torch_logp(h, w, tok)), (h, w))

    def chunked() -> None:
        from torch.utils.checkpoint import checkpoint

        parts = [
            checkpoint(_torch_logp, h[i : i + CHUNK], w, tok[i : i + CHUNK], use_reentrant=False)
            for i in range(0, h.shape[0], CHUNK)
        ]
        torch.autograd.grad(loss_of(torch.cat(parts)), (h, w))

    cands: dict[str, Callable[[], None]] = {
        "torch_materialised": materialised,
        "torch_chunked": chunked,
    }
    names = [p.name for p in KernelRegistry.providers("linear_logp", "cuda")]
    skipped = None
    if "triton" in names:
        from rl_engine.ops import linear_logp

        def fused() -> None:
            lp = linear_logp(h, w, tok, 1.0, backend="triton")
            torch.autograd.grad(_triton_loss(lp.view(HEAD_B, HEAD_T), x, agg), (h, w))

        cands = {"rl_engine_fused": fused, **cands}
    else:
        skipped = f"linear_logp has no triton provider (providers: {names})"
    rows = []
    for name, fn in cands.items():
        try:
            t_us = common.bench(fn, quick=quick)
            peak = common.peak_mib(fn)
            rows.append({"part": "lm_head", "path": name, "us": t_us, "peak_mib": peak})
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            rows.append({"part": "lm_head", "path": name, "error": f"OOM: {exc}"[:200]})
    fused_row = next((r for r in rows if r["path"] == "rl_engine_fused" and "us" in r), None)
    for r in rows:
        r.update(tokens=HEAD_B * HEAD_T, H=HEAD_H, V=HEAD_V, dtype="bfloat16")
        if fused_row is not None and "us" in r and r is not fused_row:
            r["ratio"] = r["us"] / fused_row["us"]
            r["peak_ratio"] = r["peak_mib"] / max(fused_row["peak_mib"], 1e-9)
    return rows, skipped


def _plot(out: Path, loss_rows: list[dict[str, Any]], head_rows: list[dict[str, Any]]) -> None:
    def draw(axes):
        labels = [f"{r['B']}x{r['T']}\n{r['loss_agg']}" for r in loss_rows]
        xs = range(len(loss_rows))
        axes[0].bar([i - 0.2 for i in xs], [r["triton_us"] for r in loss_rows], 0.4, label="triton")
        axes[0].bar([i + 0.2 for i in xs], [r["torch_us"] for r in loss_rows], 0.4, label="torch")
        axes[0].set_xticks(list(xs), labels, fontsize=7)
        axes[0].set_ylabel("fwd+bwd us")
        axes[0].set_title("grpo_loss (bf16 logp)")
        axes[0].legend()
        ok = [r for r in head_rows if "us" in r]
        axes[1].bar([r["path"] for r in ok], [r["us"] / 1e3 for r in ok])
        ax2 = axes[1].twinx()
        ax2.plot([r["path"] for r in ok], [r["peak_mib"] / 1024 for r in ok], "ro-")
        axes[1].set_ylabel("fwd+bwd ms")
        ax2.set_ylabel("peak GiB (red)")
        axes[1].set_title(f"LM head + loss, {HEAD_B * HEAD_T} tokens, H={HEAD_H}, V={HEAD_V}")

    common.save_figure(out / "grpo_loss.png", draw, ncols=2, figsize=(12, 4), dpi=120)


def main() -> None:
    args = common.cuda_args(__doc__, "bench_grpo_loss: needs a CUDA device; nothing measured")
    if args is None:
        return
    try:
        copy_tb_s = common.load_or_measure_limits(args.out, quick=args.quick).get("copy_tb_s")
    except Exception as exc:  # the limits are context, not the measurement
        print(f"could not measure the copy bandwidth ({exc})")
        copy_tb_s = None
    loss_rows = _loss_rows(args.quick, copy_tb_s)
    common.print_table(
        loss_rows,
        ["B", "T", "loss_agg", "triton_us", "torch_us", "ratio", "triton_peak_mib",
         "torch_peak_mib", "triton_gb_s"],
    )  # fmt: skip
    head_rows, skipped = _head_rows(args.quick)
    if skipped:
        print(f"fused path skipped: {skipped}")
    common.print_table(head_rows, ["path", "us", "peak_mib", "ratio", "peak_ratio", "error"])
    summary = {
        "loss_geomean_speedup_vs_torch": common.geomean([r["ratio"] for r in loss_rows]),
        "loss_8192_token_mean_triton_us": loss_rows[0]["triton_us"],
    }
    for r in head_rows:
        if "us" in r:
            summary[f"lm_head_{r['path']}_ms"] = r["us"] / 1e3
            summary[f"lm_head_{r['path']}_peak_gib"] = r["peak_mib"] / 1024
    payload = {
        "options": {**OPTS, "chunk": CHUNK},
        "copy_tb_s": copy_tb_s,
        "summary": summary,
        "rows": loss_rows + head_rows,
        "fused_skipped": skipped,
    }
    common.write_json(args.out, "grpo_loss", payload)
    _plot(args.out, loss_rows, head_rows)


if __name__ == "__main__":
    main()
