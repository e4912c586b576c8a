"""Engine harnesses: multi-process and whole-model checks that drive the adapters and the
engine runner (``python -m rl_engine.harness.<check>``).

* :mod:`~rl_engine.harness.tp_check`: Megatron TP 1 / 2 / 4 / 8 (+ SP) == TP 1 == the HF trainer.
* :mod:`~rl_engine.harness.fsdp_check`: an FSDP2-sharded HF trainer == one process.
* :mod:`~rl_engine.harness.vllm_tp_check`: a vLLM TP (+ EP) rollout == TP 1 == the HF trainer.
* :mod:`~rl_engine.harness.dtensor_check`: the norms on DTensors == the unsharded op.
* :mod:`~rl_engine.harness.ep_check`, :mod:`~rl_engine.harness.moe_ep_check`: expert
  parallelism (Megatron EP 2 / 4 == EP 1; vLLM's EP slot sum).
* :mod:`~rl_engine.harness.fuzz`: seeded random invariance cases for every op and provider.

They sit above the adapters (they load models through them); the helpers the op tests use
(tolerances, invariance checkers, tiny models) stay in :mod:`rl_engine.testing`, which imports
no adapter.
"""
