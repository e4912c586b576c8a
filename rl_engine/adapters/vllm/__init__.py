"""vLLM rollout adapter: route every numerically relevant vLLM layer through rl_engine ops.

Switch it on with ``RL_ENGINE_VLLM=1`` (vLLM loads :func:`plugin.register` through the
``vllm.general_plugins`` entry point in each of its processes), or call :func:`apply` yourself in
the process that runs the model (in-process engines). See ``docs/adapters/vllm.md``.

Public API: :func:`apply`, :func:`remove`, :func:`is_applied`, :func:`provenance`,
:func:`require_routing`, :data:`SUPPORTED_VLLM_VERSIONS`, :data:`SUPPORTED_ARCHITECTURES`,
:class:`UnroutableModelError`, :class:`UnsupportedVLLMVersionError`,
:class:`RoutingMissingError`.

Ray: vLLM's Ray executor does not forward ``RL_ENGINE_*`` variables to its workers. Put them in
the Ray runtime environment (``ray.init(runtime_env={"env_vars": {"RL_ENGINE_VLLM": "1"}})``)
and call :func:`require_routing` after building the ``LLM``: it raises when any worker runs
unrouted.
"""

from __future__ import annotations

import logging
from typing import Any

from rl_engine.registry import RLEngineError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_VLLM_VERSIONS",
    "RoutingMissingError",
    "UnroutableModelError",
    "UnsupportedVLLMVersionError",
    "apply",
    "is_applied",
    "provenance",
    "remove",
    "require_routing",
]

logger = logging.getLogger("rl_engine.adapters.vllm")


def __getattr__(name: str) -> Any:  # lazy: importing the package does not import vLLM
    if name in ("SUPPORTED_ARCHITECTURES", "UnroutableModelError"):
        from rl_engine.adapters.vllm import check

        return getattr(check, name)
    if name in ("SUPPORTED_VLLM_VERSIONS", "UnsupportedVLLMVersionError"):
        from rl_engine.adapters.vllm import compat

        return getattr(compat, name)
    raise AttributeError(name)


class RoutingMissingError(RLEngineError):
    """A vLLM worker runs without the rl_engine routing (:func:`require_routing`)."""


def apply() -> None:
    """Patch vLLM's layers and samplers and register the attention backend (idempotent).

    Must run before vLLM builds the model (the plugin entry point does).

    Raises:
        UnsupportedVLLMVersionError: the installed vLLM is not a tested version and the
            configuration does not allow untested ones (``RL_ENGINE_VLLM_ALLOW_UNTESTED=1``).
            Nothing is patched then (no partial routing).
    """
    from rl_engine.adapters.vllm import compat

    family = compat.check_version()  # raises before anything is patched
    from rl_engine.adapters.vllm import attention, patches

    if not compat.is_tested():
        logger.warning(
            "rl_engine vLLM plugin: running on untested vLLM %s (API family %s) because "
            "%s is set; tested: %s",
            compat.vllm_version(),
            family,
            compat.ALLOW_UNTESTED_SWITCH,
            ", ".join(compat.SUPPORTED_VLLM_VERSIONS),
        )
    try:
        patches.apply_layer_patches()
        attention.register_backend()
    except BaseException:
        remove()  # all or nothing
        raise


def remove() -> None:
    """Undo :func:`apply` in this process (models built while it was applied keep their impls)."""
    from rl_engine.adapters.vllm import attention, patches

    patches.unpatch_all()
    attention.unregister_backend()


def is_applied() -> bool:
    """Whether :func:`apply` is in effect in this process."""
    from rl_engine.adapters.vllm import patches

    return patches.is_patched()


def _worker_provenance(worker: Any) -> dict[str, Any]:
    from rl_engine.adapters.vllm import check

    check.write_provenance()
    return _plain(check.provenance_record())


def _plain(obj: Any) -> Any:
    """``obj`` as plain JSON types (what vLLM's msgpack channel to the engine process carries;
    e.g. ``torch.__version__`` is a ``TorchVersion``)."""
    import json

    return json.loads(json.dumps(obj, default=str))


def _worker_routing(worker: Any) -> dict[str, Any]:
    """What :func:`require_routing` needs from one worker (runs in the worker)."""
    import os

    from rl_engine.adapters.vllm import patches

    try:
        from rl_engine.adapters.vllm import check

        models = check.provenance_record()["models"]
    except Exception as exc:  # the plugin's own import failing is exactly what to report
        return {"pid": os.getpid(), "applied": False, "error": f"{type(exc).__name__}: {exc}"}
    from rl_engine.registry import KernelRegistry

    return _plain(
        {
            "pid": os.getpid(),
            "applied": patches.is_patched(),
            "models": models,
            "executed_ops": KernelRegistry.executed(),
        }
    )


