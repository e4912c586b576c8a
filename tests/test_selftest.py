"""``rl-engine check``: every registered op has a self-test in :mod:`rl_engine.selftest`, the
check passes on the CPU, and a failing or missing self-test fails it; the command line does not
hide a subcommand that cannot be imported."""

from __future__ import annotations

import sys

import pytest

from rl_engine import cli
from rl_engine.registry import KernelRegistry
from rl_engine.selftest import SELF_TESTS


def test_every_op_has_a_self_test():
    assert sorted(SELF_TESTS) == KernelRegistry.known_ops()


def test_check_passes_on_cpu(capsys):
    assert cli.main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "all invariance self-tests passed" in out
    for op in KernelRegistry.known_ops():
        assert f"\n{op} " in out


@pytest.mark.parametrize("broken", ["raises", "missing"])
def test_check_fails_on_a_broken_self_test(broken, monkeypatch, capsys):
    def fail(device: str) -> None:
        raise AssertionError("synthetic failure")

    # one op keeps the run short
    monkeypatch.setattr(KernelRegistry, "known_ops", classmethod(lambda cls: ["det_gemm"]))
    if broken == "raises":
        monkeypatch.setitem(SELF_TESTS, "det_gemm", fail)
        expect = "FAIL: AssertionError: synthetic failure"
    else:
        monkeypatch.delitem(SELF_TESTS, "det_gemm")
        expect = "FAIL: no self-test"
    assert cli.main(["check", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert expect in out and "1 op(s) failed" in out


def test_an_import_error_of_a_subcommand_is_not_hidden(monkeypatch):
    """A subcommand whose module cannot be imported raises that error: it does not vanish from
    the command line (which would answer ``invalid choice: 'audit'`` and hide the cause)."""
    monkeypatch.setitem(sys.modules, "rl_engine.audit.cli", None)
    with pytest.raises(ImportError, match="rl_engine.audit.cli"):
        cli.main(["audit", "--help"])
