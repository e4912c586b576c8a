"""pytest plugin of ``scripts/gpu_check.sh``: every failure is appended to
``$OUT/failures.txt`` (node id, phase, the end of its report) as it happens, so a run cut by the
device's time limit still names what failed (pytest names failures only in its final summary)."""

from __future__ import annotations

import os

import pytest


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 (pytest's TestReport)
    # under pytest-xdist the controller gets every worker's reports: it alone writes
    if not report.failed or "OUT" not in os.environ or "PYTEST_XDIST_WORKER" in os.environ:
        return
    with open(os.path.join(os.environ["OUT"], "failures.txt"), "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


# The GPU run of tests/adapters printed its summary, then hung in the interpreter's exit until
# the step's timeout (2026-11-28, H100: vLLM engines and process groups of the in-process tests
# left threads behind), so a passing run read as exit 124. The controller leaves at once after
# pytest's last hook, with pytest's own exit status (the workers end as usual).
_status: list[int] = []


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001 (pytest's Session)
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:  # noqa: ANN001 (pytest's Config)
    if _status and "PYTEST_XDIST_WORKER" not in os.environ:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[-1])
