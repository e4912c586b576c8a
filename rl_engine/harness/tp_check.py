"""Tensor-parallel degree invariance, checked with real process groups (gloo on the CPU, NCCL on
GPUs): the Megatron trainer at TP = t loads a Hugging Face checkpoint, computes the packed
token log-probs of a fixed batch and the gradients of their weighted sum; every rank saves what
it holds. :func:`compare` then checks the log-probs against another degree's and each rank's
gradient shard against the same rows / columns of the other run's (``shard_state`` of TP = 1).

    python -m rl_engine.harness.tp_check --model PATH --tp 1,2,4 [--dtype bfloat16] [--out DIR]

``RL_ENGINE_TP_GROUPS`` is set to 8 in every worker (TP = 1 then runs the TP-invariant
reduction too). Prints one line per degree and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

from rl_engine.harness import _spawn

BATCH_SEED = 1234


def batch(vocab: int, lengths=(7, 12, 4, 9)) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed token ids [T] and cu_seqlens [B + 1] (a fixed function of ``vocab``)."""
    g = torch.Generator().manual_seed(BATCH_SEED)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, cu


def _worker(
    rank: int, world: int, store: str, model: str, dtype: str, out: str, groups: str, sp: bool
) -> None:
    from rl_engine.config import set_env

    set_env({"RL_ENGINE_TP_GROUPS": groups})
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from rl_engine.adapters.megatron import from_pretrained, token_logprobs
    from rl_engine.adapters.megatron.cpu_shim import install
    from rl_engine.harness._spawn import init

    dist = init(rank, world, store)
    parallel_state.initialize_model_parallel(world, 1)
    install()
    gpt = from_pretrained(model, dtype=getattr(torch, dtype), sequence_parallel=sp and world > 1)
    ids, cu = batch(gpt.rl_engine_vocab_size)
    device = next(gpt.parameters()).device
    ids, cu = ids.to(device), cu.to(device)
    logp = token_logprobs(gpt, ids, cu_seqlens=cu)
    weights = torch.linspace(-1.0, 2.0, logp.numel(), device=device).to(logp.dtype)
    (logp * weights).sum().backward()
    # Megatron's finalize step then adds the TP ranks' gradients of the weights marked
    # sequence_parallel (with sequence parallelism) and of q/k_layernorm (by name): done here
    # the same way, so what is compared is what the optimizer would see
    summed = _finalize_tp_sums(gpt, sp and world > 1, dist)
    grads = {n: p.grad.detach().cpu() for n, p in gpt.named_parameters() if p.grad is not None}
    # a weight still marked sequence_parallel holds a partial gradient before that step (listed;
    # the rl_engine norms leave none)
    partial = [n for n, p in gpt.named_parameters() if getattr(p, "sequence_parallel", False)]
    from rl_engine import KernelRegistry

    result = {
        "logp": logp.detach().cpu(),
        "provenance": KernelRegistry.report(),
        "grads": grads,
        "partial": partial if sp else [],
        "finalize_summed": summed,
    }
    torch.save(result, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _finalize_tp_sums(gpt: Any, sp: bool, dist: Any) -> list[str]:
    """The tensor-parallel all-reduce (sum) of Megatron's ``finalize_model_grads``, on
    ``param.grad``; returns the names it summed."""
    qk = bool(getattr(gpt.config, "qk_layernorm", False))
    names = []
    for name, p in gpt.named_parameters():
        marked = sp and getattr(p, "sequence_parallel", False)
        if p.grad is not None and (
            marked or (qk and ("q_layernorm" in name or "k_layernorm" in name))
        ):
            dist.all_reduce(p.grad)
            names.append(name)
    return names


def run(
    model: str,
    tp: int,
    out: str,
    dtype: str = "bfloat16",
    groups: str = "8",
    device: str = "cpu",
    sequence_parallel: bool = False,
) -> list[dict[str, Any]]:
    """Run the check at degree ``tp`` (``tp`` processes); returns every rank's saved results.

    ``groups``: the workers' ``RL_ENGINE_TP_GROUPS`` (``""``: unset, so TP = 1 runs the plain
    det_gemm reduction: the negative control). ``device``: ``cpu`` (gloo), ``cuda`` (NCCL, one
    GPU per rank) or ``auto``. ``sequence_parallel``: Megatron's sequence parallelism (TP > 1;
    the token count must divide by ``tp``)."""
    from rl_engine.harness._spawn import spawn

    spawn(_worker, tp, (model, dtype, out, groups, sequence_parallel), device)
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(tp)]


