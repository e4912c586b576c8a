"""``pytest --require``: a GPU run that lacks a component it needs fails instead of skipping."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests import conftest


def test_required_modules_and_skip_reasons():
    assert conftest.required_modules("vllm, megatron") == ["vllm", "megatron.core"]
    assert conftest.required_modules("") == []
    with pytest.raises(pytest.UsageError, match="unknown"):
        conftest.required_modules("vlm")
    mods = conftest.required_modules("megatron,liger")
    reason = "could not import 'megatron.core': No module named 'megatron'"
    assert conftest.missing_required(reason, mods) == "megatron.core"
    assert conftest.missing_required("could not import 'megatron'", mods) == "megatron.core"
    assert conftest.missing_required("could not import 'vllm': none", mods) is None
    assert conftest.missing_required("needs a CUDA device", mods) is None


def test_missing_component_fails_the_run(tmp_path):
    """A run that requires a component which does not import stops with an error (exit 4), and
    a module skipped by ``importorskip`` of a required one fails (a component that imports at
    the start but whose submodule does not)."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent("""
        from tests.conftest import (COMPONENTS, pytest_addoption, pytest_make_collect_report,
                                    pytest_runtest_makereport, pytest_sessionstart)
        COMPONENTS["gone"] = "no_such_module_xyz"
        COMPONENTS["half"] = "json"  # imports; its "submodule" below does not
    """)
    )
    (tmp_path / "test_gone.py").write_text(
        textwrap.dedent("""
        import pytest
        pytest.importorskip("json.no_such_submodule")
        def test_never():
            pass
    """)
    )
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    pass\n")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
             "--rootdir", str(tmp_path), str(tmp_path), *args],
            capture_output=True, text=True, cwd=conftest.__file__.rsplit("/tests/", 1)[0],
        )  # fmt: skip

    plain = run()
    assert plain.returncode == 0 and "1 passed, 1 skipped" in plain.stdout, plain.stdout
    gone = run("--require", "gone")
    assert gone.returncode == 4 and "no_such_module_xyz does not import" in gone.stderr, gone
    half = run("--require", "half")
    assert half.returncode not in (0, 5), half.stdout  # a collection error: the run fails
    assert "skipped without a required component (json)" in half.stdout, half.stdout


def test_slow_files_first_name_test_files():
    """tests/conftest.py's SLOW_FILES_FIRST (the CPU suite's file order) names existing files."""
    from pathlib import Path

    root = Path(conftest.__file__).resolve().parent.parent
    missing = [p for p in conftest.SLOW_FILES_FIRST if not (root / p).is_file()]
    assert not missing, f"SLOW_FILES_FIRST names files that do not exist: {missing}"
