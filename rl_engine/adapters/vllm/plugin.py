"""Entry point of the ``vllm.general_plugins`` group (declared in ``pyproject.toml``).

vLLM calls :func:`register` once in every process it starts (front end, engine core, workers).
It does nothing unless the configuration switches the plugin on (``RL_ENGINE_VLLM=1``, read
through :func:`rl_engine.config.settings`); then it applies :func:`rl_engine.adapters.vllm.apply`.
"""

from __future__ import annotations

from rl_engine import config


def register() -> None:
    """Apply the rl_engine routing when ``settings().vllm_plugin`` is on (idempotent)."""
    if not config.settings().vllm_plugin:
        return
    from rl_engine.adapters.vllm import apply

    apply()
