"""Engine adapters. Import them explicitly: ``rl_engine.adapters.vllm`` / ``.megatron`` / ``.hf``."""

# the Hugging Face architectures every engine adapter (vLLM plugin, HF and Megatron trainers)
# supports; the CLIs and the vLLM plugin's load-time check read this one list
SUPPORTED_ARCHS = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
)
