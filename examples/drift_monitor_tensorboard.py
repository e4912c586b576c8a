"""Log ``DriftMonitor`` metrics from a toy RL training step to TensorBoard and / or wandb.

::

    python examples/drift_monitor_tensorboard.py [--steps 3] [--logdir DIR] [--prefix drift/]

A toy policy (one linear layer over a 64-token vocabulary) plays both sides: the "rollout
engine" samples tokens from its logits computed in bfloat16, the "trainer" scores the same tokens
in float32 and takes a REINFORCE step. ``DriftMonitor`` compares the two log-probs of every
sampled token, the drift a real vLLM / trainer pair shows, on CPU in seconds.

TensorBoard (``torch.utils.tensorboard``, needs the ``tensorboard`` package) and wandb (offline
unless ``WANDB_MODE`` says otherwise) are used when importable; with neither, the metrics are
printed. Exit status 0 either way.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

from rl_engine.audit import DriftMonitor

VOCAB, HIDDEN, BATCH, MAX_LEN = 64, 32, 8, 96


def toy_step(
    model: torch.nn.Linear, opt: torch.optim.Optimizer, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rollout + training step; returns ``(rollout_logp, trainer_logp, loss_mask)``."""
    h = torch.randn(BATCH, MAX_LEN, HIDDEN, generator=g)
    lengths = torch.randint(MAX_LEN // 4, MAX_LEN + 1, (BATCH,), generator=g)
    mask = torch.arange(MAX_LEN)[None, :] < lengths[:, None]
    with torch.no_grad():  # the rollout engine: bfloat16 logits, fp32 log-probs (as vLLM)
        w, b = model.weight.bfloat16(), model.bias.bfloat16()
        logits = (h.bfloat16() @ w.T + b).float()
        tokens = torch.multinomial(logits.softmax(-1).view(-1, VOCAB), 1, generator=g)
        tokens = tokens.view(BATCH, MAX_LEN)
        rollout_logp = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    trainer_logp = model(h).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    advantages = torch.randn(BATCH, 1, generator=g)
    ratio = torch.exp(trainer_logp - rollout_logp)  # pi_train / pi_rollout
    loss = -(ratio * advantages * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return rollout_logp, trainer_logp.detach(), mask


def open_loggers(logdir: str) -> list[tuple[str, Any]]:
    loggers: list[tuple[str, Any]] = []
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("tensorboard not installed: skipping TensorBoard")
    else:
        loggers.append(("tensorboard", SummaryWriter(os.path.join(logdir, "tensorboard"))))
    try:
        import wandb
    except ImportError:
        print("wandb not installed: skipping wandb")
    else:
        run = wandb.init(
            project="rl_engine-drift-monitor",
            dir=logdir,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )
        loggers.append(("wandb", run))
    return loggers


def log(loggers: list[tuple[str, Any]], metrics: dict[str, float], step: int) -> None:
    for kind, logger in loggers:
        if kind == "tensorboard":
            for name, value in metrics.items():
                logger.add_scalar(name, value, step)
        else:
            logger.log(metrics, step=step)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--logdir", default=None, help="default: a new temporary folder")
    ap.add_argument("--prefix", default="drift/")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(HIDDEN, VOCAB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = DriftMonitor(position_bins=(0, 32, 64), seqlen_bins=(0, 48), prefix=args.prefix)
    logdir = args.logdir or tempfile.mkdtemp(prefix="drift_monitor_")
    loggers = open_loggers(logdir)

    for step in range(args.steps):
        rollout_logp, trainer_logp, mask = toy_step(model, opt, g)
        metrics = monitor(rollout_logp, trainer_logp, mask)  # one host sync
        log(loggers, metrics, step)
        if not loggers or step == args.steps - 1:
            print(f"step {step}:")
            for name, value in metrics.items():
                print(f"  {name:<42} {value:.6g}")

    for kind, logger in loggers:
        if kind == "tensorboard":
            logger.close()
        else:
            logger.finish()
    if loggers:
        print(f"logged {args.steps} steps to {', '.join(k for k, _ in loggers)} under {logdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
