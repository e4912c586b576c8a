"""The provider cases of the attention suites (``tests/ops/test_attention.py`` and
``tests/invariance/test_attention_paths.py``): one rule for which providers and devices run."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from rl_engine import KernelRegistry
from tests.conftest import interpreter_on

HAS_CUDA = torch.cuda.is_available()


def provider_cases(dtypes: Callable[[str, str], Sequence[torch.dtype]]) -> list:
    """A ``(device, provider, dtype)`` param per invariant ``attention`` provider the registry
    lists for the CPU (and for CUDA when present, marked ``gpu``) and per dtype of
    ``dtypes(provider, device)``. On a CUDA machine without the interpreter the Triton providers'
    CPU cases are left out (their ``cuda`` cases run the same tests on the GPU), as
    ``tests/conftest.py``'s ``backend_fixture`` does, so that a GPU run's skips are the ones
    that matter; on a CPU machine without the interpreter they still skip with the reason."""
    devices = ["cpu"] + (["cuda"] if HAS_CUDA else [])
    out = []
    for dev in devices:
        marks = [pytest.mark.gpu] if dev == "cuda" else []
        for p in KernelRegistry.providers("attention", dev):
            if not p.invariant:
                continue
            if HAS_CUDA and dev == "cpu" and p.name.startswith("triton") and not interpreter_on():
                continue
            for dt in dtypes(p.name, dev):
                name = str(dt).removeprefix("torch.")
                out.append(
                    pytest.param((dev, p.name, dt), id=f"{dev}-{p.name}-{name}", marks=marks)
                )
    return out


def skip_unless_runnable(device: str, backend: str, errors: type[Exception] = Exception) -> None:
    """Skip the test when ``backend`` is registered but cannot run on ``device`` here (e.g.
    triton on the CPU without the interpreter); ``errors``: what counts as "cannot run"."""
    try:
        KernelRegistry.get_op("attention", device=device, backend=backend)
    except errors as exc:
        pytest.skip(str(exc))
