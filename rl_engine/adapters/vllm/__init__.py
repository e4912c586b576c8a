"""vLLM rollout adapter: route every numerically relevant vLLM layer through rl_engine ops.

Switch it on with ``RL_ENGINE_VLLM=1`` (vLLM loads :func:`plugin.register` through the
``vllm.general_plugins`` entry point in each of its processes), or call :func:`apply` yourself in
the process that runs the model (in-process engines). See ``docs/adapters/vllm.md``.

Public API: :func:`apply`, :func:`remove`, :func:`is_applied`, :func:`provenance`,
:data:`SUPPORTED_VLLM_VERSIONS`, :data:`SUPPORTED_ARCHITECTURES`, :class:`UnroutableModelError`.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_VLLM_VERSIONS",
    "UnroutableModelError",
    "apply",
    "is_applied",
    "provenance",
    "remove",
]

logger = logging.getLogger("rl_engine.adapters.vllm")


def __getattr__(name: str) -> Any:  # lazy: importing the package does not import vLLM
    if name in ("SUPPORTED_ARCHITECTURES", "SUPPORTED_VLLM_VERSIONS", "UnroutableModelError"):
        from rl_engine.adapters.vllm import check

        return getattr(check, name)
    raise AttributeError(name)


def apply() -> None:
    """Patch vLLM's layers and register the attention backend in this process (idempotent).

    Must run before vLLM builds the model (the plugin entry point does). Warns when the
    installed vLLM is not a tested version.
    """
    import vllm

    from rl_engine.adapters.vllm import attention, check, patches

    if vllm.__version__ not in check.SUPPORTED_VLLM_VERSIONS:
        logger.warning(
            "rl_engine vLLM plugin: vLLM %s is not a tested version (%s)",
            vllm.__version__,
            ", ".join(check.SUPPORTED_VLLM_VERSIONS),
        )
    patches.apply_layer_patches()
    attention.register_backend()


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
    return check.provenance_record()


def provenance(llm: Any) -> list[dict[str, Any]]:
    """Provenance of every vLLM worker process of ``llm`` (a ``vllm.LLM``), one dict per worker.

    Each dict has the registry report (op, device, provider, numerics family, version, uses), the
    models checked at load (routed layer counts, unroutable layers in audit mode), the versions
    and the mode. Also (re)writes ``RL_ENGINE_PROVENANCE_DIR/vllm-<pid>.json`` in each worker
    when that folder is configured.
    """
    return llm.collective_rpc(_worker_provenance)
