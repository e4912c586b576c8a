"""Engine adapters. Import them explicitly: ``rl_engine.adapters.vllm`` / ``.megatron`` / ``.hf``."""
