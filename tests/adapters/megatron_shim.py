"""The tests' handle on the CPU shim for megatron-core (it lives in the library so that the
audit can run the stock Megatron model on CPU too): see rl_engine/adapters/megatron/cpu_shim.py."""

import pytest
import torch

from rl_engine.adapters.megatron.cpu_shim import install, uninstall  # noqa: F401


def drop_process_groups() -> None:
    """Destroy Megatron's model-parallel state and the default process group, if any (an NCCL
    group left by a GPU module of the same pytest worker cannot carry CPU tensors, and a gloo
    one left here must not serve the next GPU module)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def module_fixture(force_cpu: bool = False):
    """An autouse module-scoped fixture that installs the shim for the test module and removes
    it after. In a test module: ``_shim = megatron_shim.module_fixture()``.

    ``force_cpu``: the module is the CPU suite (reference providers, CPU tensors) and runs as on a
    CPU-only machine also where CUDA is available: ``torch.cuda.is_available()`` reads False
    for the module (so the adapter keeps the model on the CPU and the shim sets up gloo), with
    the process groups dropped before and after. On a GPU the same cases with the Triton
    providers are tests/adapters/test_trainer_gpu.py's."""

    @pytest.fixture(scope="module", autouse=True)
    def _shim():
        if not force_cpu:
            install()
            yield
            uninstall()
            return
        with pytest.MonkeyPatch.context() as mp:
            drop_process_groups()
            mp.setattr(torch.cuda, "is_available", lambda: False)
            install()
            try:
                yield
            finally:
                uninstall()
                drop_process_groups()

    return _shim
