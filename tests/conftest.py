"""Session-wide settings for the tests."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _deterministic_session():
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test starts with no resolutions and the environment's configuration."""
    from rl_engine import KernelRegistry, config

    config.reload()
    KernelRegistry.reset()
    yield
    KernelRegistry.reset()
    config.reload()


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
