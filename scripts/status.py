"""Which README status rows rest on results made by code that differs now.

    python scripts/status.py            # one line per row: current, stale (since when, which files)
    python scripts/status.py --mark     # also writes the stale note into README.md's status table

Each status row of README.md names the result files it quotes and the code that decides its
numbers (:data:`ROWS`). A result's code is found from what it recorded:

* ``code_hash`` (every result JSON written now; :func:`rl_engine.run_info.code_hash`): the commit
  whose package sources have that hash, searched in the history of ``rl_engine/``;
* otherwise ("no code hash recorded") the commit that last changed the result file (results are
  committed with, or after, the code that made them), and the file's date.

A row is stale when any of its files that matter differs between that commit and the working tree
now; "stale since" is the date of the first commit after it that changed one of them. ``--mark``
appends ``*(stale since <date>)*`` to a stale row's result cell (and removes it from a current
one); no measured number is changed. Exit status: 0, or 1 with ``--check`` when a row is stale.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
R = "benchmarks/results/"
OPS = "rl_engine/ops/"
ENGINES = ["rl_engine/adapters", "rl_engine/ops", "rl_engine/parallel.py", "rl_engine/nn.py"]
# what the audit and the GRPO loop share: the engine runner and the drift metrics
RUNNER = ["rl_engine/engines.py", "rl_engine/drift"]


@dataclass(frozen=True)
class Row:
    """A status row: the start of its first cell, the result files it quotes, the code (files
    or folders) whose change makes them stale. No results: measured by the CPU suite itself."""

    key: str
    results: tuple[str, ...]
    code: tuple[str, ...]


def _row(key: str, results: list[str], code: list[str]) -> Row:
    return Row(key, tuple(R + r for r in results), tuple(code))


ROWS = [
    _row("rollout vs trainer on the CPU", [], []),
    _row("real CUDA vLLM", ["h200/session24_gpu/e2e_qwen2_llama.json"],
         [*ENGINES, *RUNNER, "scripts/gpu_vllm_e2e.py"]),
    _row("drift audit on the GPU", ["h200/audit_qwen2/report.json"],
         [*ENGINES, *RUNNER, "rl_engine/audit"]),
    _row("GRPO on CUDA vLLM", ["h200/grpo_qwen2_0.5b_hf/grpo.json",
                               "h200/grpo_qwen2_0.5b_megatron/grpo.json"],
         [*ENGINES, *RUNNER, "rl_engine/grpo"]),
    _row("mixture of experts", ["h200/gpu_vllm_e2e_qwen3_qwen2_moe.json",
                                "h200/gpu_vllm_e2e_mixtral.json", "h200/vllm_moe_ep2.json",
                                "h200/session17_gpu/vllm_ep2.json",
                                "h100/session14_gpu/vllm_ep4.json",
                                "h100/session14_gpu/vllm_ep2.json",
                                "h100/session15_gpu/vllm_etp2.json",
                                "h200/session16_gpu/megatron_moe_tp2.log",
                                "h200/session19_gpu/gpu_vtests_moe_tests.json",
                                "h200/session24_gpu/e2e_qwen2_moe.json"],
         [*ENGINES, *RUNNER, "rl_engine/audit", "scripts/gpu_vllm_e2e.py",
          "scripts/gpu_moe_ep.sh"]),
    _row("MoE layer vs vLLM", ["h200/moe.json"],
         [OPS + "moe_experts", OPS + "moe_router", OPS + "moe_combine", OPS + "det_gemm",
          "benchmarks/bench_moe.py"]),
    _row("MoE rollout", ["h200/rollout_qwen3_moe_tp1.json"],
         [*ENGINES, "benchmarks/bench_rollout.py"]),
    _row("MoE trainer block", ["h200/moe_train.json", "h200/session17_gpu/g8_train.log"],
         [OPS + "moe_experts", OPS + "moe_router", OPS + "moe_combine", OPS + "det_gemm",
          "rl_engine/adapters/hf", "rl_engine/adapters/megatron/moe.py",
          "benchmarks/bench_moe_train.py"]),
    _row("TRL 1.16", ["h100/session16_gpu/trl_gpu.json"],
         [*ENGINES, "rl_engine/integrations", "rl_engine/harness/trl_check.py"]),
    _row("det_gemm CUDA C++ provider", ["h100/session16_gpu/det_gemm_cuda.json",
                                         "h200/session20_gpu/csrc_splitk_det_gemm_cuda.json",
                                         "h200/session22_gpu/e2e_cuda_family_unfused.json",
                                         "h200/session23_gpu/csrc_retime_det_gemm_cuda.json",
                                         "h200/session23_gpu/e2e_cuda_family_llama.json",
                                         "h200/session23_gpu/grpo_cuda_family.json"],
         ["csrc", OPS + "det_gemm/cuda.py", OPS + "det_gemm/config.py",
          "benchmarks/bench_det_gemm_cuda.py", *ENGINES, "rl_engine/drift",
          "scripts/gpu_vllm_e2e.py"]),
    _row("trainer step vs the stacks", ["h100/trainer_hf.json", "h200/trainer_hf.json",
                                        "h200/session19_gpu/trainer_hf.json"],
         [*ENGINES, "benchmarks/bench_trainer_hf.py"]),
    _row("trainer invariance on the GPU", [f"h200/session21_gpu/gpu_tests_e{i}.json"
                                           for i in range(1, 9)],
         ["rl_engine", "tests"]),
    _row("invariance fuzzing on the GPU", ["h100/fuzz_merged_65d0dbdd.json",
                                           "h200/fuzz_run10_seed12.json"], ["rl_engine"]),
    _row("tensor-parallel degree invariance", ["h200/session21_gpu/vllm_tp4.json",
                                               "h200/session20_gpu/tp4_megatron.log",
                                               "h100/tp_run2_x4/tp.log",
                                               "h200/tp_run1/vllm_tp.json",
                                               "h100/tp_exchange.json"],
         [OPS + "det_gemm", "rl_engine/parallel.py", "rl_engine/adapters",
          "rl_engine/harness/tp_check.py", "rl_engine/harness/vllm_tp_check.py",
          "benchmarks/bench_tp_exchange.py"]),
    _row("rollout at TP 2 / 4", ["h200/session20_gpu/rollout_llama8b_width_tp4.json",
                                 "h200/session19_gpu/rollout_llama8b_width_tp2.json",
                                 "h200/session17_gpu/rollout_llama8b_width_tp2.json",
                                 "h200/session17_gpu/rollout_llama8b_width_tp1_g8.json"],
         [*ENGINES, "benchmarks/bench_rollout.py"]),
    _row("rollout throughput vs stock vLLM", ["h100/rollout.json", "h200/rollout.json"],
         [*ENGINES, "benchmarks/bench_rollout.py"]),
    _row("det_gemm bf16 vs cuBLAS", ["h200/det_gemm.json"],
         [OPS + "det_gemm", "benchmarks/bench_det_gemm.py"]),
    _row("attention prefill vs SDPA", ["h200/attention.json", "h100/attention.json"],
         [OPS + "attention", "benchmarks/bench_attention.py"]),
    _row("rms_norm fwd / bwd", ["h200/rms_norm.json"],
         [OPS + "rms_norm", "benchmarks/bench_rms_norm.py"]),
    _row("silu_and_mul fwd / bwd", ["h200/silu_and_mul.json"],
         [OPS + "silu_and_mul", "benchmarks/bench_silu_and_mul.py"]),
    _row("poly_norm fwd / bwd", ["h200/poly_norm.json", "h100/poly_norm_final_code.json"],
         [OPS + "poly_norm", "benchmarks/bench_poly_norm.py"]),
    _row("linear_logp, T 8192", ["h200/linear_logp.json"],
         [OPS + "linear_logp", OPS + "det_gemm", "benchmarks/bench_linear_logp.py"]),
    _row("GRPO loss from the LM head", ["h200/grpo_loss.json"],
         [OPS + "grpo_loss", OPS + "linear_logp", "benchmarks/bench_grpo_loss.py"]),
    _row("norms on DTensors", [], []),
]  # fmt: skip


@dataclass
class Result:
    path: str
    recorded: str  # "code hash <h>" / "no code hash recorded"
    commit: str | None  # the commit the code is taken from (None: none found)
    date: str  # the result's date (YYYY-MM-DD)
    changed: list[str] = field(default_factory=list)  # files that matter, changed since
    stale_since: str | None = None  # date of the first commit that changed one, "uncommitted"


@dataclass
class RowStatus:
    row: Row
    results: list[Result]

    @property
    def stale_since(self) -> str | None:
        dates = [r.stale_since for r in self.results if r.stale_since]
        return min(dates) if dates else None


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True
    ).stdout


class Repo:
    """The git history of ``root`` as the status tool reads it."""

    def __init__(self, root: Path, package: str = "rl_engine") -> None:
        self.root, self.package = Path(root), package
        self._by_hash: dict[str, str] | None = None

    def commit_of_hash(self, code_hash: str) -> str | None:
        """The latest commit whose ``<package>/**/*.py`` have ``code_hash`` (None: none): the
        last commit before the next one that changed the package (HEAD if none did), so a
        result measured after commits that touched only scripts or benchmarks is dated there."""
        if self._by_hash is None:
            self._by_hash = self._hashes()
        return self._by_hash.get(code_hash)

    def _hashes(self) -> dict[str, str]:
        from rl_engine.run_info import code_hash_of

        commits = _git(self.root, "rev-list", "HEAD", "--", self.package).split()
        blobs: dict[str, bytes] = {}
        out: dict[str, str] = {}
        with subprocess.Popen(
            ["git", "-C", str(self.root), "cat-file", "--batch"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        ) as cat:  # fmt: skip
            assert cat.stdin is not None and cat.stdout is not None
            newer = None  # the package commit after c (newest first)
            for c in commits:  # newest first: a hash maps to its latest commit
                files = {}
                tree = _git(self.root, "ls-tree", "-r", c, "--", self.package + "/")
                for line in tree.splitlines():
                    meta, path = line.split("\t", 1)
                    if not path.endswith(".py"):
                        continue
                    sha = meta.split()[2]
                    if sha not in blobs:
                        cat.stdin.write(sha.encode() + b"\n")
                        cat.stdin.flush()
                        size = int(cat.stdout.readline().split()[2])
                        blobs[sha] = cat.stdout.read(size + 1)[:-1]
                    files[path[len(self.package) + 1 :]] = blobs[sha]
                latest = "HEAD" if newer is None else newer + "~1"
                if code_hash_of(files) not in out:
                    out[code_hash_of(files)] = _git(self.root, "rev-parse", latest).strip()
                newer = c
            cat.stdin.close()
        return out

    def last_commit_of(self, path: str) -> str | None:
        return _git(self.root, "log", "-1", "--format=%H", "--", path).strip() or None

    def changed_since(self, commit: str, paths: tuple[str, ...]) -> tuple[list[str], str | None]:
        """Files of ``paths`` that differ between ``commit`` and the working tree, and the date of
        the first later commit that changed one (``"uncommitted"`` when only the tree did)."""
        if not paths:
            return [], None
        files = _git(self.root, "diff", "--name-only", commit, "--", *paths).split()
        files += [
            f for f in _git(self.root, "ls-files", "--others", "--exclude-standard", "--",
                            *paths).split() if f.endswith(".py")
        ]  # fmt: skip
        if not files:
            return [], None
        dates = _git(self.root, "log", "--reverse", "--format=%cs", f"{commit}..HEAD", "--", *paths)
        return sorted(files), (dates.split() or ["uncommitted"])[0]


def _recorded(path: Path) -> tuple[str | None, str | None]:
    """``(code_hash, date)`` a result file recorded (JSON; ``None`` where absent)."""
    if path.suffix != ".json":
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    env = data.get("environment") if isinstance(data.get("environment"), dict) else {}
    h = data.get("code_hash") or env.get("code_hash")
    date = data.get("date") or env.get("date")
    return h, (str(date)[:10] if date else None)


def result_status(repo: Repo, rel: str, code: tuple[str, ...]) -> Result:
    path = repo.root / rel
    h, date = _recorded(path)
    file_commit = repo.last_commit_of(rel)
    if date is None:
        date = _git(repo.root, "log", "-1", "--format=%cs", "--", rel).strip() or "unknown"
    commit = repo.commit_of_hash(h) if h else None
    if h:
        recorded = f"code hash {h[:8]}" + ("" if commit else " (matches no commit)")
    else:
        recorded = "no code hash recorded"
    commit = commit or file_commit
    res = Result(rel, recorded, commit, date)
    if not path.exists():
        res.recorded = "result file missing"
    elif commit is not None:
        res.changed, res.stale_since = repo.changed_since(commit, code)
    return res


def status(root: Path, rows: list[Row], package: str = "rl_engine") -> list[RowStatus]:
    repo = Repo(root, package)
    return [RowStatus(row, [result_status(repo, r, row.code) for r in row.results]) for row in rows]


def report(statuses: list[RowStatus]) -> str:
    lines = []
    for st in statuses:
        if not st.row.results:
            lines.append(f"-       {st.row.key}: measured by the CPU suite (no result file)")
            continue
        since = st.stale_since
        lines.append(f"{'STALE' if since else 'current':7} {st.row.key}"
                     + (f": stale since {since}" if since else ""))  # fmt: skip
        for r in st.results:
            where = f"commit {r.commit[:8]}" if r.commit else "no commit"
            what = f"{r.recorded}, {r.date}, {where}"
            if r.changed:
                shown = ", ".join(r.changed[:4]) + (" ..." if len(r.changed) > 4 else "")
                what += f"; changed since ({r.stale_since}): {len(r.changed)} files: {shown}"
            lines.append(f"        {r.path}: {what}")
    return "\n".join(lines)


_MARK = re.compile(r" \*\(stale since [^)]*\)\*")


def mark(readme: str, statuses: list[RowStatus]) -> str:
    """README text with each status row's result cell ending in ``*(stale since <date>)*`` when
    stale and without it when current; nothing else changes."""
    by_key = {st.row.key: st for st in statuses}
    out = []
    for line in readme.split("\n"):
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) >= 3:
            key = next((k for k in by_key if cells[0][2:].startswith(k)), None)
            if key is not None:
                cells[1] = _MARK.sub("", cells[1])
                since = by_key[key].stale_since
                if since:
                    cells[1] += f" *(stale since {since})*"
                line = " | ".join(cells)
        out.append(line)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mark", action="store_true", help="write the stale notes into README.md")
    p.add_argument("--check", action="store_true", help="exit 1 when a row is stale")
    args = p.parse_args(argv)
    statuses = status(ROOT, ROWS)
    print(report(statuses))
    readme = ROOT / "README.md"
    text = readme.read_text()
    missing = [r.key for r in ROWS if f"| {r.key}" not in text]
    if missing:
        print(f"README has no status row starting with: {missing}", file=sys.stderr)
        return 2
    if args.mark:
        readme.write_text(mark(text, statuses))
        print(f"marked {readme}")
    return 1 if args.check and any(st.stale_since for st in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
