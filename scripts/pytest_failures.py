"""pytest plugin of ``scripts/gpu_check.sh``: every failure is appended to
``$OUT/failures.txt`` (node id, phase, the end of its report) as it happens, so a run cut by the
device's time limit still names what failed (pytest names failures only in its final summary)."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 (pytest's TestReport)
    # under pytest-xdist the controller gets every worker's reports: it alone writes
    if not report.failed or "OUT" not in os.environ or "PYTEST_XDIST_WORKER" in os.environ:
        return
    with open(os.path.join(os.environ["OUT"], "failures.txt"), "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
