"""An on-policy GRPO loop: vLLM rollout, a verifiable reward, a Hugging Face or Megatron trainer
through rl_engine, and in-place weight sync into the running engine (see docs/grpo.md).

* :class:`rl_engine.rl.loop.GRPOConfig`, :func:`rl_engine.rl.loop.run`: the loop of one
  configuration in this process (``rl_engine`` needs ``RL_ENGINE_VLLM=1`` in the environment).
* :class:`rl_engine.rl.sync.WeightSync`: validated in-place weight updates of a running
  ``vllm.LLM``.
* :mod:`rl_engine.rl.rewards`: reward functions and their error handling.
* ``rl-engine grpo`` (:mod:`rl_engine.rl.cli`): both configurations, each in its own process.

Nothing heavy is imported here (vLLM, transformers and megatron-core load on use).
"""
