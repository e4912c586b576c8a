"""The drift audit: ``rl-engine audit`` / ``python -m rl_engine.audit`` (docs/audit.md).

:class:`DriftMonitor` (with :data:`METRIC_NAMES`) is the in-training counterpart: drift metrics
of one batch for a logger. It lives in :mod:`rl_engine.drift` (shared with the GRPO loop) and is
re-exported here; both are loaded on first use, so importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_engine.drift.monitor import METRIC_DOCS, METRIC_NAMES, DriftMonitor

__all__ = ["METRIC_DOCS", "METRIC_NAMES", "DriftMonitor"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import rl_engine.drift

        return getattr(rl_engine.drift, name)  # rl_engine.drift loads it on first use
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
