"""FSDP2 shards parameters, not math: the patched Hugging Face trainer wrapped in
``torch.distributed.fsdp.fully_shard`` (every decoder layer and the decoder) computes the same
log-probs as one unwrapped process, bitwise, and, when every rank scores the same batch, the
same gradients (FSDP's reduce-scatter averages ``t`` equal fp32 terms: exact for t = 2, 4).

    python -m rl_engine.harness.fsdp_check --model PATH [--ranks 2]

gloo on the CPU, NCCL on GPUs. Prints one line; exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import torch

from rl_engine.harness.tp_check import batch


def _score(model: Any) -> torch.Tensor:
    from rl_engine.adapters.hf import token_logprobs

    ids, cu = batch(model.config.vocab_size)
    device = next(model.parameters()).device
    logp = token_logprobs(model, ids.to(device), cu_seqlens=cu.to(device))
    weights = torch.linspace(-1.0, 2.0, logp.numel(), device=device).to(logp.dtype)
    (logp * weights).sum().backward()
    return logp.detach().cpu()


def _load(model: str, dtype: str, cuda: bool) -> Any:
    from transformers import AutoModelForCausalLM

    from rl_engine.adapters.hf import patch_model

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    if cuda:  # the rank's GPU (set by init) or, in one process, GPU 0
        hf = hf.cuda()
    patch_model(hf)
    return hf


def _full_grads(hf: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "full_tensor"):  # a DTensor shard (FSDP2): gather it (exact copies)
            g = g.full_tensor()
        out[name] = g.detach().cpu()
    return out


def _worker(rank: int, world: int, store: str, model: str, dtype: str, out: str) -> None:
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    from rl_engine.harness._spawn import init

    dist = init(rank, world, store)
    hf = _load(model, dtype, torch.cuda.is_available())  # hidden when the ranks run on the CPU
    if hf.config.tie_word_embeddings:
        raise ValueError("fsdp_check: an untied checkpoint (the LM head is read outside the "
                         "decoder's forward, so it stays replicated)")  # fmt: skip
    for layer in hf.model.layers:
        fully_shard(layer)
    # the decoder (embedding, layers, final norm) is what token_logprobs runs as a module; the
    # untied LM head weight is read directly by linear_logp and stays replicated
    fully_shard(hf.model)
    logp = _score(hf)
    torch.save({"logp": logp, "grads": _full_grads(hf)}, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def run(
    model: str, ranks: int, out: str, dtype: str = "float32", device: str = "cpu"
) -> list[dict[str, Any]]:
    """FSDP2 over ``ranks`` processes; every rank's log-probs and gathered gradients
    (``device``: ``cpu`` = gloo, ``cuda`` = NCCL with a GPU per rank, ``auto``)."""
    from rl_engine.harness._spawn import spawn

    spawn(_worker, ranks, (model, dtype, out), device)
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(ranks)]


def single(
    model: str, dtype: str = "float32", device: str = "cpu", ranks: int = 1
) -> dict[str, Any]:
    """The same batch in this process, no FSDP, on the device the ranks of ``run(..., ranks,
    device=device)`` use (a GPU machine runs CPU ranks when asked to: so must this)."""
    from rl_engine.harness._spawn import use_cuda

    hf = _load(model, dtype, use_cuda(ranks, device))
    logp = _score(hf)
    return {"logp": logp, "grads": _full_grads(hf)}


def compare(base: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    bad = []
    for r, res in enumerate(runs):
        if not torch.equal(res["logp"], base["logp"]):
            bad.append(f"rank {r}: log-probs differ from one process")
        for name, g in base["grads"].items():
            other = res["grads"].get(name)
            if other is None or not torch.equal(other, g):
                bad.append(f"rank {r}: gradient of {name} differs from one process")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto", help="cpu, cuda (a GPU per rank) or auto")
    args = p.parse_args(argv)
    out = tempfile.mkdtemp(prefix="fsdp_check_")
    bad = compare(
        single(args.model, args.dtype, args.device, args.ranks),
        run(args.model, args.ranks, out + "/r", args.dtype, args.device),
    )
    print(f"FSDP2 x{args.ranks} vs one process: {'bitwise equal' if not bad else 'MISMATCH'}")
    for line in bad[:10]:
        print("  " + line)
    return int(bool(bad))


if __name__ == "__main__":
    sys.exit(main())
