"""scripts/status.py on a synthetic repository: a result with a code hash is mapped to its commit,
one without to its file's commit; a later change in the files that matter makes its row stale
since that commit's date; ``mark`` adds / removes the note and changes no number."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rl_engine.run_info import code_hash_of

ROOT = Path(__file__).resolve().parent.parent

README = """# x

## Status

| | result | target |
| --- | --- | --- |
| op_a speed (H200) | **0.91x** | 0.90x — met |
| op_b speed | 1.5x | — |
| op_c accuracy | 3 / 3 *(stale since 2020-01-01)* | — |
| unrelated row | 7 | — |
"""


@pytest.fixture
def status_mod(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import status

    return status


def _commit(repo: Path, date: str, msg: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_DATE": f"{date}T12:00:00", "GIT_COMMITTER_DATE":
           f"{date}T12:00:00", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", msg], check=True, env=env)


def _write(repo: Path, rel: str, text: str) -> None:
    (repo / rel).parent.mkdir(parents=True, exist_ok=True)
    (repo / rel).write_text(text)


def _pkg_hash(repo: Path) -> str:
    pkg = repo / "rl_engine"
    return code_hash_of({f.relative_to(pkg).as_posix(): f.read_bytes() for f in pkg.rglob("*.py")})


def test_status_on_a_synthetic_results_folder(tmp_path, status_mod):
    repo = tmp_path
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _write(repo, "rl_engine/ops/a.py", "A = 1\n")
    _write(repo, "rl_engine/ops/b.py", "B = 1\n")
    _write(repo, "rl_engine/ops/c.py", "C = 1\n")
    _write(repo, "README.md", README)
    _commit(repo, "2026-01-01", "code")
    h1 = _pkg_hash(repo)
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.strip()  # fmt: skip
    # results: a's with the code hash (measured on the first commit, committed later), b's and
    # c's without one
    _write(repo, "benchmarks/results/g/a.json", json.dumps({"date": "2026-01-02", "code_hash": h1}))
    _write(repo, "benchmarks/results/g/b.json", json.dumps({"date": "2026-01-02"}))
    _write(repo, "rl_engine/ops/b.py", "B = 2\n")  # b's result committed with b's code
    _write(repo, "benchmarks/results/g/c.log", "3 / 3 passed\n")
    _commit(repo, "2026-01-03", "results")
    _write(repo, "rl_engine/ops/a.py", "A = 2\n")  # a changes after its measurement
    _commit(repo, "2026-01-05", "a changes")
    _write(repo, "rl_engine/ops/a.py", "A = 3\n")
    _commit(repo, "2026-01-07", "a again")

    R = status_mod.Row
    rows = [
        R("op_a speed", ("benchmarks/results/g/a.json",), ("rl_engine/ops/a.py",)),
        R("op_b speed", ("benchmarks/results/g/b.json",), ("rl_engine/ops/b.py",)),
        R("op_c accuracy", ("benchmarks/results/g/c.log",), ("rl_engine/ops/c.py",)),
    ]
    a, b, c = status_mod.status(repo, rows)
    (ra,) = a.results
    assert ra.recorded == f"code hash {h1[:8]}" and ra.commit == first
    assert ra.changed == ["rl_engine/ops/a.py"] and a.stale_since == "2026-01-05"
    (rb,) = b.results
    assert rb.recorded == "no code hash recorded" and rb.date == "2026-01-02"
    assert rb.changed == [] and b.stale_since is None
    (rc,) = c.results
    assert rc.recorded == "no code hash recorded" and rc.date == "2026-01-03"
    assert c.stale_since is None
    text = status_mod.report([a, b, c])
    assert "STALE   op_a speed: stale since 2026-01-05" in text
    assert "current op_b speed" in text and "no code hash recorded, 2026-01-02" in text

    # uncommitted changes count too, dated "uncommitted"
    _write(repo, "rl_engine/ops/b.py", "B = 3\n")
    (b2,) = status_mod.status(repo, rows[1:2])
    assert b2.stale_since == "uncommitted" and b2.results[0].changed == ["rl_engine/ops/b.py"]

    marked = status_mod.mark(README, [a, b, c])
    assert "| op_a speed (H200) | **0.91x** *(stale since 2026-01-05)* | 0.90x — met |" in marked
    assert "| op_b speed | 1.5x | — |" in marked  # current: unchanged
    assert "| op_c accuracy | 3 / 3 | — |" in marked  # an old note removed: current again
    assert status_mod.mark(marked, [a, b, c]) == marked  # idempotent
    # no number changed: the marked text without its notes is the original without its notes
    strip = status_mod._MARK.sub
    assert strip("", marked) == strip("", README)


def test_every_readme_row_is_known(status_mod):
    """Each row of :data:`status.ROWS` names a README status row and only files that exist."""
    text = (ROOT / "README.md").read_text()
    for row in status_mod.ROWS:
        assert f"| {row.key}" in text, row.key
        for path in (*row.results, *row.code):
            assert (ROOT / path).exists(), path
