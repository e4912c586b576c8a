"""The figure of ``rl-engine grpo``: reward per step and the importance-ratio range per step."""

from __future__ import annotations

from typing import Any

COLORS = {"stock": "tab:red", "rl_engine": "tab:green"}


def grpo_figure(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in report["configurations"].items():
        steps = [s["step"] for s in res["steps"]]
        color = COLORS.get(name)
        ax1.plot(
            steps, [s["reward_mean"] for s in res["steps"]], marker="o", color=color, label=name
        )
        lo = [s["ratio_min"] for s in res["steps"]]
        hi = [s["ratio_max"] for s in res["steps"]]
        exact = all(a == 1.0 and b == 1.0 for a, b in zip(lo, hi))
        ax2.fill_between(steps, lo, hi, color=color, alpha=0.25, step=None)
        ax2.plot(steps, lo, color=color, marker="v", ms=4)
        ax2.plot(
            steps,
            hi,
            color=color,
            marker="^",
            ms=4,
            label=f"{name} ({'exactly 1.0 on every token' if exact else 'min..max'})",
        )
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean reward")
    ax1.set_title("Reward (fraction of tokens in the target band)")
    ax1.legend(fontsize=8)
    ax2.axhline(1.0, color="black", lw=0.6, ls=":")
    ax2.set_xlabel("step")
    ax2.set_ylabel("p_trainer / p_rollout of each sampled token")
    ax2.set_title("Importance ratio over all sampled tokens (min..max)")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(
        f"rl-engine grpo: {report['model']} · trainer {report['trainer']} · {report['dtype']} · "
        "weights synced into the running vLLM engine after every step",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
