"""Expert-parallel (and tensor-parallel) degree invariance of the Megatron MoE trainer with real
process groups (gloo on the CPU, NCCL on GPUs).

The EP ranks are data-parallel ranks with their own tokens (megatron's layout): a fixed packed
batch of sequences is split into ``dp`` contiguous blocks of whole sequences (``dp`` = the
attention data-parallel degree, ``world / tp``), data-parallel rank ``d`` computes the token
log-probs of block ``d`` and the gradients of their weighted sum; the TP ranks of one replica
hold the same block. At TP = EP = 1 one process computes the whole batch. ``world`` =
``tp * dp``, with ``dp = etp * ep / tp`` when that is a whole number (no expert-data-parallel
replicas), else 1. :func:`compare` checks every rank's log-probs and the gradient of its
embedding output (the model's input gradient, its rows) against the base run's rows, and each
rank's expert-weight gradients (its ``E / EP`` experts, its ``I / ETP`` shard: megatron's
layout) against the same slices of the base run's. With one replica (``dp = 1``) every other
gradient is compared too (each rank's TP shard, after the finalize step's TP sum of the q / k
norms); with more, they are data-parallel partial sums that megatron's data-parallel
all-reduce adds afterwards: not compared here.

    python -m rl_engine.harness.ep_check --model PATH --ep 1,2 [--tp 2 --etp 2] [--dtype float32]

``--tp`` / ``--etp`` apply to every degree but the first (the base: TP = ETP = 1, EP = the
first ``--ep``); with ``--tp`` the workers run ``RL_ENGINE_TP_GROUPS=8`` (the base too: the
grouped reductions at TP 1). ``--control`` adds the negative control: the first TP > 1 run
again with the experts' down projection as plain per-rank partial sums added by an
all-reduce (expected to differ).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from rl_engine.harness import _spawn
from rl_engine.harness.tp_check import batch, grad_mismatches

LENGTHS = (7, 12, 4, 9, 5, 11, 3, 6)


def split(cu: torch.Tensor, ep: int, rank: int) -> tuple[int, int, torch.Tensor]:
    """Token range ``[a, b)`` and local ``cu_seqlens`` of rank ``rank``'s block of sequences."""
    n = cu.numel() - 1
    if n % ep:
        raise ValueError(f"{n} sequences do not split over {ep} ranks")
    per = n // ep
    c = cu[rank * per : (rank + 1) * per + 1]
    return int(c[0]), int(c[-1]), (c - c[0]).to(torch.int32)


def layout(tp: int, ep: int, etp: int | None) -> tuple[int, int, int]:
    """``(world, dp, etp)`` of a run at TP ``tp``, EP ``ep``, ETP ``etp`` (``None``: TP, as
    megatron-core defaults it); see the module docstring."""
    etp = tp if etp is None else etp
    dp = etp * ep // tp if (etp * ep) % tp == 0 else 1
    return tp * dp, dp, etp


def _plain_rows(x, ids, w13, w2, expert_map, groups, plan, provider):
    """The negative control's experts: each rank's plain ``moe_experts`` of its ``I / ETP``
    shard (a partial sum, rounded) added over the expert-TP group by an all-reduce."""
    from rl_engine import ops

    y = ops.moe_experts(x, ids, w13, w2, expert_map=expert_map).reshape(-1, x.shape[1])
    if plan.etp > 1:
        y = y.contiguous()
        torch.distributed.all_reduce(y, group=plan.etp_group)
    return y


def _worker(rank: int, world: int, store: str, model: str, dtype: str, out: str, tp: int,
            ep: int, etp: int, groups: str, control: bool) -> None:  # fmt: skip
    from rl_engine.config import set_env

    set_env({"RL_ENGINE_TP_GROUPS": groups})
    torch.set_num_threads(1)
    # the adapter first: importing it quiets megatron-core's import-time notices
    from rl_engine.adapters.megatron import from_pretrained, moe, token_logprobs
    from rl_engine.adapters.megatron.cpu_shim import install
    from rl_engine.harness._spawn import init
    from rl_engine.harness.tp_check import _finalize_tp_sums

    dist = init(rank, world, store)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)  # fmt: skip
    install()
    if control:
        moe._experts_rows = _plain_rows
    gpt = from_pretrained(model, dtype=getattr(torch, dtype))
    ids, cu = batch(gpt.rl_engine_vocab_size, LENGTHS)
    # packed log-probs [T - 1]: entry j is token j + 1's (0 where it starts a sequence)
    weights = torch.linspace(-1.0, 2.0, ids.numel() - 1)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    a, b, cu_r = split(cu, dp, dp_rank)
    device = next(gpt.parameters()).device
    saved = {}

    def keep(module, inputs, output):  # the embedding output's gradient: the input gradient
        output.register_hook(lambda g: saved.__setitem__("dinput", g.detach().cpu()))

    gpt.embedding.register_forward_hook(keep)
    logp = token_logprobs(gpt, ids[a:b].to(device), cu_seqlens=cu_r.to(device))
    (logp * weights[a : b - 1].to(device, logp.dtype)).sum().backward()
    if tp > 1:
        _finalize_tp_sums(gpt, False, dist)
    grads = {
        n: p.grad.detach().cpu()
        for n, p in gpt.named_parameters()
        if p.grad is not None and (dp == 1 or ".mlp.experts." in n)
    }
    result = {
        "logp": logp.detach().cpu(),
        "dinput": saved["dinput"].reshape(b - a, -1),
        "grads": grads,
        "tokens": (a, b),
        "tp": (tp, ps.get_tensor_model_parallel_rank()),
        "ep": (ep, ps.get_expert_model_parallel_rank()),
        "etp": (etp, ps.get_expert_tensor_parallel_rank()),
        "dp": dp,
    }
    torch.save(result, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def run(model: str, ep: int, out: str, dtype: str = "float32", device: str = "cpu", *,
        tp: int = 1, etp: int | None = None, groups: str = "",
        control: bool = False) -> list[dict]:  # fmt: skip
    """Run the check at EP ``ep``, TP ``tp``, ETP ``etp`` (``None``: TP) in ``world`` processes
    (:func:`layout`); returns every rank's saved results. ``groups``: the workers'
    ``RL_ENGINE_TP_GROUPS`` (``""``: unset: the plain reductions at TP 1). ``control``: the
    experts' plain per-rank partial sums (:func:`_plain_rows`), expected to differ."""
    from rl_engine.harness._spawn import spawn

    world, _, etp = layout(tp, ep, etp)
    spawn(_worker, world, (model, dtype, out, tp, ep, etp, groups, control), device)
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(world)]


