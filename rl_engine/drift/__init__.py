"""Rollout-vs-trainer log-prob drift: the numbers the audit (``rl-engine audit``), the GRPO loop
(``rl-engine grpo``) and a user's training loop report.

* :mod:`rl_engine.drift.metrics`: the per-run comparison (:func:`~rl_engine.drift.metrics.compare`:
  bitwise-equal fraction, deltas, importance ratio, k1 / k3 KL) and the numerics-family checks
  (:func:`~rl_engine.drift.metrics.provenance_check`).
* :class:`DriftMonitor` (:mod:`rl_engine.drift.monitor`, with :data:`METRIC_NAMES` and
  :data:`METRIC_DOCS`): the drift metrics of one training batch for a logger, one host sync.

It sits below :mod:`rl_engine.audit` and :mod:`rl_engine.grpo`, which both use it and do not
import each other. ``from rl_engine.audit import DriftMonitor`` keeps working. The monitor is
loaded on first use, so importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_engine.drift.monitor import METRIC_DOCS, METRIC_NAMES, DriftMonitor

__all__ = ["METRIC_DOCS", "METRIC_NAMES", "DriftMonitor"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rl_engine.drift import monitor

        return getattr(monitor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
