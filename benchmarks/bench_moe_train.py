"""Trainer-side MoE layer: forward + backward of a Qwen3-30B-A3B-shaped sparse MoE block,
rl_engine's blocks vs the stacks a user runs today: transformers' own block and megatron-core's
own MoE layer.

Usage: ``python benchmarks/bench_moe_train.py [--out DIR] [--quick]`` (CUDA only).

One ``Qwen3MoeSparseMoeBlock`` (hidden 2048, 128 experts, top-8, expert FFN 768, bf16, random
weights) from a one-layer ``Qwen3MoeForCausalLM``; T tokens (a training micro-batch: 4k, 8k,
16k) through ``out = block(x); out.backward(g)`` (input and every weight gradient), timed with
``common.bench`` (eager, as a trainer runs).

* Hugging Face: transformers' experts with ``grouped_mm`` (``torch._grouped_mm``, the fastest
  stock option where the installed version has it) and its default implementation, vs
  rl_engine: the same block after ``hf.patch_model`` (``moe_router`` + ``moe_experts`` Triton
  forward / grouped backward + ``moe_combine``). Ratio ``best_hf_ms / rl_engine_ms``.
* Megatron: megatron-core's own ``MoELayer`` as a Megatron user without rl_engine runs it
  (``TransformerConfig`` of the same shape: softmax router, top-k then softmax over the k, no
  auxiliary loss, no capacity / token dropping, gated SiLU, bf16, TP = EP = 1, the alltoall
  token dispatcher, allgather where alltoall fails; the spec of ``get_moe_module_spec`` with
  ``moe_grouped_gemm``) vs rl_engine's ``RLMoELayer`` (rl_engine/adapters/megatron/moe.py).
  Megatron's experts are what it picks on the machine (:func:`megatron_expert_impl`):
  ``TEGroupedMLP`` when Transformer Engine imports, else ``GroupedMLP`` when ``grouped_gemm``
  imports, else ``SequentialMLP`` (a loop over the experts: a weak baseline); printed and
  recorded as ``megatron_experts``. Ratio ``megatron_ms / rl_engine_megatron_ms``.

Every block gets the HF block's weights (:func:`load_hf_weights`): the same routing. One
process; Megatron's model-parallel state (world size 1) comes from the adapter's
``cpu_shim.install`` (the tests' helper). The construction also runs on the CPU at a tiny
shape (tests/test_bench_moe_train.py: ``RLMoELayer`` == the patched HF block bitwise there).
Writes ``DIR/moe_train.json`` (device, versions, date, code hash) and prints a table.
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
EXPERT_IMPLS = ("TEGroupedMLP", "GroupedMLP", "SequentialMLP")


def hf_block(
    impl: str | None,
    shape: dict[str, int] = QWEN3_30B_A3B_MOE,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
):
    """A one-layer Qwen3-MoE model and its sparse block, random weights (seed 0) (``impl``:
    transformers' ``_experts_implementation``; None: its default)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    h = shape["hidden"]
    heads = max(1, h // 64)  # attention is not timed; at hidden 2048: 32 heads, 4 KV heads
    cfg = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=h, intermediate_size=3 * h, moe_intermediate_size=shape["ffn"],
        num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], norm_topk_prob=True,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=1 if heads % 4 else 4,
        head_dim=128, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    if impl is not None:
        cfg._experts_implementation = impl
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(device=device, dtype=dtype)
    return model, model.model.layers[0].mlp


def megatron_expert_impl() -> str:
    """The experts class a Megatron user gets on this machine with ``--moe-grouped-gemm``:
    ``TEGroupedMLP`` when Transformer Engine imports (and has its grouped linear layers),
    else ``GroupedMLP`` when the ``grouped_gemm`` package imports, else ``SequentialMLP``
    (one ``ColumnParallelLinear`` / ``RowParallelLinear`` pair per expert, run in a loop)."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear

        if TEColumnParallelGroupedLinear is not None:
            return "TEGroupedMLP"
    except ImportError:
        pass
    from megatron.core.transformer.moe.grouped_gemm_util import grouped_gemm_is_available

    return "GroupedMLP" if grouped_gemm_is_available() else "SequentialMLP"


def megatron_config(
    shape: dict[str, int], dtype: torch.dtype, device: str, impl: str, dispatcher: str = "alltoall"
):
    """A megatron-core ``TransformerConfig`` of the block's shape (TP = EP = 1): softmax router
    (top-k of the logits, softmax over the k: Qwen3's ``norm_topk_prob``), no auxiliary loss,
    no capacity (no token dropping), gated SiLU experts without biases, ``dispatcher`` token
    dispatcher, grouped GEMM unless ``impl`` is ``SequentialMLP``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    h = shape["hidden"]
    return TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=max(1, h // 64), ffn_hidden_size=3 * h,
        num_moe_experts=shape["experts"], moe_router_topk=shape["top_k"],
        moe_ffn_hidden_size=shape["ffn"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=impl != "SequentialMLP",
        params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False,
        use_cpu_initialization=device == "cpu", gradient_accumulation_fusion=False,
    )  # fmt: skip


def _hf_weights(hf: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The HF block's router [E, H], ``[gate; up]`` [E, 2I, H] and down [E, H, I] weights."""
    return hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj


@torch.no_grad()
def load_hf_weights(layer: torch.nn.Module, hf: torch.nn.Module) -> None:
    """Copy the HF sparse block ``hf``'s weights into a Megatron MoE layer (megatron's
    ``MoELayer`` with any of :data:`EXPERT_IMPLS`, or rl_engine's ``RLMoELayer``), so every
    block of the benchmark routes the same tokens to the same experts."""
    router, w13, w2 = _hf_weights(hf)
    layer.router.weight.copy_(router)
    experts, e = layer.experts, w13.shape[0]
    kind = type(experts).__name__
    if kind == "Module":  # RLMoELayer: the stacked tensors, the same layout
        experts.linear_fc1.weight.copy_(w13)
        experts.linear_fc2.weight.copy_(w2)
    elif kind == "SequentialMLP":
        for i, mlp in enumerate(experts.local_experts):
            mlp.linear_fc1.weight.copy_(w13[i])
            mlp.linear_fc2.weight.copy_(w2[i])
    elif kind == "GroupedMLP":  # weight1 viewed [E, H, 2I], weight2 viewed [E, I, H]
        experts.weight1.copy_(w13.transpose(1, 2).reshape(experts.weight1.shape))
        experts.weight2.copy_(w2.transpose(1, 2).reshape(experts.weight2.shape))
    elif kind == "TEGroupedMLP":  # one weight{i} per expert, [2I, H] and [H, I]
        for i in range(e):
            getattr(experts.linear_fc1, f"weight{i}").copy_(w13[i])
            getattr(experts.linear_fc2, f"weight{i}").copy_(w2[i])
    else:
        raise TypeError(f"load_hf_weights: unknown Megatron experts class {kind}")


def megatron_block(
    kind: str,
    hf: torch.nn.Module,
    shape: dict[str, int] = QWEN3_30B_A3B_MOE,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    impl: str | None = None,
    dispatcher: str = "alltoall",
) -> torch.nn.Module:
    """A Megatron MoE layer of the block's shape with ``hf``'s weights, in training mode.

    ``kind="megatron"``: megatron-core's own ``MoELayer`` (``TopKRouter``, token dispatcher
    ``dispatcher``: ``"alltoall"`` needs CUDA streams, ``"allgather"`` runs on the CPU too;
    experts ``impl``; None: :func:`megatron_expert_impl`), built from the spec
    megatron's GPT layer specs build (``get_moe_module_spec``). ``kind="rl_engine"``:
    rl_engine's ``RLMoELayer`` (``moe_router`` / ``moe_experts`` / ``moe_combine``). Megatron's
    one-process model-parallel state (world size 1) is set up first
    (:func:`rl_engine.adapters.megatron.cpu_shim.install`, the tests' helper)."""
    from rl_engine.adapters.megatron.cpu_shim import install

    install()
    impl = megatron_expert_impl() if impl is None else impl
    config = megatron_config(shape, dtype, device, impl, dispatcher)
    if kind == "megatron":
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.moe.moe_layer import MoELayer

        spec = get_moe_module_spec(
            use_te=impl == "TEGroupedMLP", num_experts=shape["experts"],
            moe_grouped_gemm=impl != "SequentialMLP",
        )  # fmt: skip
        layer = MoELayer(config, submodules=spec.submodules, layer_number=1)
        if type(layer.experts).__name__ != impl:
            raise RuntimeError(f"megatron_block: built {type(layer.experts).__name__}, not {impl}")
    elif kind == "rl_engine":
        from rl_engine.adapters.megatron import RLMoELayer

        layer = RLMoELayer(config, layer_number=1, scoring="softmax", renormalize=True)
    else:
        raise ValueError(f"megatron_block: kind {kind!r}; expected 'megatron' or 'rl_engine'")
    layer = layer.to(device=device, dtype=dtype)
    load_hf_weights(layer, hf)
    return layer.train()


def fwd_bwd(block: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, megatron: bool = False):
    """``step()``: ``out = block(x); out.backward(g)``, returns ``(out, x)`` (x [1, T, H] as
    the decoder layer passes it to the HF block, a leaf holding its gradient; ``megatron``: as
    [T, 1, H], megatron's [s, b, H], the same memory)."""

    def step():
        xx = x.detach().view(x.shape[1], 1, x.shape[2]) if megatron else x.detach()
        xx.requires_grad_(True)
        out = block(xx)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(g.view(out.shape))
        return out, xx

    return step


@common.gpu_main(__doc__, "bench_moe_train")
def main(args: argparse.Namespace, limits: dict[str, float]) -> None:
    from rl_engine.adapters import hf

    ts = (4096,) if args.quick else TS
    h = QWEN3_30B_A3B_MOE["hidden"]
    try:
        impl = megatron_expert_impl()
    except ImportError as exc:  # no megatron-core: the HF rows alone (recorded per row)
        impl = f"none ({exc})"
    print(f"megatron-core experts on this machine: {impl}", flush=True)
    rows = []
    for t in ts:
        gen = torch.Generator(device="cuda").manual_seed(t)
        # [batch 1, T, H]: the block's input as the decoder layer passes it
        x = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        g = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        r: dict = {"t": t}
        for name, impl_hf in (("hf_grouped_mm", "grouped_mm"), ("hf_default", None)):
            try:
                model, block = hf_block(impl_hf)
                r[f"{name}_ms"] = common.bench(fwd_bwd(block, x, g), quick=args.quick) / 1e3
                del model, block
            except Exception as exc:  # an implementation this transformers does not have
                r[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        model, block = hf_block(None)
        runs = (("megatron", "megatron", "alltoall"), ("megatron", "megatron", "allgather"),
                ("rl_engine_megatron", "rl_engine", "alltoall"))  # fmt: skip
        for name, kind, dispatcher in runs:
            if f"{name}_ms" in r or impl not in EXPERT_IMPLS:  # alltoall ran / no megatron
                continue
            try:  # the same weights as the HF blocks (seed 0): the same routing
                layer = megatron_block(kind, block, impl=impl, dispatcher=dispatcher)
                step = fwd_bwd(layer, x, g, megatron=True)
                r[f"{name}_ms"] = common.bench(step, quick=args.quick) / 1e3
                if kind == "megatron":
                    r["megatron_dispatcher"] = dispatcher
                del layer, step
            except Exception as exc:  # recorded, so one failure does not lose the run
                r[f"{name}_error_{dispatcher}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        hf.patch_model(model)
        r["rl_engine_ms"] = common.bench(fwd_bwd(block, x, g), quick=args.quick) / 1e3
        base = [r[k] for k in ("hf_grouped_mm_ms", "hf_default_ms") if k in r]
        if base:
            r["best_hf_ms"] = min(base)
            r["ratio_vs_best_hf"] = r["best_hf_ms"] / r["rl_engine_ms"]
        if "megatron_ms" in r and "rl_engine_megatron_ms" in r:
            r["ratio_megatron"] = r["megatron_ms"] / r["rl_engine_megatron_ms"]
        del model, block
        torch.cuda.empty_cache()
        rows.append(
            common.progress(
                r,
                "moe train T={t:6d}: rl_engine {rl_engine_ms:8.2f} ms{vs}{mg}",
                vs=(
                    f", best HF {r['best_hf_ms']:8.2f} ms ({r['ratio_vs_best_hf']:.2f}x)"
                    if "best_hf_ms" in r
                    else ""
                ),
                mg=(
                    f"; rl_engine Megatron {r['rl_engine_megatron_ms']:8.2f} ms, Megatron "
                    f"({impl}, {r['megatron_dispatcher']}) {r['megatron_ms']:8.2f} ms "
                    f"({r['ratio_megatron']:.2f}x)"
                    if "ratio_megatron" in r
                    else ""
                ),
            )  # fmt: skip
        )
        # the rows so far, in case the call's time limit ends the run before the last T (the
        # final JSON below replaces this one; `complete` says which of the two it is)
        common.write_json(args.out, "moe_train", {"complete": False, "megatron_experts": impl,
                                                   "rows": rows})  # fmt: skip
    common.print_table(
        rows, ["t", "rl_engine_ms", "hf_grouped_mm_ms", "hf_default_ms", "ratio_vs_best_hf",
               "rl_engine_megatron_ms", "megatron_ms", "ratio_megatron"],
    )  # fmt: skip
    print(f"megatron-core experts: {impl}")
    summary = common.geomeans(rows, geomean_vs_best_hf="ratio_vs_best_hf")
    if all("ratio_megatron" in r for r in rows):
        summary.update(common.geomeans(rows, geomean_megatron="ratio_megatron"))
    common.finish_op(
        args, limits, "moe_train", rows=rows, plot=None, provider="triton", summary=summary,
        baseline="transformers Qwen3MoeSparseMoeBlock, _experts_implementation grouped_mm "
        "(torch._grouped_mm) and its default; the faster of the two per row. Megatron: "
        f"megatron-core's MoELayer ({impl} experts; alltoall dispatcher, allgather where "
        "alltoall failed: megatron_dispatcher per row) vs rl_engine's RLMoELayer",
        ratio="best_hf_ms / rl_engine_ms; ratio_megatron: megatron_ms / rl_engine_megatron_ms "
        "(higher is better)",
        bw="n/a", shape=dict(QWEN3_30B_A3B_MOE), megatron_experts=impl,
        timing="common.bench (eager): forward + backward (input and weight gradients)",
        complete=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
