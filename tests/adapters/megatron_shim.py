"""The tests' handle on the CPU shim for megatron-core (it lives in the library so that the
audit can run the stock Megatron model on CPU too): see rl_engine/adapters/megatron/cpu_shim.py."""

from rl_engine.adapters.megatron.cpu_shim import install, uninstall  # noqa: F401
