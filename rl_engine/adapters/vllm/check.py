"""Load-time check of a vLLM model (strict refusal of unroutable layers) and provenance.

Every module of the loaded model must be either a *routed* layer (its numerics run through an
rl_engine op) or a *structural* container of a supported architecture (its ``forward`` only wires
routed layers together: views, splits, no arithmetic). Anything else is listed; in strict mode the
model is refused with :class:`UnroutableModelError`, in audit mode the list goes to provenance.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import torch

from rl_engine.adapters import SUPPORTED_ARCHS as SUPPORTED_ARCHITECTURES
from rl_engine.adapters.vllm.compat import NOT_STRUCTURAL as _NOT_STRUCTURAL
from rl_engine.adapters.vllm.compat import STRUCTURAL_MODULES as _STRUCTURAL_MODULES
from rl_engine.adapters.vllm.compat import SUPPORTED_VLLM_VERSIONS  # noqa: F401 (re-export)
from rl_engine.registry import KernelRegistry, RLEngineError

# The rl_engine ops a routed model's forward runs: resolved when the model is loaded (vLLM runs
# the forward right after, in its profiling / warm-up runs, and the compiled graph keeps the
# providers resolved at trace time). ``logp`` is not among them: it is resolved, and counted,
# only when the routed sampler runs (``executed`` in provenance).
ROUTED_OPS = ("det_gemm", "rms_norm", "silu_and_mul", "rope", "attention")
# ... and in a mixture-of-experts model also these (``moe.MOE_OPS``; listed per model in
# provenance as ``routed_ops``).
MOE_OPS = ("moe_router", "moe_experts", "moe_combine")

_lock = threading.Lock()
_state: dict[str, Any] = {
    "models": [],
    "unrouted_uses": {},
    "executed": {"logp_calls": 0, "logp_rows": 0},
    "logprobs_mode": None,
}


def record_routed_logp(rows: int) -> None:
    """The routed log-prob path ran on ``rows`` logit rows (bumped by the samplers' patches)."""
    with _lock:
        _state["executed"]["logp_calls"] += 1
        _state["executed"]["logp_rows"] += rows


def logprobs_mode() -> str | None:
    """The ``logprobs_mode`` of the last model loaded in this process (``None`` before)."""
    return _state["logprobs_mode"]


class UnroutableModelError(RLEngineError):
    """The model has layers the rl_engine vLLM plugin cannot route (strict mode)."""


def record_unrouted_use(layer: str, reason: str) -> None:
    with _lock:
        key = f"{layer}: {reason}"
        _state["unrouted_uses"][key] = _state["unrouted_uses"].get(key, 0) + 1


def _classify(
    name: str, module: torch.nn.Module, vllm_config: Any, moe: dict[int, str | None] | None = None
) -> tuple[str, str | None]:
    """``("routed" | "structural", None)`` or ``("unroutable", reason)``. ``moe``: the MoE
    pre-pass of :func:`check_model` (``id`` of each MoE runner -> its reason or ``None``, and
    of each routed runner's shared-expert MLP -> ``"shared"``)."""
    from rl_engine.adapters.vllm import compat, patches
    from rl_engine.adapters.vllm.attention import RLEngineAttentionImpl

    lay = compat.layers()
    SiluAndMul, Attention, RMSNorm = lay.SiluAndMul, lay.Attention, lay.RMSNorm
    LinearBase, UnquantizedLinearMethod = lay.LinearBase, lay.UnquantizedLinearMethod
    LogitsProcessor, RotaryEmbedding = lay.LogitsProcessor, lay.RotaryEmbedding
    UnquantizedEmbeddingMethod = lay.UnquantizedEmbeddingMethod
    VocabParallelEmbedding = lay.VocabParallelEmbedding

    cls = type(module)
    moe = moe or {}
    if id(module) in moe:
        reason = moe[id(module)]
        if reason == "shared":  # its forward is not called: the MoE forward runs its layers
            return "structural", None
        return ("unroutable", reason) if reason else ("routed", None)
    if isinstance(module, LinearBase):
        if type(module.quant_method) is not UnquantizedLinearMethod:
            return "unroutable", f"linear with {type(module.quant_method).__name__}"
        if cls.__name__ == "GateLinear":
            from rl_engine.adapters.vllm.moe import gate_unroutable

            reason = gate_unroutable(module)
            if reason is None and module.weight.dtype != vllm_config.model_config.dtype:
                reason = f"MoE router gate weight in {module.weight.dtype} (fp32 router GEMM)"
            if reason:
                return "unroutable", reason
        return "routed", None
    if isinstance(module, VocabParallelEmbedding):  # incl. ParallelLMHead
        if type(module.quant_method) not in (UnquantizedEmbeddingMethod, UnquantizedLinearMethod):
            return "unroutable", f"embedding with {type(module.quant_method).__name__}"
        if getattr(module, "bias", None) is not None:
            return "unroutable", "LM head with bias"
        return "routed", None
    if cls is RMSNorm:
        reason = patches.rms_norm_unroutable(module)
        return ("unroutable", reason) if reason else ("routed", None)
    if cls is SiluAndMul:
        return "routed", None
    if isinstance(module, RotaryEmbedding):
        _, reason = patches.rope_scaling(module)
        return ("unroutable", reason) if reason else ("routed", None)
    if cls is Attention:
        if not isinstance(module.impl, RLEngineAttentionImpl):
            return "unroutable", f"attention backend {type(module.impl).__name__}"
        return "routed", None
    if cls is LogitsProcessor:
        if module.soft_cap is not None:
            return "unroutable", "logit soft-cap"
        if module.scale != 1.0:
            return "unroutable", f"logit scale {module.scale}"
        if module.logits_as_input:
            return "unroutable", "logits_as_input"
        head_dtype = getattr(module, "head_dtype", None)
        if head_dtype is not None and head_dtype != vllm_config.model_config.dtype:
            return "unroutable", f"head_dtype {head_dtype} != model dtype"
        return "routed", None
    if cls.__name__ in _NOT_STRUCTURAL:
        # Without an expert gate the forward is gate_up_proj -> act_fn -> down_proj (routed
        # layers only): the dense layers of an MoE model (mlp_only_layers, decoder_sparse_step).
        # A class without the attribute (another vLLM version) stays refused.
        if getattr(module, "expert_gate", True) is not None:
            return "unroutable", (
                f"{cls.__name__} with a sigmoid expert gate outside a routed MoE layer (its "
                "forward computes sigmoid(gate) * out)"
            )
        return "structural", None
    if cls.__module__ in _STRUCTURAL_MODULES or cls in (torch.nn.ModuleList, torch.nn.Identity):
        return "structural", None
    if cls.__name__ == "PPMissingLayer":
        return "structural", None
    return "unroutable", f"{cls.__module__}.{cls.__qualname__} is not a layer the plugin knows"


def check_model(model: torch.nn.Module, vllm_config: Any) -> dict[str, Any]:
    """Classify every module; returns ``{"routed": {type: count}, "unroutable": [...]}``."""
    routed: dict[str, int] = {}
    unroutable: list[str] = []
    archs = list(getattr(vllm_config.model_config.hf_config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        unroutable.append(
            f"<model>: architecture {archs} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    unroutable += config_unroutable(vllm_config.model_config.hf_config)
    moe, moe_layers = _moe_prepass(model, vllm_config)
    routed_prefixes: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p) for p in routed_prefixes):
            continue  # inside a routed layer: its forward no longer runs its children
        kind, reason = _classify(name, module, vllm_config, moe)
        if kind == "routed":
            key = type(module).__name__
            routed[key] = routed.get(key, 0) + 1
            routed_prefixes.append(name + ".")
        elif kind == "unroutable":
            unroutable.append(f"{name or '<root>'}: {reason}")
    sampler_mode = vllm_config.model_config.logprobs_mode
    from rl_engine.adapters.vllm import compat, patches

    runner = "v2" if compat.uses_v2_model_runner(vllm_config) else "v1"
    samplers = patches.routed_samplers()
    if not any(("gpu.sample" in n) == (runner == "v2") for n in samplers):
        unroutable.append(f"<sampler>: the {runner} model runner's sampler is not routed")
    return {
        "routed": routed,
        "unroutable": unroutable,
        "logprobs_mode": sampler_mode,
        "model_runner": runner,
        "routed_ops": _routed_ops(routed, moe_layers),
        "moe_layers": moe_layers,
    }


def config_unroutable(hf_config: Any) -> list[str]:
    """Config fields whose computation vLLM's model does not run as transformers defines it (the
    rollout would compute another model than the trainer, whatever the kernels): one entry per
    field, naming it."""
    out = []
    mt = getattr(hf_config, "model_type", None)
    if mt in ("qwen3", "qwen3_moe") and getattr(hf_config, "attention_bias", False):
        out.append(
            f"<model>: {mt} attention_bias=True: transformers gives o_proj a bias, vLLM's "
            f"{mt} attention builds o_proj without one (the checkpoint's o_proj.bias is not "
            "used)"
        )
    if mt in ("qwen2", "qwen2_moe"):
        hidden = getattr(hf_config, "hidden_size", None)
        heads = getattr(hf_config, "num_attention_heads", None)
        head_dim = getattr(hf_config, "head_dim", None)
        if head_dim and hidden and heads and head_dim != hidden // heads:
            out.append(
                f"<model>: {mt} head_dim={head_dim}: vLLM's {mt} attention takes "
                f"hidden_size // num_attention_heads = {hidden // heads} as its head size "
                "(transformers takes head_dim)"
            )
    return out


def _routed_ops(routed: dict[str, int], moe_layers: dict[str, Any]) -> list[str]:
    """The rl_engine ops this model's forward runs: :data:`ROUTED_OPS` (``silu_and_mul`` only
    where a ``SiluAndMul`` layer exists: the experts of an all-MoE model run their activation
    inside ``moe_experts``) plus :data:`MOE_OPS` for a mixture-of-experts model."""
    ops = [op for op in ROUTED_OPS if op != "silu_and_mul" or routed.get("SiluAndMul")]
    return ops + (list(MOE_OPS) if moe_layers else [])


def _moe_prepass(
    model: torch.nn.Module, vllm_config: Any
) -> tuple[dict[int, str | None], dict[str, Any]]:
    """Check every MoE layer (``MoERunner``); annotate the routable ones with their routing.

    Returns ``({id(runner): reason or None, id(shared-expert MLP of a routed runner):
    "shared"}, {layer name: routing and executed ops})``.
    """
    from rl_engine.adapters.vllm import compat
    from rl_engine.adapters.vllm import moe as moe_mod

    runner_cls = compat.moe_layers().MoERunner
    verdicts: dict[int, str | None] = {}
    layers: dict[str, Any] = {}
    for name, module in model.named_modules():
        if not isinstance(module, runner_cls):
            continue
        reason = moe_mod.moe_unroutable(module, vllm_config)
        verdicts[id(module)] = reason
        if reason is None:
            layers[name] = moe_mod.annotate(module, vllm_config)
            mlp = moe_mod.shared_mlp(module)
            if mlp is not None:
                verdicts[id(mlp)] = "shared"
        elif hasattr(module, moe_mod.ATTR):
            delattr(module, moe_mod.ATTR)
    return verdicts, layers


def on_model_loaded(model: torch.nn.Module, vllm_config: Any) -> None:
    """Run the check (strict: raise), resolve the ops, record and write provenance."""
    from rl_engine import config

    settings = config.settings()
    result = check_model(model, vllm_config)
    if result["unroutable"] and settings.mode == "strict":
        raise UnroutableModelError(
            "rl_engine vLLM plugin (strict mode) refuses this model; layers it cannot route:\n  "
            + "\n  ".join(result["unroutable"])
        )
    device = vllm_config.device_config.device
    device_type = torch.device(device).type if device is not None else "cpu"
    for op in result["routed_ops"]:
        KernelRegistry.get_op(op, device=device_type)
    mc = vllm_config.model_config
    entry = {
        "model": str(mc.model),
        "architectures": list(getattr(mc.hf_config, "architectures", None) or []),
        "dtype": str(mc.dtype).replace("torch.", ""),
        "device": device_type,
        "enforce_eager": bool(mc.enforce_eager),
        "compilation_mode": str(vllm_config.compilation_config.mode),
        **result,
    }
    with _lock:
        _state["models"].append(entry)
        _state["logprobs_mode"] = str(mc.logprobs_mode)
    write_provenance()


def provenance_record() -> dict[str, Any]:
    """This process's provenance: registry report, models checked, versions, mode."""
    import vllm

    import rl_engine
    from rl_engine import config

    with _lock:
        models = [dict(m) for m in _state["models"]]
        unrouted = dict(_state["unrouted_uses"])
        executed = dict(_state["executed"])
    from rl_engine.adapters.vllm import patches

    return {
        "pid": os.getpid(),
        "rl_engine_version": getattr(rl_engine, "__version__", "unknown"),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "mode": config.settings().mode,
        "models": models,
        "unrouted_uses": unrouted,
        "executed": executed,
        "executed_ops": KernelRegistry.executed(),
        "routed": patches.is_patched(),
        "routed_samplers": patches.routed_samplers(),
        "registry": KernelRegistry.report(),
    }


def write_provenance() -> str | None:
    """Write :func:`provenance_record` as JSON to ``RL_ENGINE_PROVENANCE_DIR`` (if set)."""
    from rl_engine import config

    folder = config.settings().provenance_dir
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"vllm-{os.getpid()}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(provenance_record(), f, indent=1, default=str)
    os.replace(tmp, path)
    return path
