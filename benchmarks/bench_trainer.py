"""Trainer step time: megatron-core GPTModel with the rl_engine spec vs the stock local spec.

Usage (GPU machine, megatron-core 0.16.1 on PYTHONPATH, see PLATFORMS.md):
``python benchmarks/bench_trainer.py [--out DIR] [--quick] [--layers N] [--seq S] [--batch B]``.

Model (~1B): 16 layers, hidden 2048, 16 query / 8 KV heads (head dim 128), FFN 5632 (SwiGLU),
vocab 151936, seq 4096, bf16, untied LM head. One step = forward + backward of
``token_logprobs`` (rl_engine: ``linear_logp``, no [T, V] logits) vs the stock model's logits +
``log_softmax`` + gather (its usual loss path), both on the same random weights and tokens.
Also records whether each side gives the same log-probs for a sequence alone and inside the
batch (invariance at this scale). Writes ``DIR/trainer.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from shapes import QWEN2_1B  # noqa: E402

MODEL = dict(**QWEN2_1B, vocab=151936, seq=4096, theta=1_000_000.0)


def _setup_megatron() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def _config(layers: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layers,
        hidden_size=MODEL["hidden"],
        num_attention_heads=MODEL["heads"],
        num_query_groups=MODEL["kv_heads"],
        kv_channels=MODEL["hidden"] // MODEL["heads"],
        ffn_hidden_size=MODEL["ffn"],
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        bf16=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build(kind: str, layers: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rl_engine.adapters.megatron import RopeSettings, get_gpt_block_rl_spec

    cfg = _config(layers)
    torch.manual_seed(0)
    if kind == "stock":
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        rope = dict(position_embedding_type="rope", rotary_base=int(MODEL["theta"]))
    else:  # the rl_engine spec carries the rotary embedding (RopeSettings)
        spec = get_gpt_block_rl_spec(layers, rope=RopeSettings(theta=MODEL["theta"]))
        rope = dict(position_embedding_type="none")
    model = GPTModel(cfg, spec, vocab_size=MODEL["vocab"], max_sequence_length=MODEL["seq"], **rope)
    return model.cuda().to(torch.bfloat16)


def stock_logprobs(model, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logits = model(ids, None, None)  # [B, T, V]
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


def rl_logprobs(model, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    from rl_engine.adapters.megatron import token_logprobs

    return token_logprobs(model, ids, temperature, vocab_size=MODEL["vocab"])


def add_shape_arguments(p: argparse.ArgumentParser, batch: int) -> None:
    """``--layers`` and ``--seq`` (the model's by default) and ``--batch`` (default ``batch``):
    the shape arguments of this benchmark and of ``bench_trainer_hf.py``."""
    p.add_argument("--layers", type=int, default=MODEL["layers"])
    p.add_argument("--seq", type=int, default=MODEL["seq"])
    p.add_argument("--batch", type=int, default=batch)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda p: add_shape_arguments(p, batch=1))
    if not torch.cuda.is_available():
        raise SystemExit("bench_trainer.py needs a CUDA device")
    _setup_megatron()
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, MODEL["vocab"], (args.batch, args.seq), generator=g).cuda()
    results: dict[str, dict] = {}
    state = None
    for kind, fn in (("stock", stock_logprobs), ("rl_engine", rl_logprobs)):
        model = build(kind, args.layers)
        if state is None:
            state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
        else:
            model.load_state_dict(state, strict=False)  # same weights on both sides
        model.train()

        def step(model=model, fn=fn):
            model.zero_grad(set_to_none=True)
            lp = fn(model, ids)
            (-lp.mean()).backward()

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t_us = common.bench(step, quick=args.quick)
        peak = torch.cuda.max_memory_allocated() / 2**30
        with torch.no_grad():
            model.eval()
            short = ids[:, : min(args.seq, 512)]
            both = torch.cat([short, short.flip(1)])
            alone = fn(model, short)
            inside = fn(model, both)[: short.shape[0]]
            invariant = bool(torch.equal(alone, inside))
            max_diff = float((alone - inside).abs().max())
            lp_ref = fn(model, short)
        results[kind] = {
            "step_us": t_us,
            "tokens_per_s": args.batch * args.seq / (t_us * 1e-6),
            "peak_mem_gib": peak,
            "alone_vs_batched_bitwise": invariant,
            "alone_vs_batched_max_abs_diff": max_diff,
        }
        results[kind]["_lp"] = lp_ref
        print(kind, {k: v for k, v in results[kind].items() if not k.startswith("_")})
        del model
        torch.cuda.empty_cache()
    d = (results["stock"].pop("_lp") - results["rl_engine"].pop("_lp")).abs()
    payload = {
        "model": {**MODEL, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        "results": results,
        "ratio_step_time_rl_over_stock": results["rl_engine"]["step_us"]
        / results["stock"]["step_us"],
        "rl_vs_stock_logprob_max_abs_diff": float(d.max()),
        "wall_time_s": time.process_time(),
    }
    common.write_json(args.out, "trainer", payload)


if __name__ == "__main__":
    main()
