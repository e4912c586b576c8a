"""vLLM rollout adapter (see docs/adapters/vllm.md)."""
