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


def localize_figure(report: dict[str, Any], path: str) -> None:
    """max |d| between the two sides at every hooked point, in compute order, per configuration
    (bitwise equal points drawn at 1e-12)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"stock": "tab:red", "rl_engine": "tab:green", "vllm-batch-invariant": "tab:blue"}
    fig, ax = plt.subplots(figsize=(11, 4))
    names: list[str] = []
    for name, m in report["configurations"].items():
        loc = m.get("localize")
        if loc is None:
            continue
        names = [p["point"] for p in loc["points"]]
        d = [p["max_abs_delta"] if not p["bitwise_equal"] else 1e-12 for p in loc["points"]]
        first = loc["first_divergence"] or "none"
        ax.plot(
            range(len(d)),
            np.clip(d, 1e-12, None),
            marker="o",
            ms=3,
            color=colors.get(name),
            label=f"{name} (first divergence: {first})",
        )
    step = max(1, len(names) // 24)
    ax.set_xticks(range(0, len(names), step))
    ax.set_xticklabels(names[::step], rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("max |rollout - trainer| (1e-12: bitwise equal)")
    ax.set_title("Where the two engines part: activations of one sequence, layer by layer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
