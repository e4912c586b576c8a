"""CPU shim for megatron-core 0.16.1: used by the tests and by ``rl-engine audit`` on CPU-only
machines; no adapter module imports it, and it changes nothing when CUDA is available.

megatron-core assumes CUDA in a few places even with the local (non-Transformer-Engine) spec:

* ``torch.cuda.current_device()`` is used as a device for RoPE frequencies
  (``RotaryEmbedding.get_emb``) and a few buffers. The shim makes it return ``"cpu"``.
* ``megatron.core.transformer.utils.get_default_causal_mask`` builds the causal mask on
  ``"cuda"`` (used by the stock ``DotProductAttention`` through ``FusedScaleMaskSoftmax``). The
  shim replaces it (and the name imported into ``fused_softmax``) with a CPU version.
* The stock ``DotProductAttention`` forks the CUDA RNG tracker around its dropout (even at p = 0
  in eval mode); the shim hands it a tracker whose ``fork()`` does nothing.
* Without Transformer Engine, ``megatron.core.transformer.moe.moe_utils`` never defines
  ``te_general_gemm`` (its import sits in a ``try`` with no fallback), so the stock
  ``TopKRouter``'s gating GEMM raises ``NameError``; the shim defines it as ``None`` (megatron's
  own "no TE" branch: ``torch.mm``). Only the stock MoE model (the tests' control) needs it.
* Model-parallel state needs a process group: a one-process ``gloo`` group and
  ``initialize_model_parallel(1, 1)``.

The rl_engine layer spec itself needs none of this apart from the process group; the shim exists
so that the *stock* Megatron model (the "before" picture the tests compare against) runs on CPU.
Everything is undone by :func:`uninstall`.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_saved: dict[str, object] = {}


class _NoCudaRngTracker:
    """Stand-in for Megatron's CUDA RNG tracker on CPU: ``fork()`` is a no-op context."""

    def fork(self, name: str = "model-parallel-rng"):
        return contextlib.nullcontext()

    def is_initialized(self) -> bool:
        return False


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def install() -> None:
    """Patch megatron-core's CUDA assumptions and set up a one-process model-parallel state."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tp
    import megatron.core.transformer.utils as mutils
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not _saved:
        _saved["current_device"] = torch.cuda.current_device
        _saved["mask_utils"] = mutils.get_default_causal_mask
        _saved["mask_softmax"] = fused_softmax.get_default_causal_mask
        _saved["rng_tracker"] = tp.get_cuda_rng_tracker
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _saved["te_general_gemm"] = True
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        mutils.get_default_causal_mask = _cpu_causal_mask
        fused_softmax.get_default_causal_mask = _cpu_causal_mask
        tracker = _NoCudaRngTracker()
        tp.get_cuda_rng_tracker = lambda *a, **k: tracker
    if not dist.is_initialized():
        # One process: an in-process store, so no TCP port is needed (and none can be raced for).
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(0)


def uninstall() -> None:
    """Undo :func:`install` (the process group is kept: re-creating it is slow)."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tp
    import megatron.core.transformer.utils as mutils

    if _saved.pop("te_general_gemm", False):
        import megatron.core.transformer.moe.moe_utils as moe_utils

        del moe_utils.te_general_gemm
    if _saved:
        tp.get_cuda_rng_tracker = _saved.pop("rng_tracker")
        torch.cuda.current_device = _saved.pop("current_device")  # type: ignore[assignment]
        mutils.get_default_causal_mask = _saved.pop("mask_utils")
        fused_softmax.get_default_causal_mask = _saved.pop("mask_softmax")
