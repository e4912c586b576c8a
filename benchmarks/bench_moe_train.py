"""Trainer-side MoE layer: forward + backward of a Qwen3-30B-A3B-shaped sparse MoE block, the
rl_engine-patched block vs transformers' own (the trainer a user runs today).

Usage: ``python benchmarks/bench_moe_train.py [--out DIR] [--quick]``.

One ``Qwen3MoeSparseMoeBlock`` (hidden 2048, 128 experts, top-8, expert FFN 768, bf16, random
weights) from a one-layer ``Qwen3MoeForCausalLM``; T tokens (a training micro-batch: 4k, 8k,
16k) through ``out = block(x); out.backward(g)`` (input and every weight gradient), timed with
``common.bench`` (eager, as a trainer runs). Baselines: transformers' experts with
``grouped_mm`` (``torch._grouped_mm``, the fastest stock option where the installed version has
it) and its default implementation; rl_engine: the same block after ``hf.patch_model``
(``moe_router`` + ``moe_experts`` Triton forward / grouped backward + ``moe_combine``). Writes
``DIR/moe_train.json`` (device, versions, date, code hash) and prints a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import QWEN3_30B_A3B_MOE  # noqa: E402

TS = (4096, 8192, 16384)


def _block(impl: str | None):
    """A one-layer Qwen3-MoE model's sparse block on CUDA, bf16 (``impl``: transformers'
    ``_experts_implementation``; None: its default)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    c = QWEN3_30B_A3B_MOE
    cfg = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=c["hidden"], intermediate_size=6144,
        moe_intermediate_size=c["ffn"], num_experts=c["experts"], num_experts_per_tok=c["top_k"],
        norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    if impl is not None:
        cfg._experts_implementation = impl
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    return model, model.model.layers[0].mlp


def _fwd_bwd(block, x, g):
    def step():
        xx = x.detach().requires_grad_(True)
        out = block(xx)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(g)
        return out

    return step


@common.gpu_main(__doc__, "bench_moe_train")
def main(args: argparse.Namespace, limits: dict[str, float]) -> None:
    from rl_engine.adapters import hf

    ts = (4096,) if args.quick else TS
    h = QWEN3_30B_A3B_MOE["hidden"]
    rows = []
    for t in ts:
        gen = torch.Generator(device="cuda").manual_seed(t)
        # [batch 1, T, H]: the block's input as the decoder layer passes it
        x = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        g = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        r: dict = {"t": t}
        for name, impl in (("hf_grouped_mm", "grouped_mm"), ("hf_default", None)):
            try:
                model, block = _block(impl)
                r[f"{name}_ms"] = common.bench(_fwd_bwd(block, x, g), quick=args.quick) / 1e3
                del model, block
            except Exception as exc:  # an implementation this transformers does not have
                r[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        model, block = _block(None)
        hf.patch_model(model)
        r["rl_engine_ms"] = common.bench(_fwd_bwd(block, x, g), quick=args.quick) / 1e3
        base = [r[k] for k in ("hf_grouped_mm_ms", "hf_default_ms") if k in r]
        if base:
            r["best_hf_ms"] = min(base)
            r["ratio_vs_best_hf"] = r["best_hf_ms"] / r["rl_engine_ms"]
        del model, block
        torch.cuda.empty_cache()
        rows.append(
            common.progress(
                r,
                "moe train T={t:6d}: rl_engine {rl_engine_ms:8.2f} ms{vs}",
                vs=(
                    f", best HF {r['best_hf_ms']:8.2f} ms ({r['ratio_vs_best_hf']:.2f}x)"
                    if "best_hf_ms" in r
                    else ""
                ),
            )  # fmt: skip
        )
    common.print_table(
        rows, ["t", "rl_engine_ms", "hf_grouped_mm_ms", "hf_default_ms", "ratio_vs_best_hf"]
    )
    common.finish_op(
        args, limits, "moe_train", rows=rows, plot=None, provider="triton",
        summary=common.geomeans(rows, geomean_vs_best_hf="ratio_vs_best_hf"),
        baseline="transformers Qwen3MoeSparseMoeBlock, _experts_implementation grouped_mm "
        "(torch._grouped_mm) and its default; the faster of the two per row",
        ratio="best_hf_ms / rl_engine_ms (higher is better)", bw="n/a",
        shape=dict(QWEN3_30B_A3B_MOE),
        timing="common.bench (eager): forward + backward (input and weight gradients)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