def require_routing(llm: Any) -> list[dict[str, Any]]:
    """Raise unless every worker of ``llm`` (a ``vllm.LLM``) runs the rl_engine routing.

    Checks, in each worker (through ``llm.collective_rpc``), that the patches are applied, that
    the loaded model was checked with no unroutable layer (its sampler included), and that the
    engine's forward actually executed every routed op (:data:`check.ROUTED_OPS`, plus
    :data:`check.MOE_OPS` for a mixture-of-experts model) once any
    forward ran (vLLM's profiling / graph-capture runs at start do; a warning says when none
    ran yet), so a compiled graph without them is caught. Call it
    once after building the ``LLM``, before trusting its log-probs: it catches the plugin being
    off in workers (``RL_ENGINE_VLLM`` not forwarded to Ray workers, a ``VLLM_PLUGINS`` list
    without ``rl_engine``), which vLLM itself never reports.

    Returns:
        One dict per worker (pid, applied, models) when all are routed.

    Raises:
        RoutingMissingError: naming each worker without routing and why.
    """
    infos = _rpc(llm, "rl_engine_routing")
    problems: list[str] = []
    unverified: list[str] = []
    for i, info in enumerate(infos):
        who = f"worker {i} (pid {info.get('pid')})"
        if not info.get("applied"):
            why = info.get("error") or "the rl_engine patches are not applied"
            problems.append(f"{who}: {why}")
        elif not info.get("models"):
            problems.append(f"{who}: no model was loaded through the patched loader")
        else:
            bad = info["models"][-1].get("unroutable") or []
            if bad:
                problems.append(f"{who}: unroutable layers: {'; '.join(bad)}")
            else:
                from rl_engine.adapters.vllm.check import ROUTED_OPS

                ran = info.get("executed_ops") or {}
                ops = info["models"][-1].get("routed_ops") or ROUTED_OPS
                never = [op for op in ops if not ran.get(op)]
                if not ran.get("attention"):
                    # no forward has run in that worker yet (an engine without a profiling
                    # run, e.g. kv_cache_memory_bytes given and enforce_eager): nothing to
                    # verify yet; said, not skipped silently
                    unverified.append(who)
                elif never:
                    problems.append(
                        f"{who}: the engine's forward never ran rl_engine's {', '.join(never)} "
                        "(its model runs a graph without them: e.g. a torch.compile artifact "
                        "that vLLM loaded from its compile cache, built without the plugin; "
                        "the plugin keys that cache on itself, so this means an old cache or a "
                        "second patcher: clear VLLM_CACHE_ROOT/torch_compile_cache)"
                    )
    if problems:
        raise RoutingMissingError(
            "rl_engine vLLM plugin is not routing every worker:\n  "
            + "\n  ".join(problems)
            + "\nSwitch it on in every vLLM process: RL_ENGINE_VLLM=1 in the environment of the "
            "workers (for Ray: runtime_env={'env_vars': {'RL_ENGINE_VLLM': '1'}}), and keep "
            "'rl_engine' in VLLM_PLUGINS if you set that list."
        )
    if unverified:
        logger.warning(
            "rl_engine: %s ran no forward yet, so whether its model executes rl_engine's ops "
            "is not verified; call require_routing(llm) again after the first generate",
            ", ".join(unverified),
        )
    return infos


def provenance(llm: Any) -> list[dict[str, Any]]:
    """Provenance of every vLLM worker process of ``llm`` (a ``vllm.LLM``), one dict per worker.

    Each dict has the registry report (op, device, provider, numerics family, version, uses), the
    models checked at load (routed layer counts, unroutable layers in audit mode), the versions
    and the mode. Also (re)writes ``RL_ENGINE_PROVENANCE_DIR/vllm-<pid>.json`` in each worker
    when that folder is configured.
    """
    return _rpc(llm, "rl_engine_provenance")


def _rpc(llm: Any, method: str) -> list[Any]:
    """``llm.collective_rpc(method)`` by name: the plugin adds ``rl_engine_routing`` and
    ``rl_engine_provenance`` to vLLM's worker class in each process it is loaded in, so the
    call works with the engine core in its own process (vLLM's default, where a function cannot
    be sent without ``VLLM_ALLOW_INSECURE_SERIALIZATION``). A worker without the method is a
    process without the plugin."""
    try:
        return llm.collective_rpc(method)
    except Exception as exc:  # in-process: NotImplementedError; worker processes: RuntimeError
        if method not in str(exc):
            raise
        raise RoutingMissingError(
            f"rl_engine vLLM plugin is not loaded in vLLM's engine process (its workers have no "
            f"{method!r}): switch it on with RL_ENGINE_VLLM=1 in the environment of every vLLM "
            "process (for Ray: runtime_env={'env_vars': {'RL_ENGINE_VLLM': '1'}}), and keep "
            "'rl_engine' in VLLM_PLUGINS if you set that list"
        ) from exc
