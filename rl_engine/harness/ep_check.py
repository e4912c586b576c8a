"""Expert-parallel degree invariance of the Megatron MoE trainer with real process groups (gloo
on the CPU, NCCL on GPUs).

The EP ranks are data-parallel ranks with their own tokens (megatron's layout): a fixed packed
batch of sequences is split into ``ep`` contiguous blocks of whole sequences, rank ``r``
computes the token log-probs of block ``r`` and the gradients of their weighted sum. At EP = 1
one process computes the whole batch. :func:`compare` checks the ranks' log-probs, in rank
order, against EP = 1's and each rank's expert-weight gradients (its ``E / EP`` experts)
against the same experts' rows of EP = 1's. The other gradients (attention, router, norms,
shared expert) are data-parallel partial sums at EP > 1, reduced by megatron's data-parallel
all-reduce afterwards: not compared here.

    python -m rl_engine.harness.ep_check --model PATH --ep 1,2 [--dtype float32]
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from rl_engine.harness import _spawn
from rl_engine.harness.tp_check import batch

LENGTHS = (7, 12, 4, 9, 5, 11, 3, 6)


def split(cu: torch.Tensor, ep: int, rank: int) -> tuple[int, int, torch.Tensor]:
    """Token range ``[a, b)`` and local ``cu_seqlens`` of rank ``rank``'s block of sequences."""
    n = cu.numel() - 1
    if n % ep:
        raise ValueError(f"{n} sequences do not split over {ep} ranks")
    per = n // ep
    c = cu[rank * per : (rank + 1) * per + 1]
    return int(c[0]), int(c[-1]), (c - c[0]).to(torch.int32)


def _worker(rank: int, world: int, store: str, model: str, dtype: str, out: str) -> None:
    torch.set_num_threads(1)
    # the adapter first: importing it quiets megatron-core's import-time notices
    from rl_engine.adapters.megatron import from_pretrained, token_logprobs
    from rl_engine.adapters.megatron.cpu_shim import install
    from rl_engine.harness._spawn import init

    dist = init(rank, world, store)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    install()
    gpt = from_pretrained(model, dtype=getattr(torch, dtype))
    ids, cu = batch(gpt.rl_engine_vocab_size, LENGTHS)
    # packed log-probs [T - 1]: entry j is token j + 1's (0 where it starts a sequence)
    weights = torch.linspace(-1.0, 2.0, ids.numel() - 1)
    a, b, cu_r = split(cu, world, rank)
    device = next(gpt.parameters()).device
    logp = token_logprobs(gpt, ids[a:b].to(device), cu_seqlens=cu_r.to(device))
    (logp * weights[a : b - 1].to(device, logp.dtype)).sum().backward()
    grads = {
        n: p.grad.detach().cpu()
        for n, p in gpt.named_parameters()
        if p.grad is not None and ".mlp.experts." in n
    }
    result = {"logp": logp.detach().cpu(), "grads": grads, "tokens": (a, b)}
    torch.save(result, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def run(model: str, ep: int, out: str, dtype: str = "float32", device: str = "cpu") -> list[dict]:
    """Run the check at degree ``ep`` (``ep`` processes); returns every rank's saved results."""
    from rl_engine.harness._spawn import spawn

    spawn(_worker, ep, (model, dtype, out), device)
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(ep)]


def compare(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[str]:
    """Mismatches between an EP = 1 run ``base`` and an EP = e run ``other`` (empty: bitwise)."""
    bad = []
    for r, res in enumerate(other):
        a, b = res["tokens"]
        want = base[0]["logp"][a : b - 1]
        if not torch.equal(res["logp"], want):
            d = (res["logp"].float() - want.float()).abs().max().item()
            bad.append(f"rank {r}: log-probs differ from EP = 1 (max |d| {d:.3g})")
    ref = base[0]["grads"]
    names = set(ref)
    for r, res in enumerate(other):
        if set(res["grads"]) != names:
            bad.append(f"rank {r}: expert gradients {sorted(res['grads'])} != {sorted(names)}")
    for name in sorted(names):
        parts = [res["grads"].get(name) for res in other]
        if any(p is None for p in parts):
            continue
        got = torch.cat(parts)
        if got.shape != ref[name].shape or not torch.equal(got, ref[name]):
            bad.append(f"gradient of {name} differs from EP = 1's")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = _spawn.degrees_parser(__doc__, "ep", "1,2", dtype="float32", device="cpu",
                              model="Hugging Face MoE checkpoint folder")  # fmt: skip
    args = p.parse_args(argv)
    degrees, out = _spawn.degrees_and_out(args, "ep", "ep_check_")
    runs = {e: run(args.model, e, str(out / f"ep{e}"), args.dtype, args.device) for e in degrees}
    status = 0
    for e in degrees[1:]:
        bad = compare(runs[degrees[0]], runs[e])
        print(f"EP {e} vs EP {degrees[0]}: {'bitwise equal' if not bad else 'MISMATCH'}")
        for line in bad[:10]:
            print("  " + line)
        status |= bool(bad)
    return status


if __name__ == "__main__":
    sys.exit(main())
