"""The package's layers hold (docs/where-things-live.md).

Every module under ``rl_engine`` is parsed (no import runs) and each ``rl_engine`` import it
makes, at module level or inside a function, a ``TYPE_CHECKING`` block included, and each
``importlib.import_module("rl_engine...")`` with a literal name, is checked against
:data:`LAYERS`: a module may import its own group and any group of a lower rank, nothing else.
So the ops never import the test helpers, the adapters, the audit or the GRPO loop; the test
helpers never import an adapter; the audit and the GRPO loop (same rank, two groups) never
import each other. Also: ``rl_engine/config.py`` is the only module that reads an
``RL_ENGINE_*`` environment variable (setting one, for this process or a child's ``env``, is
fine).

And every ``rl_engine`` import names a module that exists (what a move leaves behind).

The checker is plain functions over ``{module name: source}``, so the last tests feed it
synthetic violations and check that it reports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rl_engine

PACKAGE_DIR = Path(rl_engine.__file__).resolve().parent

# (rank, group, module prefixes), lowest first. A module imports its own group or a lower rank.
LAYERS: list[tuple[int, str, tuple[str, ...]]] = [
    (0, "core", ("rl_engine", "rl_engine._version", "rl_engine.config", "rl_engine.registry",
                 "rl_engine.run_info")),
    (1, "ops", ("rl_engine.ops",)),
    (2, "modules", ("rl_engine.nn", "rl_engine.parallel")),  # nn.Module drop-ins over the ops
    (2, "testing", ("rl_engine.testing",)),  # tolerances, invariance checkers, tiny models
    (3, "adapters", ("rl_engine.adapters",)),
    (3, "selftest", ("rl_engine.selftest",)),  # the ops' self-tests for rl-engine check
    (3, "drift", ("rl_engine.drift",)),  # drift metrics and DriftMonitor
    (4, "runner", ("rl_engine.engines", "rl_engine._cli_common")),  # shared by audit and loop
    (5, "audit", ("rl_engine.audit",)),
    (5, "loop", ("rl_engine.grpo",)),  # the GRPO loop
    (6, "top", ("rl_engine.cli", "rl_engine.harness", "rl_engine.integrations")),
]  # fmt: skip

CONFIG_MODULE = "rl_engine.config"
ENV_PREFIX = "RL_ENGINE_"


def layer_of(module: str) -> tuple[int, str] | None:
    """``(rank, group)`` of the longest prefix in :data:`LAYERS` that ``module`` is or is in
    (the bare ``rl_engine`` only for the package's ``__init__``)."""
    best: tuple[int, int, str] | None = None
    for rank, group, prefixes in LAYERS:
        for p in prefixes:
            inside = module.startswith(p + ".") and p != "rl_engine"
            if (module == p or inside) and (best is None or len(p) > best[0]):
                best = (len(p), rank, group)
    return None if best is None else (best[1], best[2])


def package_sources(root: Path = PACKAGE_DIR) -> dict[str, tuple[str, bool]]:
    """``{module name: (source, is_package)}`` of every ``.py`` file under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path.read_text(), is_pkg)
    return out


def _imports(tree: ast.AST, module: str, is_pkg: bool, known: set[str]) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every ``rl_engine`` import in ``tree``."""
    found = []
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if sub in known else base))
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id == "import_module")
            )
        ):
            found.append((node.lineno, node.args[0].value))
    ours = [(line, m) for line, m in found if m == "rl_engine" or m.startswith("rl_engine.")]
    return list(dict.fromkeys(ours))  # one report per line and module


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "string"`` assignments (an env name kept in a constant)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node.value.value
    return out


