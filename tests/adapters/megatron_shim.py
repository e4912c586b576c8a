"""The tests' handle on the CPU shim for megatron-core (it lives in the library so that the
audit can run the stock Megatron model on CPU too): see rl_engine/adapters/megatron/cpu_shim.py."""

import pytest

from rl_engine.adapters.megatron.cpu_shim import install, uninstall  # noqa: F401


def module_fixture():
    """An autouse module-scoped fixture that installs the shim for the test module and removes
    it after. In a test module: ``_shim = megatron_shim.module_fixture()``."""

    @pytest.fixture(scope="module", autouse=True)
    def _shim():
        install()
        yield
        uninstall()

    return _shim
