"""An on-policy GRPO loop: vLLM rollout, a verifiable reward, a Hugging Face or Megatron trainer
through rl_engine, and in-place weight sync into the running engine (see docs/grpo.md).

* :class:`rl_engine.grpo.loop.GRPOConfig`, :func:`rl_engine.grpo.loop.run`: the loop of one
  configuration in this process (``rl_engine`` needs ``RL_ENGINE_VLLM=1`` in the environment).
* :class:`rl_engine.grpo.sync.WeightSync`: validated in-place weight updates of a running
  ``vllm.LLM``.
* :mod:`rl_engine.grpo.rewards`: reward functions and their error handling.
* ``rl-engine grpo`` (:mod:`rl_engine.grpo.cli`): both configurations, each in its own process.

Nothing heavy is imported here (vLLM, transformers and megatron-core load on use).
"""
