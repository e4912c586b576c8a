"""The provider cases of the attention suites (``tests/ops/test_attention.py`` and
``tests/invariance/test_attention_paths.py``): one rule for which providers and devices run."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from rl_engine import KernelRegistry
from tests.conftest import left_out_here

HAS_CUDA = torch.cuda.is_available()


def provider_cases(dtypes: Callable[[str, str], Sequence[torch.dtype]]) -> list:
    """A ``(device, provider, dtype)`` param per invariant ``attention`` provider the registry
    lists for the CPU (and for CUDA when present, marked ``gpu``) and per dtype of
    ``dtypes(provider, device)``, less the cases ``tests/conftest.py``'s ``left_out_here`` leaves
    out (the Triton providers' CPU cases on a CUDA machine without the interpreter)."""
    devices = ["cpu"] + (["cuda"] if HAS_CUDA else [])
    out = []
    for dev in devices:
        marks = [pytest.mark.gpu] if dev == "cuda" else []
        for p in KernelRegistry.providers("attention", dev):
            if not p.invariant:
                continue
            if left_out_here(dev, p.name):
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
