"""Integrations with RL training frameworks (see docs/integrations.md).

Import them explicitly, like the adapters: ``from rl_engine.integrations import trl`` (needs
``trl``, ``transformers`` and ``vllm``). Nothing here is imported by ``rl_engine/__init__.py``.
"""
