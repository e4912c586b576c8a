"""The norms on DTensors, checked with real process groups: every rank builds the same full
inputs, shards them over a 1-D mesh (rows or, for [B, T, H] inputs, the sequence dim; the
parameters replicated), runs ``rms_norm`` (plain and with the residual), ``poly_norm`` and
``fused_mul_poly_norm`` forward and backward, and compares the gathered outputs and every
gradient with the unsharded op on the full tensors (``torch.equal``). The negative control: the
weight gradient as a per-rank sum all-reduced by the collective (what a ``Partial`` placement
would do) is not the unsharded op's bits.

    python -m rl_engine.harness.dtensor_check [--ranks 2] [--backend native]

Prints one line per check and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype)

    return {
        "x": rnd(*shape, scale=2.0),
        "res": rnd(*shape),
        "mul": rnd(*shape),
        "gy": rnd(*shape),
        "gs": rnd(*shape),
        "w": (1 + rnd(h, scale=0.1).float()).to(dtype),
        "pw": torch.tensor([0.3, -0.7, 1.1], dtype=dtype),
        "pb": torch.tensor([0.05], dtype=dtype),
    }


def _run(t: dict[str, torch.Tensor], kind: str, backend: str) -> list[torch.Tensor]:
    """Forward + backward of one op; returns [outputs..., input grads..., param grads...]."""
    from rl_engine.ops import fused_mul_poly_norm, poly_norm, rms_norm

    leaves = {k: v.detach().clone().requires_grad_(k not in ("gy", "gs")) for k, v in t.items()}
    if kind == "rms_norm":
        y = rms_norm(leaves["x"], leaves["w"], 1e-6, backend=backend)
        y.backward(leaves["gy"])
        return [y, leaves["x"].grad, leaves["w"].grad]
    if kind == "rms_norm+residual":
        y, s = rms_norm(leaves["x"], leaves["w"], 1e-6, leaves["res"], backend=backend)
        torch.autograd.backward([y, s], [leaves["gy"], leaves["gs"]])
        return [y, s, leaves["x"].grad, leaves["res"].grad, leaves["w"].grad]
    if kind == "poly_norm":
        y = poly_norm(leaves["x"], leaves["pw"], leaves["pb"], 1e-6, backend=backend)
        y.backward(leaves["gy"])
        return [y, leaves["x"].grad, leaves["pw"].grad, leaves["pb"].grad]
    if kind == "fused_mul_poly_norm":
        y = fused_mul_poly_norm(
            leaves["x"], leaves["mul"], leaves["pw"], leaves["pb"], 1e-6, backend=backend
        )
        y.backward(leaves["gy"])
        return [y, leaves["x"].grad, leaves["mul"].grad, leaves["pw"].grad, leaves["pb"].grad]
    raise ValueError(kind)


KINDS = ("rms_norm", "rms_norm+residual", "poly_norm", "fused_mul_poly_norm")
CASES = (  # (shape, shard dim, dtype)
    ((70, 64), 0, torch.float32),
    ((3, 37, 64), 1, torch.float32),
    ((3, 37, 64), 0, torch.bfloat16),
)


def _worker(rank: int, world: int, store: str, backend: str, n_cases: int) -> None:
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from rl_engine.harness._spawn import init
    from rl_engine.ops.rms_norm import reference as rms_ref

    dist = init(rank, world, store)
    mesh = init_device_mesh("cpu", (world,))
    bad = []
    for shape, dim, dtype in CASES[:n_cases]:
        if backend == "triton" and dtype == torch.bfloat16:
            continue  # the Triton interpreter (the CPU) computes bf16 dots wrongly
        full = _inputs(shape, dtype, seed=7)
        sharded = {
            k: distribute_tensor(v, mesh, [Replicate() if k in ("w", "pw", "pb") else Shard(dim)])
            for k, v in full.items()
        }
        for kind in KINDS:
            want = _run(full, kind, backend)
            got = _run(sharded, kind, backend)
            # row-wise ops keep the rows sharded: the outputs and the input gradients
            n_rows = {"rms_norm": 2, "rms_norm+residual": 4, "poly_norm": 2}.get(kind, 3)
            for i in range(n_rows):
                if isinstance(got[i], DTensor) and tuple(got[i].placements) != (Shard(dim),):
                    bad.append(f"{kind}: result {i} placed {got[i].placements}, not Shard({dim})")
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                if not isinstance(g, DTensor):
                    bad.append(f"{kind} {shape} shard {dim}: result {i} is not a DTensor")
                elif not torch.equal(g.full_tensor(), w):
                    bad.append(f"{kind} {shape} {dtype} shard {dim}: result {i} differs")
            if rank == 0:
                print(f"{kind:22s} {str(tuple(shape)):13s} {str(dtype):15s} Shard({dim}): "
                      f"{len(want)} tensors compared", flush=True)  # fmt: skip
    # the sequence-parallel style of the residual norm: local shards in, local shards out
    from torch.distributed.tensor.parallel import parallelize_module

    from rl_engine.nn import RMSNorm
    from rl_engine.parallel import ResidualSequenceParallel

    full = _inputs((3, 38, 64), torch.float32, seed=9)  # local shards in: an even split
    ref_norm = RMSNorm(64, backend=backend)
    with torch.no_grad():
        ref_norm.weight.copy_(full["w"])
    sp_norm = parallelize_module(
        RMSNorm(64, backend=backend), mesh, ResidualSequenceParallel(sequence_dim=1)
    )
    with torch.no_grad():
        sp_norm.weight.copy_(distribute_tensor(full["w"], mesh, [Replicate()]))
    step = 38 // world
    mine = slice(rank * step, (rank + 1) * step)
    x, res = (full[k][:, mine].clone().requires_grad_(True) for k in ("x", "res"))
    y, s = sp_norm(x, res)
    torch.autograd.backward([y, s], [DTensor.from_local(full[k][:, mine], mesh, [Shard(1)])
                                     for k in ("gy", "gs")])  # fmt: skip
    want = _run(full, "rms_norm+residual", backend)  # the unsharded functional op
    checks = {
        "y": torch.equal(y.full_tensor(), want[0]),
        "x + residual": torch.equal(s.full_tensor(), want[1]),
        "dx": torch.equal(x.grad, want[2][:, mine]),
        "dresidual": torch.equal(res.grad, want[3][:, mine]),
        "dweight": torch.equal(sp_norm.weight.grad.full_tensor(), want[4]),
    }
    if rank == 0:
        print(f"ResidualSequenceParallel (3, 38, 64) Shard(1): {checks}", flush=True)
    bad += [f"ResidualSequenceParallel: {k} differs" for k, ok in checks.items() if not ok]
    # negative control: the weight gradient as per-rank sums all-reduced (a Partial placement)
    full = _inputs((70, 64), torch.float32, seed=7)
    rows = full["x"].shape[0]
    step = -(-rows // world)
    lo, hi = rank * step, min(rows, (rank + 1) * step)
    part = rms_ref.rms_norm_wgrad(full["gy"][lo:hi], full["x"][lo:hi], 1e-6)
    dist.all_reduce(part)
    control_equal = torch.equal(part, rms_ref.rms_norm_wgrad(full["gy"], full["x"], 1e-6))
    if rank == 0:
        print(f"control: all-reduced per-rank weight gradients bitwise equal: {control_equal}")
    if control_equal:
        bad.append("control: the all-reduced weight gradient equals the fixed-order one")
    # every rank done with its collectives before any tears the group down: gloo's teardown
    # racing a peer still in a collective aborted rank 0 once in CI (SIGABRT after all checks)
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        raise AssertionError(f"rank {rank}: " + "; ".join(bad))


def run(ranks: int = 2, backend: str = "native", cases: int = len(CASES)) -> None:
    """Spawn ``ranks`` gloo processes on the CPU; raises on any mismatch. ``cases``: the first
    that many of :data:`CASES` (the style check and the control always run)."""
    from rl_engine.harness._spawn import spawn

    spawn(_worker, ranks, (backend, cases), "cpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rl_engine.harness.dtensor_check")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", default="native", help="provider of the norms (native, triton)")
    args = ap.parse_args(argv)
    try:
        run(args.ranks, args.backend)
    except Exception as exc:  # a rank's AssertionError arrives wrapped
        print(f"FAIL: {exc}", file=sys.stderr)
        return 1
    print("ok: sharded == unsharded, bitwise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
