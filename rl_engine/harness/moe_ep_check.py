"""Expert parallelism's exact per-slot sum, checked across processes (gloo on the CPU, NCCL on
GPUs): every rank of an EP group of size ``ep`` computes ``moe_experts`` for its experts only
(``expert_map``; the other slots are ``+0`` rows), the [T, k, H] slots are summed over the group
(:func:`rl_engine.adapters.vllm.moe.ep_slot_sum`, the vLLM plugin's EP path) and combined
locally with ``moe_combine``; the result must equal EP 1 bitwise on every rank::

    python -m rl_engine.harness.moe_ep_check --ep 2,4 [--device cuda]

exits 1 unless every degree equals EP 1 bitwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from rl_engine.harness import _spawn

EXPERTS = 8  # experts of :func:`case`; an EP degree must divide it


def case(device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """``(x, ids, weights, w13, w2, shared, shared_gate)``: 37 tokens, 8 experts, top-3, bf16."""
    from rl_engine.ops import moe_topk

    g = torch.Generator().manual_seed(0)
    t, h, i, n = 37, 64, 32, EXPERTS
    x = torch.randn(t, h, generator=g).bfloat16()
    logits = torch.randn(t, n, generator=g).bfloat16()
    w13 = (0.1 * torch.randn(n, 2 * i, h, generator=g)).bfloat16()
    w2 = (0.1 * torch.randn(n, h, i, generator=g)).bfloat16()
    shared = torch.randn(t, h, generator=g).bfloat16()
    gate = torch.randn(t, 1, generator=g).bfloat16()
    x, logits, w13, w2, shared, gate = (v.to(device) for v in (x, logits, w13, w2, shared, gate))
    weights, ids = moe_topk(logits, 3, scoring="softmax", renormalize=True)
    return x, ids, weights, w13, w2, shared, gate


def reference(device: str = "cpu") -> torch.Tensor:
    """EP 1: every expert local."""
    from rl_engine.ops import moe_combine, moe_experts

    x, ids, weights, w13, w2, shared, gate = case(device)
    return moe_combine(moe_experts(x, ids, w13, w2), weights, shared=shared, shared_gate=gate)


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    from rl_engine.adapters.vllm.moe import ep_slot_sum
    from rl_engine.ops import moe_combine, moe_experts

    dist = _spawn.init(rank, world, store)
    device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
    x, ids, weights, w13, w2, shared, gate = case(device)
    n = w13.shape[0]
    per = n // world
    lo, hi = rank * per, (rank + 1) * per
    expert_map = torch.full((n,), -1, dtype=torch.int64, device=device)
    expert_map[lo:hi] = torch.arange(per, device=device)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    y = moe_experts(x, ids, w13[lo:hi].contiguous(), w2[lo:hi].contiguous(), expert_map=expert_map)
    out = moe_combine(ep_slot_sum(y, all_reduce), weights, shared=shared, shared_gate=gate)
    ref = reference(device)  # EP 1 on the same device (same provider family)
    torch.save((out.cpu(), ref.cpu()), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _ep_error(ep: int) -> str | None:
    """Why ``ep`` cannot split the case's experts, or ``None``."""
    if ep < 1 or EXPERTS % ep:
        return f"ep {ep}: the EP degree must divide the case's {EXPERTS} experts"
    return None


def run(ep: int, device: str = "cpu") -> list[str]:
    """Run EP ``ep`` (a divisor of 8) in ``ep`` processes; returns the ranks that differ from
    EP 1 (empty: all bitwise equal)."""
    reason = _ep_error(ep)
    if reason is not None:
        raise ValueError(reason)
    bad = []
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn.spawn(_worker, ep, (out_dir,), device)
        for r in range(ep):
            got, ref = torch.load(os.path.join(out_dir, f"rank{r}.pt"))
            if not torch.equal(got, ref):
                bad.append(f"EP {ep} rank {r}: max |d| {(got.float() - ref.float()).abs().max()}")
    return bad


def main(argv: list[str] | None = None) -> int:
    """Run :func:`run` for each degree of ``--ep``; 0 when all equal EP 1 bitwise, else 1."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", default="2", help="EP degrees, comma separated (divisors of 8)")
    p.add_argument("--device", default="cpu", help="cpu, cuda (a GPU per rank) or auto")
    args = p.parse_args(argv)
    try:
        degrees = [int(x) for x in args.ep.split(",")]
    except ValueError:
        p.error(f"--ep {args.ep!r}: expected comma separated integers")
    for reason in filter(None, map(_ep_error, degrees)):  # all checked before any runs
        p.error(f"--{reason}")
    status = 0
    for ep in degrees:
        bad = run(ep, args.device)
        print(f"EP {ep} vs EP 1: {'bitwise equal' if not bad else 'MISMATCH'}")
        for line in bad:
            print("  " + line)
        status |= bool(bad)
    return status


if __name__ == "__main__":
    sys.exit(main())
