"""Entry point of the ``vllm.general_plugins`` group. Does nothing unless RL_ENGINE_VLLM=1."""

from __future__ import annotations

from rl_engine import config


def register() -> None:
    if not config.settings().vllm_plugin:
        return
    raise NotImplementedError("the rl_engine vLLM plugin is not implemented yet")