def hf_logprobs(
    model: str, dtype: str = "bfloat16", groups: str = "8", device: str = "cpu", tp: int = 1
) -> torch.Tensor:
    """The patched Hugging Face trainer's packed log-probs of the same batch (this process), on
    the device the ranks of ``run(model, tp, ..., device=device)`` use."""
    from transformers import AutoModelForCausalLM

    from rl_engine.adapters.hf import patch_model, token_logprobs
    from rl_engine.harness._spawn import tp_groups_env, use_cuda

    with tp_groups_env(groups):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        device = "cuda" if use_cuda(tp, device) else "cpu"  # where the ranks ran
        hf = hf.to(device)
        patch_model(hf)
        ids, cu = batch(hf.config.vocab_size)
        with torch.no_grad():
            return token_logprobs(hf, ids.to(device), cu_seqlens=cu.to(device)).cpu()


def compare(model: str, base: list[dict], other: list[dict]) -> list[str]:
    """Mismatches between a TP = 1 run ``base`` and a TP = t run ``other`` (empty: bitwise)."""
    from rl_engine.adapters.megatron.loader import _read_config, shard_state

    cfg = _read_config(model)
    t = len(other)
    bad = []
    for r, res in enumerate(other):
        if not torch.equal(res["logp"], base[0]["logp"]):
            d = (res["logp"].float() - base[0]["logp"].float()).abs().max().item()
            bad.append(f"rank {r}: log-probs differ from TP = 1 (max |d| {d:.3g})")
        want = shard_state(base[0]["grads"], cfg, t, r)
        bad += grad_mismatches(r, res["grads"], want, res["grads"], "TP = 1's shard")
    return bad


def grad_mismatches(rank: int, got: dict, want: dict, names: Iterable[str], what: str) -> list[str]:
    """A line for each of ``names`` whose gradient in ``got`` (rank ``rank``'s) is missing or
    is not bitwise ``want``'s (``what`` names ``want``)."""
    bad = []
    for name in names:
        mine, ref = got.get(name), want.get(name)
        if mine is None or ref is None or mine.shape != ref.shape or not torch.equal(mine, ref):
            bad.append(f"rank {rank}: gradient of {name} differs from {what}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = _spawn.degrees_parser(__doc__, "tp", "1,2,4", dtype="bfloat16", device="auto",
                              model="Hugging Face checkpoint folder")  # fmt: skip
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron's SP at TP > 1")
    p.add_argument("--control", action="store_true",
                   help="also TP 1 with the plain det_gemm reduction (expected to differ)")  # fmt: skip
    args = p.parse_args(argv)
    degrees, out = _spawn.degrees_and_out(args, "tp", "tp_check_")
    runs = {
        t: run(
            args.model,
            t,
            str(out / f"tp{t}"),
            args.dtype,
            device=args.device,
            sequence_parallel=args.sequence_parallel,
        )
        for t in degrees
    }
    base = runs[degrees[0]]
    hf = hf_logprobs(args.model, args.dtype, device=args.device, tp=degrees[0])
    same = torch.equal(hf, base[0]["logp"])
    print(f"HF trainer vs Megatron TP {degrees[0]}: {'bitwise equal' if same else 'MISMATCH'}")
    status = int(not same)
    for t in degrees[1:]:
        bad = compare(args.model, base, runs[t])
        n = base[0]["logp"].numel()
        summed = len(runs[t][0].get("finalize_summed", ()))
        note = f" ({summed} of them after the finalize step's TP sum)"
        print(f"TP {t} vs TP {degrees[0]}: {n} log-probs, {len(runs[t][0]['grads'])} gradient "
              f"shards per rank: {'bitwise equal' if not bad else 'MISMATCH'}"
              f"{note if summed else ''}")  # fmt: skip
        for line in bad[:10]:
            print("  " + line)
        status |= bool(bad)
    if args.control:  # the negative control: the plain reduction's TP = 1 bits are not these
        plain = run(args.model, 1, str(out / "plain1"), args.dtype, groups="", device=args.device)
        a, b = plain[0]["logp"], base[0]["logp"]
        same = int((a == b).sum())
        print(f"control: plain det_gemm TP 1 vs grouped TP {degrees[0]}: {same}/{a.numel()} "
              f"log-probs bitwise equal (expected below all)")  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
