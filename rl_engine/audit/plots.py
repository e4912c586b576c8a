"""The audit's figure: |Δlogp| distribution (stock vs rl_engine) and mismatch rate by position."""

from __future__ import annotations

from typing import Any

import numpy as np


def drift_figure(report: dict[str, Any], deltas: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"stock": "tab:red", "rl_engine": "tab:green"}
    floor = 1e-12
    bins = np.logspace(-12, 1, 40)
    for name, d in deltas.items():
        d = np.asarray(d)
        zero = float(np.mean(d == 0)) * 100
        ax1.hist(
            np.clip(d, floor, None),
            bins=bins,
            alpha=0.6,
            color=colors.get(name),
            label=f"{name} ({zero:.1f}% exactly 0, plotted at 1e-12)",
        )
        rate = report["configurations"][name]["mismatch_rate_by_position"]
        ax2.plot(
            np.arange(len(rate)),
            100 * np.asarray(rate),
            marker="o",
            ms=3,
            color=colors.get(name),
            label=name,
        )
    ax1.set_xscale("log")
    ax1.set_xlabel("|logp rollout - logp trainer|")
    ax1.set_ylabel("sampled tokens")
    ax1.set_title("Distribution of |Δlogp|")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("generated token position")
    ax2.set_ylabel("% not bitwise equal")
    ax2.set_ylim(-2, 102)
    ax2.set_title("Mismatch rate by token position")
    ax2.legend(fontsize=8)
    fig.suptitle(
        f"rl-engine audit: {report['model']} · trainer {report['trainer']} · "
        f"{report['dtype']} · T={report['temperature']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
