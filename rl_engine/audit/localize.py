"""Where does the drift come from? Layer-wise localisation of rollout-vs-trainer differences.

Both sides run the *same* token sequence teacher-forced (vLLM: one prefill of the whole
sequence; HF / Megatron: one forward) with forward hooks on every decoder layer's sub-blocks. The
captured activations are compared point by point, in the order the model computes them:

``embed``, then per layer ``L{i}.input_norm``, ``L{i}.attn`` (after the output projection),
``L{i}.post_attn_norm``, in a mixture-of-experts layer ``L{i}.router`` (the router logits
[T, E]), ``L{i}.mlp`` (after the down projection; in an MoE layer the experts and their
combine), then ``final_norm`` and ``logits`` (the LM head's output, all positions).

For an MoE model, :func:`routing_agreement` turns the captured router logits into each side's
top-k expert ids (the family's routing rule, rl_engine's tie rule) and reports per layer the
share of tokens whose ids, in order, match between rollout and trainer.

The first point that is not bitwise equal is where the two engines' numerics part; later points
inherit the difference. A residual add that differs shows up at the next norm. Each capture is
``{point: fp32 [T, ...] tensor on the CPU}``, tokens first, whatever the engine's layout.

Hooks do not fire inside CUDA graphs: the rollout side's capture uses an eager vLLM engine
(rl_engine's kernels give the same bits eager or graphed; a stock engine's compiled kernels may
differ from its eager ones).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

SUB_BLOCKS = ("input_norm", "attn", "post_attn_norm", "router", "mlp")

__all__ = [
    "SUB_BLOCKS",
    "capture_hf",
    "capture_megatron",
    "capture_vllm",
    "compare_captures",
    "full_vocab_kl",
    "hook_points",
    "routing_agreement",
]


def _first(out: Any) -> torch.Tensor:
    """The activation of a module output: vLLM's norms with a residual return ``(normed,
    residual)``, HF attention ``(out, weights)``, Megatron blocks ``(out, bias)``."""
    return out[0] if isinstance(out, (tuple, list)) else out


def hook_points(model: Any, kind: str) -> list[tuple[str, torch.nn.Module]]:
    """``[(point, module)]`` in compute order for ``kind`` in ``hf`` / ``vllm`` / ``megatron``."""
    if kind in ("hf", "vllm"):
        base = model.model
        pts = [("embed", base.embed_tokens)]
        for i, layer in enumerate(base.layers):
            pts += _layer_points(i, layer, layer.self_attn, layer.post_attention_layernorm, kind)
        return pts + [("final_norm", base.norm)]
    if kind == "megatron":
        while hasattr(model, "module") and not hasattr(model, "decoder"):
            model = model.module  # DDP / Float16Module wrappers
        pts = [("embed", model.embedding)]
        for i, layer in enumerate(model.decoder.layers):
            pts += _layer_points(i, layer, layer.self_attention, layer.pre_mlp_layernorm, kind)
        return pts + [("final_norm", model.decoder.final_layernorm)]
    raise ValueError(f"unknown engine kind {kind!r}: expected hf, vllm or megatron")


def _layer_points(
    i: int, layer: torch.nn.Module, attn: torch.nn.Module, post_norm: torch.nn.Module, kind: str
) -> list[tuple[str, torch.nn.Module]]:
    """Decoder layer ``i``'s points in compute order: input norm, attention ``attn``, the norm
    before the MLP ``post_norm``, the router (MoE only), the MLP."""
    pts = [
        (f"L{i}.input_norm", layer.input_layernorm),
        (f"L{i}.attn", attn),
        (f"L{i}.post_attn_norm", post_norm),
    ]
    mlp = _mlp_module(layer)
    router = _router_module(mlp, kind)
    if router is not None:
        pts.append((f"L{i}.router", router))
    pts.append((f"L{i}.mlp", mlp))
    return pts


def _mlp_module(layer: torch.nn.Module) -> torch.nn.Module:
    """A decoder layer's MLP / MoE block: ``mlp`` (transformers, Megatron, vLLM's Llama / Qwen
    families) or ``block_sparse_moe`` (vLLM's Mixtral)."""
    for name in ("mlp", "block_sparse_moe"):
        mlp = getattr(layer, name, None)
        if isinstance(mlp, torch.nn.Module):
            return mlp
    raise AttributeError(
        f"{type(layer).__name__} has neither an 'mlp' nor a 'block_sparse_moe' module: no "
        "MLP / MoE block to hook"
    )


def _router_module(mlp: torch.nn.Module, kind: str) -> torch.nn.Module | None:
    """The module of an MoE block whose output (first element) is the router logits [T, E]:
    transformers' and vLLM's ``gate`` (next to ``experts``); Megatron's ``router`` (rl_engine's
    MoE layer: the logits; megatron's own ``TopKRouter``: its top-k probabilities scattered over
    [T, E], whose top-k ids in order are the same function of the logits). ``None`` for a
    dense MLP."""
    if kind in ("hf", "vllm"):
        if hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            return mlp.gate
        return None
    return getattr(mlp, "router", None)


def routing_agreement(
    rollout: dict[str, torch.Tensor],
    trainer: dict[str, torch.Tensor],
    *,
    top_k: int,
    scoring: str,
    renormalize: bool,
) -> dict[str, Any]:
    """Per MoE layer, the share of tokens whose top-k expert ids (in order) are equal on both
    sides, each side's ids computed from its own captured router logits with the family's rule
    (``moe_topk``'s reference: the same tie rule for both). ``layers``: ``{layer: fraction}``;
    ``logits_bitwise``: ``{layer: bool}``; ``mean``: the mean over layers; ``tokens``."""
    from rl_engine.ops.moe_router.reference import moe_topk

    layers: dict[str, float] = {}
    bitwise: dict[str, bool] = {}
    tokens = 0
    for name, a in rollout.items():
        layer, _, block = name.partition(".")
        if block != "router":
            continue
        b = trainer[name]
        ia = moe_topk(a.float(), top_k, scoring, renormalize)[1]
        ib = moe_topk(b.float(), top_k, scoring, renormalize)[1]
        same = (ia == ib).all(dim=-1)
        layers[layer] = float(same.float().mean()) if same.numel() else float("nan")
        bitwise[layer] = bool(torch.equal(a, b))
        tokens = int(same.numel())
    mean = sum(layers.values()) / len(layers) if layers else float("nan")
    return {"layers": layers, "logits_bitwise": bitwise, "mean": mean, "tokens": tokens}


@contextmanager
def _hooked(points: list[tuple[str, torch.nn.Module]], to_rows: Any) -> Iterator[dict]:
    """Forward hooks that append each point's activation (as fp32 rows on the CPU) to a list."""
    store: dict[str, list[torch.Tensor]] = {name: [] for name, _ in points}
    handles = []
    for name, mod in points:

        def hook(_mod, _inp, out, _name=name):
            store[_name].append(to_rows(_first(out).detach()).float().cpu())

        handles.append(mod.register_forward_hook(hook))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def _join(store: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One tensor per point: the calls in order along the tokens (a chunked prefill)."""
    out = {}
    for name, parts in store.items():
        if not parts:
            raise RuntimeError(f"localisation: the hook on {name!r} never fired")
        out[name] = torch.cat(parts, dim=0)
    return out


def capture_hf(model: Any, ids: list[int]) -> dict[str, torch.Tensor]:
    """Activations of a transformers causal LM (stock or patched) on one sequence."""
    dev = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    with (
        torch.no_grad(),
        _hooked(hook_points(model, "hf"), lambda t: t.reshape(-1, t.shape[-1])) as s,
    ):
        logits = model(input_ids=x, use_cache=False).logits
    out = _join(s)
    out["logits"] = logits[0].float().cpu()
    return out


def capture_megatron(model: Any, ids: list[int]) -> dict[str, torch.Tensor]:
    """Activations of a Megatron ``GPTModel`` (layout [S, B, H]) on one sequence."""
    dev = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    pos = torch.arange(len(ids), device=dev)[None]

    def rows(t: torch.Tensor) -> torch.Tensor:  # [S, 1, H] -> [S, H]
        return t.reshape(t.shape[0], -1) if t.dim() == 3 else t

    with torch.no_grad(), _hooked(hook_points(model, "megatron"), rows) as s:
        logits = model(x, pos, None)
    out = _join(s)
    out["logits"] = _first(logits).reshape(len(ids), -1).float().cpu()
    return out


_VLLM_STORE: dict[str, Any] = {}


def _vllm_hook(model: Any) -> None:
    """Inside the vLLM worker: hooks on the model, captures kept in this process."""
    _VLLM_STORE.clear()
    ctx = _hooked(hook_points(model, "vllm"), lambda t: t.reshape(-1, t.shape[-1]))
    _VLLM_STORE["ctx"] = ctx
    _VLLM_STORE["store"] = ctx.__enter__()


def _vllm_collect(model: Any) -> dict[str, torch.Tensor]:
    ctx, store = _VLLM_STORE.pop("ctx"), _VLLM_STORE.pop("store")
    ctx.__exit__(None, None, None)
    out = _join(store)
    from rl_engine.adapters.vllm import compat

    params = next(model.parameters())
    h = out["final_norm"].to(device=params.device, dtype=params.dtype)
    with torch.no_grad():
        out["logits"] = compat.model_logits(model, h).float().cpu()
    return out


def capture_vllm(llm: Any, ids: list[int]) -> dict[str, torch.Tensor]:
    """Activations of an in-process ``vllm.LLM`` (eager, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    prefilling ``ids``; the logits are the model's ``compute_logits`` of the final norm's output
    at every position (vLLM's own LM head path)."""
    from vllm import SamplingParams

    # through collective_rpc and the worker's model runner (as rl_engine.grpo.sync does): the
    # same call on every vLLM version the plugin supports
    llm.collective_rpc(_on_model, args=(_vllm_hook,))
    try:
        llm.generate(
            [{"prompt_token_ids": list(ids)}],
            SamplingParams(max_tokens=1, temperature=0.0),
            use_tqdm=False,
        )
    finally:
        results = llm.collective_rpc(_on_model, args=(_vllm_collect,))
    return results[0]


def _on_model(worker: Any, func: Any) -> Any:
    """Inside a vLLM worker: ``func`` on the model it runs."""
    return func(worker.model_runner.get_model())


def full_vocab_kl(
    rollout_logits: torch.Tensor, trainer_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """KL(rollout || trainer) over the whole vocabulary per position (float64 [T])."""
    p = torch.log_softmax(rollout_logits.double() / temperature, dim=-1)
    q = torch.log_softmax(trainer_logits.double() / temperature, dim=-1)
    return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)


def compare_captures(
    rollout: dict[str, torch.Tensor],
    trainer: dict[str, torch.Tensor],
    *,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Point-by-point comparison: ``points`` (name, bitwise equal, max |d|, in compute order),
    ``first_divergence`` (the first point not bitwise equal, or ``None``) and the full-vocabulary
    KL per position (``kl_full_mean`` / ``kl_full_max``)."""
    points = []
    first = None
    for name, a in rollout.items():
        if name not in trainer:
            raise ValueError(f"localisation: the trainer capture has no {name!r}")
        b = trainer[name]
        if a.shape != b.shape:
            raise ValueError(
                f"localisation: {name}: rollout {tuple(a.shape)} vs trainer {tuple(b.shape)}"
            )
        equal = bool(torch.equal(a, b))
        d = (a.double() - b.double()).abs()
        finite = d[torch.isfinite(d)]
        max_d = float(finite.max()) if finite.numel() else (0.0 if equal else math.inf)
        points.append({"point": name, "bitwise_equal": equal, "max_abs_delta": max_d})
        if first is None and not equal:
            first = name
    kl = full_vocab_kl(rollout["logits"], trainer["logits"], temperature)
    return {
        "first_divergence": first,
        "points": points,
        "kl_full_mean": float(kl.mean()),
        "kl_full_max": float(kl.max()),
        "tokens": int(rollout["logits"].shape[0]),
    }


def layer_table(result: dict[str, Any]) -> str:
    """Max |d| per layer and sub-block (``=`` where bitwise equal), as text."""
    rows: dict[str, dict[str, str]] = {}
    for p in result["points"]:
        layer, _, block = p["point"].partition(".")
        cell = "=" if p["bitwise_equal"] else f"{p['max_abs_delta']:.2e}"
        rows.setdefault(layer, {})[block or layer] = cell
    head = f"{'layer':<10}" + "".join(f"{b:>16}" for b in SUB_BLOCKS)
    lines = [head]
    for layer, cells in rows.items():
        if layer.startswith("L"):
            lines.append(f"{layer:<10}" + "".join(f"{cells.get(b, '-'):>16}" for b in SUB_BLOCKS))
        else:
            lines.append(f"{layer:<10}{cells[layer]:>16}")
    return "\n".join(lines)
