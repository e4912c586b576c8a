"""rl_engine: batch-invariant kernels so that RL rollout and trainer log-probs agree bitwise.

Public surface: :class:`KernelRegistry`, the error classes, and :mod:`rl_engine.ops` (the
functional ops). Adapters (``rl_engine.adapters.vllm`` / ``.megatron`` / ``.hf``) are imported
explicitly by the user, never from here.
"""

from rl_engine._version import __version__
from rl_engine.registry import (
    BackendUnavailableError,
    KernelRegistry,
    NoInvariantProviderError,
    RLEngineError,
    UnknownOpError,
)

__all__ = [
    "BackendUnavailableError",
    "KernelRegistry",
    "NoInvariantProviderError",
    "RLEngineError",
    "UnknownOpError",
    "__version__",
]