def _expected_experts(grads: dict, res: dict) -> dict:
    from rl_engine.adapters.megatron.loader import ep_shard_state, etp_shard_state

    (ep, ep_rank), (etp, etp_rank) = res.get("ep", (1, 0)), res.get("etp", (1, 0))
    experts = {n: g for n, g in grads.items() if ".mlp.experts." in n}
    return ep_shard_state(etp_shard_state(experts, etp, etp_rank), ep, ep_rank)


def compare(base: list[dict[str, Any]], other: list[dict[str, Any]],
            model: str | None = None) -> list[str]:  # fmt: skip
    """Mismatches between a TP = EP = 1 run ``base`` and another run ``other`` (empty:
    bitwise). ``model`` (the checkpoint): also every non-expert gradient where ``other`` has
    one replica (each rank's TP shard of the base's, ``shard_state``)."""
    from rl_engine.adapters.megatron.loader import _read_config, shard_state

    bad = []
    ref = base[0]["grads"]
    experts = {n for n in ref if ".mlp.experts." in n}
    for r, res in enumerate(other):
        a, b = res["tokens"]
        want = base[0]["logp"][a : b - 1]
        if not torch.equal(res["logp"], want):
            d = (res["logp"].float() - want.float()).abs().max().item()
            bad.append(f"rank {r}: log-probs differ from the base run's (max |d| {d:.3g})")
        if "dinput" in res and "dinput" in base[0]:
            if not torch.equal(res["dinput"], base[0]["dinput"][a:b]):
                bad.append(f"rank {r}: the input gradient differs from the base run's")
        got = {n for n in res["grads"] if ".mlp.experts." in n}
        if got != experts:
            bad.append(f"rank {r}: expert gradients {sorted(got)} != {sorted(experts)}")
        for name, g in _expected_experts(ref, res).items():
            mine = res["grads"].get(name)
            if mine is not None and (mine.shape != g.shape or not torch.equal(mine, g)):
                bad.append(f"rank {r}: gradient of {name} differs from the base run's slice")
        if model is None or res.get("dp", 1) != 1:
            continue
        tp, tp_rank = res.get("tp", (1, 0))
        cfg = _read_config(model)
        dense = {n: g for n, g in ref.items() if n not in experts}
        want_dense = shard_state(dense, cfg, tp, tp_rank) if tp > 1 else dense
        bad += grad_mismatches(r, res["grads"], want_dense, want_dense, "the base run's shard")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = _spawn.degrees_parser(__doc__, "ep", "1,2", dtype="float32", device="cpu",
                              model="Hugging Face MoE checkpoint folder")  # fmt: skip
    p.add_argument("--tp", type=int, default=1, help="TP degree of the runs after the base")
    p.add_argument("--etp", type=int, default=None, help="expert-TP degree (default: --tp)")
    p.add_argument("--control", action="store_true",
                   help="also the plain per-rank partial sums at TP > 1 (expected to differ)")  # fmt: skip
    args = p.parse_args(argv)
    degrees, out = _spawn.degrees_and_out(args, "ep", "ep_check_")
    groups = "8" if args.tp > 1 else ""
    base = run(args.model, degrees[0], str(out / "base"), args.dtype, args.device, groups=groups)
    todo = [e for e in degrees if args.tp > 1 or e != degrees[0]]
    status = 0
    for e in todo:
        name = f"TP {args.tp} (ETP {args.etp or args.tp}) EP {e}" if args.tp > 1 else f"EP {e}"
        res = run(args.model, e, str(out / f"ep{e}"), args.dtype, args.device, tp=args.tp,
                  etp=args.etp, groups=groups)  # fmt: skip
        bad = compare(base, res, args.model)
        print(f"{name} vs TP 1 EP {degrees[0]}: {'bitwise equal' if not bad else 'MISMATCH'}")
        for line in bad[:10]:
            print("  " + line)
        status |= bool(bad)
    if args.control and args.tp > 1:
        res = run(args.model, todo[0], str(out / "control"), args.dtype, args.device,
                  tp=args.tp, etp=args.etp, groups=groups, control=True)  # fmt: skip
        bad = compare(base, res, args.model)
        print(f"control (plain partial sums, TP {args.tp}): "
              f"{'differs, as expected' if bad else 'EQUAL: the control failed'}")  # fmt: skip
        status |= not bad
    return status


if __name__ == "__main__":
    sys.exit(main())