def _env_name(node: ast.AST | None, consts: dict[str, str]) -> str | None:
    """The (leading part of the) variable name an expression spells, where it can be told."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _env_name(node.left, consts)
    if isinstance(node, ast.JoinedStr) and node.values:
        return _env_name(node.values[0], consts)
    return None


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _env_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, variable)`` of every read of an ``RL_ENGINE_*`` variable: ``os.environ.get`` /
    ``setdefault``, ``os.environ[...]`` read, ``os.getenv``, ``... in os.environ``."""
    consts = _constants(tree)
    found: list[tuple[int, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr in ("get", "setdefault") and _is_environ(f.value)) or (
                f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"
            ):
                found.append((node.lineno, _env_name(node.args[0], consts)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            if node.func.id == "getenv":
                found.append((node.lineno, _env_name(node.args[0], consts)))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _is_environ(node.value):
                found.append((node.lineno, _env_name(node.slice, consts)))
        elif isinstance(node, ast.Compare) and any(
            isinstance(o, (ast.In, ast.NotIn)) for o in node.ops
        ):
            if any(_is_environ(c) for c in node.comparators):
                found.append((node.lineno, _env_name(node.left, consts)))
    return [(line, name) for line, name in found if name and name.startswith(ENV_PREFIX)]


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every broken rule in ``{module: (source, is_package)}``, one message each."""
    known = set(sources)
    out = []
    for module, (source, is_pkg) in sorted(sources.items()):
        tree = ast.parse(source, filename=module)
        mine = layer_of(module)
        if mine is None:
            out.append(f"{module}: in no layer; give it one in tests/test_layers.py LAYERS")
            continue
        for line, target in _imports(tree, module, is_pkg, known):
            theirs = layer_of(target)
            if theirs is None:
                out.append(f"{module}:{line} imports {target}, which is in no layer")
            elif theirs[1] != mine[1] and theirs[0] >= mine[0]:
                where = "the same rank" if theirs[0] == mine[0] else "a higher rank"
                out.append(
                    f"{module}:{line} ({mine[1]}, rank {mine[0]}) imports {target} "
                    f"({theirs[1]}, rank {theirs[0]}: {where})"
                )
        if module != CONFIG_MODULE:
            out += [
                f"{module}:{line} reads the environment variable {name}: only "
                f"{CONFIG_MODULE} reads {ENV_PREFIX}* (add a setting there)"
                for line, name in _env_reads(tree)
            ]
    return out


def missing_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every ``rl_engine`` import (as :func:`_imports` reads them) of a module that is not in
    ``sources``: what a move left behind."""
    known = set(sources)
    out = []
    for module, (source, is_pkg) in sorted(sources.items()):
        tree = ast.parse(source, filename=module)
        for line, target in _imports(tree, module, is_pkg, known):
            if target not in known:
                out.append(f"{module}:{line} imports {target}, which does not exist")
    return out


# ------------------------------------------------------------------------------ the package
def test_every_import_names_an_existing_module():
    problems = missing_imports(package_sources())
    assert not problems, "\n".join(problems)


def test_the_package_keeps_its_layers():
    sources = package_sources()
    assert "rl_engine.ops.det_gemm" in sources and "rl_engine.config" in sources
    problems = violations(sources)
    assert not problems, "layer rules broken:\n" + "\n".join(problems)


def test_every_layer_prefix_names_something():
    """A renamed package must not leave its rule behind unnoticed (integrations may not exist
    yet: it is listed ahead of its merge)."""
    sources = package_sources()
    for _, group, prefixes in LAYERS:
        for p in prefixes:
            if p == "rl_engine.integrations":
                continue
            assert any(m == p or m.startswith(p + ".") for m in sources), (group, p)


# ------------------------------------------------------------------ the checker itself fails
def _one(module: str, source: str, is_pkg: bool = False) -> list[str]:
    base = {m: ("", True) for m in ("rl_engine", "rl_engine.testing", "rl_engine.ops")}
    return violations({**base, module: (source, is_pkg)})


@pytest.mark.parametrize(
    ("module", "source", "imported"),
    [
        # a self-test's function-level import, as the ops had
        ("rl_engine.ops.fake", "def f():\n    from rl_engine.testing.invariance import x\n",
         "rl_engine.testing.invariance"),
        ("rl_engine.ops.fake", "import rl_engine.adapters.hf\n", "rl_engine.adapters.hf"),
        ("rl_engine.ops.fake", "from rl_engine.grpo import loop\n", "rl_engine.grpo"),
        ("rl_engine.ops.fake.sub", "from ...audit import cli\n", "rl_engine.audit"),
        ("rl_engine.ops.fake", "import importlib\nimportlib.import_module('rl_engine.harness.fuzz')\n",
         "rl_engine.harness.fuzz"),
        ("rl_engine.testing.fake", "from rl_engine.adapters.vllm import compat\n",
         "rl_engine.adapters.vllm"),
        ("rl_engine.audit.fake", "from rl_engine.grpo.loop import run\n", "rl_engine.grpo.loop"),
        ("rl_engine.grpo.fake", "def f():\n    from rl_engine.audit.worker import main\n",
         "rl_engine.audit.worker"),
        ("rl_engine.grpo.fake",
         "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rl_engine.audit import x\n",
         "rl_engine.audit"),
        ("rl_engine.drift.fake", "from rl_engine.engines import load_trainer\n", "rl_engine.engines"),
    ],
)  # fmt: skip
def test_an_import_violation_is_reported(module, source, imported):
    problems = _one(module, source)
    assert len(problems) == 1, problems
    assert problems[0].startswith(module + ":") and f"imports {imported} " in problems[0]


@pytest.mark.parametrize(
    "source",
    [
        "from rl_engine.registry import KernelRegistry\nfrom rl_engine import config\n",
        "from rl_engine.ops import _common\nfrom . import reference\n",
        "def f():\n    from rl_engine.ops.det_gemm import det_gemm\n",
    ],
)
def test_allowed_imports_are_not_reported(source):
    assert _one("rl_engine.ops.fake", source, is_pkg=True) == []


def test_an_import_of_a_moved_module_is_reported():
    base = {"rl_engine": ("", True), "rl_engine.drift": ("", True)}
    src = "def f():\n    from rl_engine.audit.monitor import DriftMonitor\n"
    (problem,) = missing_imports({**base, "rl_engine.integrations.x": (src, False)})
    assert "rl_engine.integrations.x:2 imports rl_engine.audit.monitor, which does not" in problem
    ok = "from rl_engine.drift import DriftMonitor\nfrom rl_engine import drift\n"
    assert missing_imports({**base, "rl_engine.integrations.x": (ok, False)}) == []


def test_a_module_outside_every_layer_is_reported():
    (problem,) = _one("rl_engine.newthing", "")
    assert "rl_engine.newthing: in no layer" in problem


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("import os\nx = os.environ.get('RL_ENGINE_VLLM') == '1'\n", "RL_ENGINE_VLLM"),
        ("import os\nx = os.environ['RL_ENGINE_TP_GROUPS']\n", "RL_ENGINE_TP_GROUPS"),
        ("import os\nx = os.getenv('RL_ENGINE_MODE')\n", "RL_ENGINE_MODE"),
        ("import os\nx = 'RL_ENGINE_VLLM' in os.environ\n", "RL_ENGINE_VLLM"),
        ("from os import environ\nx = environ.get('RL_ENGINE_X')\n", "RL_ENGINE_X"),
        # the name in a constant, as the fuzzer's lock variable was
        ("import os\n_ENV = 'RL_ENGINE_FUZZ_LOCK'\ndef f():\n    return os.environ.get(_ENV)\n",
         "RL_ENGINE_FUZZ_LOCK"),
        ("import os\nP = 'RL_ENGINE_'\nx = os.environ.get(P + 'MODE')\n", "RL_ENGINE_"),
        ("import os\nx = os.environ.get(f'RL_ENGINE_{1}')\n", "RL_ENGINE_"),
    ],
)  # fmt: skip
def test_an_env_read_outside_config_is_reported(source, name):
    (problem,) = _one("rl_engine.grpo.fake", source)
    assert problem.startswith("rl_engine.grpo.fake:") and f"variable {name}:" in problem
    assert _one("rl_engine.config", source) == []  # the one reader


def test_setting_a_variable_is_not_a_read():
    source = (
        "import os\n"
        "os.environ['RL_ENGINE_TP_GROUPS'] = '8'\n"
        "os.environ.pop('RL_ENGINE_TP_GROUPS', None)\n"
        "env = dict(os.environ)\n"
        "env['RL_ENGINE_VLLM'] = '1'\n"
        "x = os.environ.get('CUDA_VISIBLE_DEVICES')\n"
    )
    assert _one("rl_engine.grpo.fake", source) == []
