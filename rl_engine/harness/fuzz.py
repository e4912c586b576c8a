"""Invariance fuzzing: seeded random cases per op, checked against the invariance contracts.

A user's batch is never the shape of a test. This draws cases the hand-written tests do not
pick (row counts that are primes, powers of two +- 1; sizes that are not multiples of any
block; transposed and strided inputs; -inf vocabulary padding; temperatures 1e-3 .. 100;
chunked-prefill split points; fp32 / bf16 / fp16) and checks, per case:

* **row invariance**: a slice of the rows, and a single row, alone == the same rows of the whole
  batch (bitwise); run to run (bitwise);
* **prefill == chunked == decode** (attention): random split points through a paged cache;
* **fused == unfused**: ``linear_logp == logp(det_gemm(h, W^T))``; ``sampled_logp`` at per-row
  temperatures == ``logp`` at each row's temperature;
* **gradients**: the input gradient row invariant (bitwise), weight gradients run to run;
* **accuracy**: the provider vs the float64 math within the tolerance table.

Every case is a pure function of ``(op, provider, device, case_seed)``; a failure prints a
one-line reproducer::

    python -m rl_engine.harness.fuzz --op det_gemm --provider native --device cpu --case-seed 7

``python -m rl_engine.harness.fuzz --cases 10000 --device cuda`` is the GPU run;
``--budget SECONDS`` bounds a run (the CPU CI runs ~2 minutes); ``--workers N`` runs N shards
of the case list in parallel processes (dealt over the visible GPUs); a report records its
seed and a hash of the package's sources, and ``--merge A.json B.json --json ALL.json`` adds
the reports of runs of the same code with distinct seeds into one (a run is bounded by a
device call's time; the count is over all of them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_engine.testing.invariance import assert_bitwise
from rl_engine.testing.tolerances import FP32_OUT, assert_close, tolerance

__all__ = ["OPS", "Case", "FuzzReport", "check_case", "run"]


@dataclass(frozen=True)
class Case:
    """One fuzz case: everything it draws follows from these four fields."""

    op: str
    provider: str
    device: str
    seed: int

    def reproducer(self) -> str:
        return (
            f"python -m rl_engine.harness.fuzz --op {self.op} --provider {self.provider} "
            f"--device {self.device} --case-seed {self.seed}"
        )


@dataclass
class FuzzReport:
    cases: int = 0
    passed: int = 0
    skipped: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    per_op: dict[str, int] = field(default_factory=dict)
    seconds_per_op: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def merge(self, other: dict[str, Any]) -> None:
        """Add another run's :meth:`as_dict` (a shard's) into this report; ``seconds`` is left
        to the caller (shards run at the same time)."""
        self.cases += other["cases"]
        self.passed += other["passed"]
        self.skipped += other["skipped"]
        self.failures += other["failures"]
        for k, v in other["per_op"].items():
            self.per_op[k] = self.per_op.get(k, 0) + v
        for k, v in other["seconds_per_op"].items():
            self.seconds_per_op[k] = self.seconds_per_op.get(k, 0.0) + v

    def as_dict(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "passed": self.passed,
            "skipped": self.skipped,
            "failed": len(self.failures),
            "failures": self.failures,
            "per_op": self.per_op,
            "seconds_per_op": {k: round(v, 2) for k, v in self.seconds_per_op.items()},
            "seconds": round(self.seconds, 1),
        }


class Skip(Exception):
    """The drawn case is outside what the provider takes (e.g. an interpreter-only limit)."""


# ------------------------------------------------------------------------------ drawing
class Draw:
    """Shapes and data of one case (``random.Random`` for shapes, a torch generator for data)."""

    def __init__(self, case: Case, big: bool) -> None:
        self.r = random.Random(case.seed)
        self.g = torch.Generator().manual_seed(case.seed)
        # the large tensors are drawn on the case's device (CPU draws of 10^8 normals took most
        # of a GPU case's time); on the CPU it is the same generator, so CPU cases are unchanged
        dev = torch.device(case.device)
        self.g_data = self.g if dev.type == "cpu" else torch.Generator(dev).manual_seed(case.seed)
        self.case = case
        self.big = big  # GPU sizes (else small: the CPU reference and the interpreter)
        self.interp = case.device == "cpu" and case.provider.startswith("triton")

    def count(self, small: int, large: int) -> int:
        """A row / size count: primes, powers of two +- 1 and plain random values up to the
        limit of the mode."""
        hi = large if self.big else small
        pool = [1, 2, 3, 5, 7, 13, 31, 61, 127, 251, 509, 1021, 4093, 65521, 69997]
        pool += [(1 << e) + d for e in range(1, 17) for d in (-1, 0, 1)]
        pool = [p for p in pool if 1 <= p <= hi]
        return self.r.choice(pool) if self.r.random() < 0.6 else self.r.randint(1, hi)

    def dtype(self) -> torch.dtype:
        # the interpreter's bf16 tl.dot is wrong (PLATFORMS.md): fp32 / fp16 there
        opts = (
            [torch.float32, torch.float16]
            if self.interp
            else [
                torch.float32,
                torch.bfloat16,
                torch.float16,
            ]
        )
        return self.r.choice(opts)

    def randn(self, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.g_data, device=self.g_data.device) * scale
        return x.to(device=self.case.device, dtype=dtype)

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        """The same values as a contiguous, transposed-storage or column-strided tensor."""
        k = self.r.randrange(3)
        if k == 1 and x.dim() == 2:
            return x.t().contiguous().t()
        if k == 2:
            wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
            wide[..., ::2] = x
            return wide[..., ::2]
        return x

    def batch(self, width_small: int, width_large: int, elems: int = 2**26) -> tuple[int, int]:
        """``(rows, width)`` of a [rows, width] input (at most ``elems`` elements on a GPU)."""
        t, w = self.count(300, 70000), self.count(width_small, width_large)
        if self.big:
            t = min(t, max(1, elems // w))
        return t, w

    def rows(self, n: int) -> tuple[int, int, int]:
        """A slice [i, j) and a single row r of ``n`` rows."""
        i = self.r.randrange(n)
        j = self.r.randint(i + 1, n)
        return i, j, self.r.randrange(n)


def _rows(f: Callable[[int, int], torch.Tensor], n: int, d: Draw, what: str) -> torch.Tensor:
    """``f(i, j)`` computes rows ``i:j`` of a batch of ``n``: the whole batch twice (run to
    run), a random slice and a random single row alone must give the batch's bits."""
    full = f(0, n)
    assert_bitwise(f(0, n), full, f"{what}: run to run")
    i, j, r = d.rows(n)
    assert_bitwise(f(i, j), full[i:j], f"{what}: rows {i}:{j} of {n} alone")
    assert_bitwise(f(r, r + 1), full[r : r + 1], f"{what}: row {r} of {n} alone")
    return full


def _rows_check(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, d: Draw, what: str):
    return _rows(lambda i, j: f(x[i:j]), x.shape[0], d, what)


# ------------------------------------------------------------------------------ the ops
def _det_gemm(d: Draw) -> None:
    from rl_engine.ops import det_gemm

    p = d.case.provider
    m, k, n = d.count(300, 70000), d.count(200, 5000), d.count(200, 5000)
    if d.big:
        while m * k + k * n + m * n > 2**28:  # keep one case within a few GiB
            m = max(1, m // 2)
    dt = d.dtype()
    a = d.layout(d.randn(m, k, dtype=dt))
    b = d.layout(d.randn(k, n, dtype=dt))
    bias = d.randn(n, dtype=dt) if d.r.random() < 0.3 else None
    full = _rows_check(lambda x: det_gemm(x, b, bias, backend=p), a, d, f"det_gemm {m}x{k}x{n}")
    want = a.double() @ b.double() + (bias.double() if bias is not None else 0.0)
    if dt == torch.float32:
        _check_fp32_dot_bound(full, a, b, bias, want, f"det_gemm {m}x{k}x{n} vs float64")
    else:
        assert_close(full, want.to(dt), **_tol(dt, k), what="det_gemm vs float64")


def _check_fp32_dot_bound(out, a, b, bias, want, what: str) -> None:
    """fp32 accuracy against the classical error bound of a dot product in any summation order,
    element by element: ``|out - exact| <= (K + 2) * 2^-24 * (|a| @ |b| + |bias|)`` (K
    multiply-adds, the bias add and the output rounding, each at most one unit roundoff of a
    partial bounded by that sum). The tolerance table's fixed atol / rtol cannot hold for
    outputs whose products cancel: case det_gemm / triton / cuda seed 1439165853 (32769 x 513 x
    4097, fp32) had 1.5e-4 at a near-zero output, 2.5x that atol and far inside this bound. An
    fp32 GEMM that rounds its inputs (TF32: 2^-11) or drops a product still fails it."""
    k = a.shape[1]
    mag = a.double().abs() @ b.double().abs()
    if bias is not None:
        mag = mag + bias.double().abs()
    bound = (k + 2) * 2.0**-24 * mag
    err = (out.double() - want).abs()
    bad = err > bound
    if bool(bad.any()):
        i = int(torch.argmax((err - bound).flatten()))
        r, c = divmod(i, err.shape[1])
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements outside the fp32 dot-product bound; worst at "
            f"({r}, {c}): |err| {float(err[r, c]):.3e} > {float(bound[r, c]):.3e}"
        )


def _tol(dt: torch.dtype, k: int | None = None) -> dict[str, float]:
    rtol, atol = tolerance(dt, k=k)
    return {"rtol": rtol, "atol": atol}


def _rms_norm(d: Draw) -> None:
    from rl_engine.ops import rms_norm

    p = d.case.provider
    t, h = d.batch(300, 8192)
    dt = d.dtype()
    x = d.layout(d.randn(t, h, dtype=dt, scale=3.0))
    w = d.randn(h, dtype=dt)
    eps = d.r.choice([1e-6, 1e-5])
    res = d.randn(t, h, dtype=dt) if d.r.random() < 0.5 else None
    if res is None:
        y = _rows_check(lambda z: rms_norm(z, w, eps, backend=p), x, d, "rms_norm")
        s = x.double()
    else:
        xr = torch.stack([x, res], 1)
        y = _rows_check(
            lambda z: torch.stack(rms_norm(z[:, 0], w, eps, z[:, 1], backend=p), 1),
            xr,
            d,
            "fused_add_rms_norm",
        )[:, 0]
        s = (x + res).double()  # the residual add rounds to the input dtype first
        s = s.to(dt).double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    assert_close(y, want.to(dt), **_tol(dt), what="rms_norm vs float64")
    # gradients: dx row invariant, dweight run to run
    g = d.randn(t, h, dtype=dt)

    def dx(z: torch.Tensor) -> torch.Tensor:
        z = z.detach().clone().requires_grad_(True)
        (rms_norm(z, w, eps, backend=p) * g[: z.shape[0]].float()).sum().backward()
        return z.grad

    i, j, _ = d.rows(t)
    assert_bitwise(dx(x[:j])[i:j], dx(x)[i:j], "rms_norm dx: prefix rows vs all rows")

    def dw() -> torch.Tensor:
        ww = w.detach().clone().requires_grad_(True)
        (rms_norm(x, ww, eps, backend=p).float() * g.float()).sum().backward()
        return ww.grad

    assert_bitwise(dw(), dw(), "rms_norm dweight run to run")


def _poly_norm(d: Draw) -> None:
    from rl_engine.ops import fused_mul_poly_norm, poly_norm

    p = d.case.provider
    t, h = d.batch(120, 8192)
    if d.interp:  # one program per row: the interpreter pays per row
        t, h = min(t, 16), min(h, 64)
    dt = d.dtype()
    x = d.layout(d.randn(t, h, dtype=dt, scale=1.5))
    mul = d.randn(t, h, dtype=dt)
    w = d.randn(3, dtype=torch.float32)
    b = d.randn(1, dtype=torch.float32)
    y = _rows(lambda i, j: poly_norm(x[i:j], w, b, backend=p), t, d, "poly_norm")
    fused = _rows(
        lambda i, j: fused_mul_poly_norm(x[i:j], mul[i:j], w, b, backend=p), t, d, "fused_mul"
    )
    assert_bitwise(fused, y * mul, "fused_mul_poly_norm vs poly_norm(x) * mul")
    x64 = x.double()

    def n(z: torch.Tensor) -> torch.Tensor:
        return z / torch.sqrt((z * z).mean(-1, keepdim=True) + 1e-6)

    want = w[0].double() * n(x64**3) + w[1].double() * n(x64**2) + w[2].double() * n(x64)
    rtol, atol = tolerance(dt)
    scale = 1.0 + float(w.abs().sum())
    assert_close(y, (want + b.double()).to(dt), rtol=rtol, atol=atol * scale, what="poly_norm")
    g = d.randn(t, h, dtype=dt)

    def dx(n_rows: int) -> torch.Tensor:
        z = x[:n_rows].detach().clone().requires_grad_(True)
        poly_norm(z, w, b, backend=p).backward(g[:n_rows])
        return z.grad

    i, j, _ = d.rows(t)
    assert_bitwise(dx(j)[i:j], dx(t)[i:j], "poly_norm dx: prefix rows vs all rows")


def _silu_and_mul(d: Draw) -> None:
    from rl_engine.ops import silu_and_mul

    p = d.case.provider
    t, f = d.batch(300, 14336)
    dt = d.dtype()
    x = d.layout(d.randn(t, 2 * f, dtype=dt, scale=2.0))
    y = _rows_check(lambda z: silu_and_mul(z, backend=p), x, d, "silu_and_mul")
    a, b = x[:, :f].double(), x[:, f:].double()
    assert_close(y, (a * torch.sigmoid(a) * b).to(dt), **_tol(dt), what="silu_and_mul vs f64")


def _rope(d: Draw) -> None:
    from rl_engine.ops import rope

    p = d.case.provider
    t, heads = d.count(300, 70000), d.r.choice([1, 2, 3, 8, 32])
    hd = d.r.choice([16, 64, 80, 128])
    rot = d.r.choice([hd, hd // 2]) if hd % 4 == 0 else hd
    neox = d.r.random() < 0.7
    theta = d.r.choice([10000.0, 1e6])
    if d.big:
        t = min(t, max(1, 2**25 // (heads * hd)))
    dt = d.dtype()
    x = d.randn(t, heads, hd, dtype=dt)
    pos = torch.randint(0, 1 << 17, (t,), generator=d.g).to(d.case.device)
    what = f"rope {heads}x{hd} rot {rot} neox {neox}"
    y = _rows(lambda i, j: rope(x[i:j], pos[i:j], theta, rot, neox, backend=p), t, d, what)
    assert y.shape == x.shape and y.dtype == x.dtype


def _vocab_logits(d: Draw, dt: torch.dtype) -> tuple[torch.Tensor, int]:
    t, v = d.count(200, 70000), d.count(3000, 151936 + 7)
    if d.big:
        t = min(t, max(1, 2**27 // v))
    x = d.randn(t, v, dtype=dt, scale=d.r.choice([1.0, 4.0, 20.0]))
    if d.r.random() < 0.3 and v > 2:  # -inf vocabulary padding at the end
        x[:, v - max(1, v // 9) :] = float("-inf")
    return d.layout(x), v


def _logp(d: Draw) -> None:
    from rl_engine.ops import logp

    p = d.case.provider
    dt = d.dtype()
    x, v = _vocab_logits(d, dt)
    temp = d.r.choice([1e-3, 0.7, 1.0, 1.3, 100.0])
    finite = int(torch.isfinite(x[0]).sum())
    tok = torch.randint(0, finite, (x.shape[0],), generator=d.g).to(x.device)
    lp = _rows(lambda a, b: logp(x[a:b], tok[a:b], temp, backend=p), x.shape[0], d, "logp")
    i, j, r = d.rows(x.shape[0])
    want = torch.log_softmax(x.double() / temp, -1).gather(1, tok[:, None])[:, 0]
    assert_close(lp, want, rtol=FP32_OUT[0], atol=FP32_OUT[1] * max(1.0, 1.0 / temp) * 4,
                 what=f"logp vs float64 (T={temp})")  # fmt: skip
    # dlogits of a prefix of the rows == those rows of the whole batch
    g = torch.rand(x.shape[0], generator=d.g).to(x.device)

    def dx(n: int) -> torch.Tensor:
        z = x[:n].detach().clone().requires_grad_(True)
        (logp(z, tok[:n], temp, backend=p) * g[:n]).sum().backward()
        return z.grad

    assert_bitwise(dx(j)[i:j], dx(x.shape[0])[i:j], "logp dlogits: prefix vs all rows")
    # per-row temperatures (the rollout's path) == logp at each row's temperature
    from rl_engine.ops.logp import sampled_logp

    temps = torch.tensor(
        [d.r.choice([0.5, 0.7, 1.0, temp]) for _ in range(x.shape[0])], dtype=torch.float32
    ).to(x.device)
    lps, _, _ = sampled_logp(x, tok, temps, backend=p)
    for rr in {r, i, j - 1}:
        one = logp(x[rr : rr + 1], tok[rr : rr + 1], float(temps[rr]), backend=p)
        assert_bitwise(lps[rr : rr + 1], one, f"sampled_logp row {rr} vs logp at its T")


def _entropy(d: Draw) -> None:
    from rl_engine.ops import entropy

    p = d.case.provider
    dt = d.dtype()
    x, _ = _vocab_logits(d, dt)
    temp = d.r.choice([0.5, 1.0, 2.0])
    e = _rows_check(lambda z: entropy(z, temp, backend=p), x, d, "entropy")
    lq = torch.log_softmax(x.double() / temp, -1)
    want = -(lq.exp() * torch.where(torch.isfinite(lq), lq, torch.zeros_like(lq))).sum(-1)
    assert_close(e, want, rtol=1e-4, atol=1e-4, what="entropy vs float64")


def _linear_logp(d: Draw) -> None:
    from rl_engine.ops import det_gemm, linear_logp, logp
    from rl_engine.registry import resolve_provider

    p = d.case.provider
    t, h, v = d.count(120, 9000), d.count(130, 4096), d.count(1500, 151936 + 7)
    if d.big:
        t = min(t, max(1, 2**27 // v))
    dt = d.dtype()
    hid = d.randn(t, h, dtype=dt)
    w = d.randn(v, h, dtype=dt, scale=1.0 / math.sqrt(h))
    tok = torch.randint(0, v, (t,), generator=d.g).to(hid.device)
    temp = d.r.choice([0.7, 1.0])
    fused = linear_logp(hid, w, tok, temp, backend=p)
    # The fused == unfused contract is against the det_gemm the provider computes its logits
    # with: the Triton provider's own GEMM, the native provider's *resolved* det_gemm (Triton
    # on a GPU; found by the first GPU fuzz run, which compared with the native GEMM).
    gemm = p if p != "native" else resolve_provider("det_gemm", hid.device.type)
    unfused = logp(det_gemm(hid, w.t(), backend=gemm), tok, temp, backend=p)
    assert_bitwise(fused, unfused, f"linear_logp {t}x{h}x{v} vs logp(det_gemm)")
    i, j, _ = d.rows(t)
    assert_bitwise(linear_logp(hid[i:j], w, tok[i:j], temp, backend=p), fused[i:j], "rows")


def _ratio_kl(d: Draw) -> None:
    from rl_engine.ops import ratio_kl

    p = d.case.provider
    b, t = d.count(60, 4096), d.count(300, 8192)
    if d.big:
        b = min(b, max(1, 2**24 // t))
    dt = d.r.choice([torch.float32, torch.bfloat16])
    lp = d.randn(b, t, dtype=dt, scale=0.3) - 2
    old = lp + d.randn(b, t, dtype=dt, scale=0.05)
    mask = (torch.rand(b, t, generator=d.g) < 0.8).to(lp.device)
    x = torch.stack([lp, old, mask.to(dt)], 1)

    def f(z: torch.Tensor) -> torch.Tensor:
        out = ratio_kl(z[:, 0], z[:, 1], z[:, 2] != 0, backend=p)
        return torch.stack([out.log_ratio, out.ratio, out.k3, out.token_weight], 1)

    _rows_check(f, x, d, "ratio_kl")


def _attention(d: Draw) -> None:
    from rl_engine.ops import attention, paged_attention, write_kv_cache

    p = d.case.provider
    dt = d.dtype()
    hkv = d.r.choice([1, 2])
    hq = hkv * d.r.choice([1, 2, 4])
    hd = d.r.choice([16, 32]) if not d.big else d.r.choice([64, 128])
    n_seq = d.r.randint(1, 4)
    lens = [d.count(150, 4096) for _ in range(n_seq)]
    if d.interp:
        lens = [min(n, 200) for n in lens]
    dev = d.case.device
    qkv = [(d.randn(n, hq, hd, dtype=dt), d.randn(n, hkv, hd, dtype=dt),
            d.randn(n, hkv, hd, dtype=dt)) for n in lens]  # fmt: skip
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    cu = torch.tensor(offs, dtype=torch.int32, device=dev)
    q, k, v = (torch.cat([s[i] for s in qkv]) for i in range(3))
    full = attention(q, k, v, cu, backend=p)
    s0 = d.r.randrange(n_seq)
    cu0 = torch.tensor([0, lens[s0]], dtype=torch.int32, device=dev)
    alone = attention(*qkv[s0], cu0, backend=p)
    assert_bitwise(alone, full[offs[s0] : offs[s0 + 1]], f"seq {s0} alone vs batched prefill")
    # the sequence through a paged cache: a chunked prefill at a random split, then decode
    n = lens[s0]
    page = d.r.choice([16, 32])
    nb = -(-n // page) + 2
    perm = torch.randperm(nb, generator=d.g).to(torch.int32)
    table = perm[None].to(dev)
    kc = torch.zeros(nb, page, hkv, hd, dtype=dt, device=dev)
    vc = torch.zeros_like(kc)
    pos = torch.arange(n, device=dev)
    slots = table[0].long()[pos // page] * page + pos % page
    write_kv_cache(qkv[s0][1], qkv[s0][2], kc, vc, slots, backend=p)
    split = d.r.randint(0, n - 1) if n > 1 else 0
    outs = []
    bounds = [(0, split), (split, n - 1), (n - 1, n)] if n > 1 else [(0, 1)]
    for c0, c1 in bounds:
        if c1 <= c0:
            continue
        qsl = torch.tensor([0, c1 - c0], dtype=torch.int32, device=dev)
        sl = torch.tensor([c1], dtype=torch.int32, device=dev)
        outs.append(paged_attention(qkv[s0][0][c0:c1], kc, vc, table, sl, qsl, backend=p))
    assert_bitwise(torch.cat(outs), alone, f"seq {s0} ({n}): chunked at {split} + decode")


OPS: dict[str, Callable[[Draw], None]] = {
    "det_gemm": _det_gemm,
    "rms_norm": _rms_norm,
    "poly_norm": _poly_norm,
    "silu_and_mul": _silu_and_mul,
    "rope": _rope,
    "logp": _logp,
    "entropy": _entropy,
    "linear_logp": _linear_logp,
    "ratio_kl": _ratio_kl,
    "attention": _attention,
}


def providers_for(op: str, device: str) -> list[str]:
    """The invariant providers of ``op`` that can run on ``device`` here."""
    from rl_engine import KernelRegistry

    out = []
    for prov in KernelRegistry.providers(op, device):
        if not prov.invariant:
            continue
        try:
            KernelRegistry.get_op(op, device=device, backend=prov.name)
        except Exception:
            continue
        out.append(prov.name)
    return out


def check_case(case: Case, *, big: bool | None = None) -> None:
    """Run one case; raises ``AssertionError`` (property broken), :class:`Skip`, or the op's
    own error."""
    if big is None:
        big = case.device != "cpu"
    OPS[case.op](Draw(case, big))


def run(
    *,
    device: str = "cpu",
    cases: int = 200,
    seed: int = 0,
    ops: list[str] | None = None,
    providers: list[str] | None = None,
    budget: float | None = None,
    big: bool | None = None,
    progress: bool = False,
    shard: tuple[int, int] = (0, 1),
) -> FuzzReport:
    """``cases`` cases round-robin over ``ops`` x their runnable providers (or until ``budget``
    seconds have passed). ``shard=(i, n)``: only the rounds (one case of every pair) whose
    number is ``i`` modulo ``n``, so every shard draws every op evenly; the case seeds are those
    of the unsharded run, so ``n`` shards together are that run."""
    i_shard, n_shard = shard
    if not 0 <= i_shard < n_shard:
        raise ValueError(f"shard {i_shard}/{n_shard}: expected 0 <= i < n")
    ops = ops or list(OPS)
    pairs = [(op, p) for op in ops for p in providers_for(op, device)]
    if providers:
        pairs = [(op, p) for op, p in pairs if p in providers]
    if not pairs:
        raise ValueError(f"no runnable (op, provider) pair on {device} for {ops} / {providers}")
    rep = FuzzReport()
    t0 = time.perf_counter()
    master = random.Random(seed)
    for idx in range(cases):
        if budget is not None and time.perf_counter() - t0 > budget:
            break
        op, prov = pairs[idx % len(pairs)]
        case = Case(op, prov, device, master.randrange(2**31))
        if (idx // len(pairs)) % n_shard != i_shard:
            continue
        rep.cases += 1
        key = f"{op}/{prov}"
        rep.per_op[key] = rep.per_op.get(key, 0) + 1
        t_case = time.perf_counter()
        try:
            _check_with_oom_retry(case, big)
            rep.passed += 1
        except Skip:
            rep.skipped += 1
        except Exception as exc:
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            rep.failures.append({"case": case.__dict__, "error": msg,
                                 "reproducer": case.reproducer()})  # fmt: skip
            print(f"FUZZ FAIL {case.op}/{case.provider} seed {case.seed}: {msg}\n  "
                  f"{case.reproducer()}", file=sys.stderr, flush=True)  # fmt: skip
        spent = time.perf_counter() - t_case
        rep.seconds_per_op[key] = rep.seconds_per_op.get(key, 0.0) + spent
        if progress and rep.cases % 100 == 0:
            print(f"fuzz: {rep.cases} cases, {len(rep.failures)} failed, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    rep.seconds = time.perf_counter() - t0
    return rep


_LOCK_ENV = "RL_ENGINE_FUZZ_LOCK"  # set by --workers: a file the shards of one run share


def _is_oom(exc: BaseException | None) -> bool:
    """A CUDA out-of-memory error, from torch or from a Triton launch, also where another
    error wraps it (``torch.testing`` re-raises what its comparison met as ``RuntimeError:
    Comparing ...``, the out-of-memory error as its cause)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, torch.OutOfMemoryError) or (
            isinstance(exc, RuntimeError) and "out of memory" in str(exc)
        ):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class _ShardLock:
    """Shards of one ``--workers`` run share the GPU's memory. Every case runs holding a shared
    lock; a case that ran out of memory (the memory was its neighbours') runs again holding it
    exclusively, so alone on the GPU. A turnstile in front keeps new cases from starting while
    a retry waits for the running ones to finish. Without ``RL_ENGINE_FUZZ_LOCK`` (one
    process) both are no-ops."""

    def __init__(self) -> None:
        from rl_engine.config import settings

        path = settings().fuzz_lock
        self._fds = None
        if path:
            self._fds = (os.open(path + ".gate", os.O_CREAT | os.O_RDWR),
                         os.open(path, os.O_CREAT | os.O_RDWR))  # fmt: skip

    def run(self, fn: Callable[[], None], *, alone: bool) -> None:
        if self._fds is None:
            fn()
            return
        import fcntl

        gate, main = self._fds
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            fn()
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # what this case cached is free for the next one
            fcntl.flock(main, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


_SHARD_LOCK: _ShardLock | None = None


def _check_with_oom_retry(case: Case, big: bool | None, tries: int = 3) -> None:
    """:func:`check_case`; on a CUDA out-of-memory error (``--workers`` shards share the GPU: the
    memory was the neighbours', not the case's) the cached blocks are freed and the case runs
    again, alone on the GPU when shards share it (:class:`_ShardLock`), up to ``tries`` times;
    the last error stands."""
    global _SHARD_LOCK
    if _SHARD_LOCK is None:
        _SHARD_LOCK = _ShardLock()
    for attempt in range(tries):
        try:
            _SHARD_LOCK.run(lambda: check_case(case, big=big), alone=attempt > 0)
            return
        except Exception as exc:
            if case.device == "cpu" or attempt == tries - 1 or not _is_oom(exc):
                raise
            torch.cuda.empty_cache()


def long_inputs(device: str) -> dict[str, Any]:
    """GPU checks beyond the drawn sizes: 65,536 tokens through attention (prefill == the last
    token's decode) and ``linear_logp`` (== ``logp(det_gemm)``, rows alone == in the batch),
    with a 151,936 + 7 vocabulary."""
    from rl_engine.ops import attention, det_gemm, linear_logp, logp, paged_attention

    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    n, hq, hkv, hd, page = 65536, 8, 2, 128, 16
    q, k, v = (
        torch.randn(n, h, hd, generator=g).to(device, torch.bfloat16) for h in (hq, hkv, hkv)
    )
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    full = attention(q, k, v, cu)
    table = torch.arange(n // page, dtype=torch.int32, device=device)[None]
    kc, vc = k.view(n // page, page, hkv, hd), v.view(n // page, page, hkv, hd)
    dec = paged_attention(
        q[-1:], kc, vc, table,
        torch.tensor([n], dtype=torch.int32, device=device),
        torch.tensor([0, 1], dtype=torch.int32, device=device),
    )  # fmt: skip
    assert_bitwise(dec, full[-1:], "attention 65,536 tokens: decode of the last == prefill")
    out["attention_65536"] = "ok"
    t, h, vocab = 65536, 1024, 151936 + 7
    hid = torch.randn(t, h, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(vocab, h, generator=g) / 32).to(device, torch.bfloat16)
    tok = torch.randint(0, vocab, (t,), generator=g).to(device)
    lp = linear_logp(hid, w, tok)
    for a, b in ((0, 1), (12345, 12350), (t - 7, t)):
        assert_bitwise(linear_logp(hid[a:b], w, tok[a:b]), lp[a:b], f"linear_logp rows {a}:{b}")
    sl = slice(t - 4096, t)
    assert_bitwise(logp(det_gemm(hid[sl], w.t()), tok[sl]), lp[sl], "linear_logp == logp(det_gemm)")
    out["linear_logp_65536_v151943"] = "ok"
    return out


def model_repeats(device: str, n: int = 100) -> dict[str, Any]:
    """``n`` forward + backward passes of a patched tiny HF model: log-probs and every parameter
    gradient bitwise equal to the first pass."""
    import tempfile

    from rl_engine.engines import load_trainer
    from rl_engine.testing.tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(f"{tmp}/m", "qwen2", "bfloat16", True, seed=1)
        model = load_trainer("hf", "rl_engine", str(path), dtype=torch.bfloat16, device=device)
    from rl_engine.adapters.hf import token_logprobs

    g = torch.Generator().manual_seed(1)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (4, 200), generator=g).to(device)
    first = None
    for i in range(n):
        model.zero_grad(set_to_none=True)
        lp = token_logprobs(model, ids, 0.7)
        lp.sum().backward()
        state = [lp.detach().clone()] + [p.grad.clone() for p in model.parameters()]
        if first is None:
            first = state
            continue
        for j, (a, b) in enumerate(zip(state, first, strict=True)):
            assert_bitwise(a, b, f"repeat {i}: tensor {j} (0 = log-probs, then gradients)")
    return {"model_repeats": n}


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs)."""
    n = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [g.strip() for g in listed.split(",") if g.strip()][:n]
    return [str(i) for i in range(n)]


def _run_workers(args: argparse.Namespace) -> FuzzReport:
    """``args.workers`` shard processes of this run's case list, their reports merged; a shard
    that dies counts as a failure."""
    import subprocess
    import tempfile

    base = ["--device", args.device, "--cases", str(args.cases), "--seed", str(args.seed)]
    for flag, value in (("--ops", args.ops), ("--providers", args.providers),
                        ("--budget", args.budget)):  # fmt: skip
        if value is not None:
            base += [flag, str(value)]
    rep = FuzzReport()
    gpus = _visible_gpus() if args.device == "cuda" else []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rl_engine_fuzz_") as tmp:
        procs = []
        for i in range(args.workers):
            path = f"{tmp}/shard{i}.json"
            cmd = [sys.executable, "-m", "rl_engine.harness.fuzz", *base,
                   "--shard", f"{i}/{args.workers}", "--json", path]  # fmt: skip
            env = dict(os.environ)
            gpu = gpus[i % len(gpus)] if gpus else "cpu"
            if len(gpus) > 1:  # shards dealt round-robin over the visible GPUs
                env["CUDA_VISIBLE_DEVICES"] = gpu
            env[_LOCK_ENV] = f"{tmp}/gpu{gpu}.lock"  # one lock per device its shards share
            procs.append((i, path, subprocess.Popen(cmd, env=env)))
        for i, path, proc in procs:
            proc.wait()
            try:
                with open(path) as f:
                    rep.merge(json.load(f))
            except (OSError, ValueError) as exc:
                rep.failures.append({"case": {"shard": f"{i}/{args.workers}"},
                                     "error": f"shard exited {proc.returncode}: {exc}",
                                     "reproducer": " ".join(proc.args)})  # fmt: skip
    rep.seconds = time.perf_counter() - t0
    return rep


def _code_hash() -> str:
    """:func:`rl_engine.run_info.code_hash`: two reports with the same hash ran the same kernels and
    checks."""
    from rl_engine.run_info import code_hash

    return code_hash()


def _run_identity(device: str, seed: int) -> dict[str, Any]:
    """What a report must say to be merged with others: the seed, the code, the device."""
    import datetime

    ident: dict[str, Any] = {
        "seed": seed,
        "code_hash": _code_hash(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        ident["device_name"] = torch.cuda.get_device_name()
    try:
        import triton

        ident["triton"] = triton.__version__
    except ImportError:
        pass
    return ident


def merge_reports(reports: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One report from the reports of several runs on the same code (``code_hash``) with
    distinct seeds (each seed draws its own case list): counts and failures added, ``seconds``
    the runs' total, each run listed under ``runs``. Refuses runs of other code, repeated
    seeds, or reports without the identity fields."""
    if not reports:
        raise ValueError("fuzz --merge: no reports")
    missing = [n for n, r in zip(names, reports, strict=True) if "code_hash" not in r]
    if missing:
        raise ValueError(f"fuzz --merge: {missing} have no code_hash (written before merging "
                         "existed); rerun them")  # fmt: skip
    hashes = {r["code_hash"] for r in reports}
    if len(hashes) > 1:
        raise ValueError(f"fuzz --merge: the reports ran different code ({sorted(hashes)})")
    seeds = [r["seed"] for r in reports]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"fuzz --merge: repeated seeds {seeds} (the same cases twice)")
    rep = FuzzReport()
    for r in reports:
        rep.merge(r)
    rep.seconds = sum(r["seconds"] for r in reports)
    out = rep.as_dict()
    out["code_hash"] = hashes.pop()
    out["runs"] = [
        {"report": n, **{k: r.get(k) for k in ("seed", "cases", "failed", "seconds", "device",
                                               "device_name", "date", "workers", "gpus")}}
        for n, r in zip(names, reports, strict=True)
    ]  # fmt: skip
    extras = {n: r["extras"] for n, r in zip(names, reports, strict=True) if "extras" in r}
    if extras:
        out["extras"] = extras
        out["failed"] += sum(
            1 for e in extras.values() for v in e.values() if isinstance(v, dict) and "error" in v
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rl_engine.harness.fuzz", description=__doc__)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    ap.add_argument("--cases", type=int, default=200, help="cases to draw (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="master seed (default: %(default)s)")
    ap.add_argument("--ops", default=None, help="comma separated ops (default: all)")
    ap.add_argument("--providers", default=None, help="comma separated provider names")
    ap.add_argument("--budget", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--op", default=None, help="with --case-seed: run that one case")
    ap.add_argument("--provider", default=None, help="with --case-seed")
    ap.add_argument("--case-seed", type=int, default=None, help="rerun one case (reproducer)")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="run the cases in this many processes (shards of the same case list; on a GPU they "
        "share the device: a case is mostly host time and kernel compiles; with several visible "
        "GPUs the shards are dealt round-robin over them) (default: %(default)s)",
    )
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # i/n, set by --workers
    ap.add_argument(
        "--extras",
        action="store_true",
        help="also the long inputs (65,536 tokens, a 151,936 + 7 vocabulary) and 100 repeats of a "
        "patched model's forward + backward (GPU)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="REPORT",
        help="merge the --json reports of several runs (same code, distinct seeds) into one "
        "report (--json) instead of running cases",
    )
    args = ap.parse_args(argv)
    if args.merge:
        try:
            out = merge_reports([json.loads(open(p).read()) for p in args.merge], args.merge)
        except ValueError as exc:
            ap.error(str(exc))
        print(json.dumps({k: v for k, v in out.items() if k != "failures"}, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 1 if out["failed"] else 0
    if args.case_seed is not None:
        if not (args.op and args.provider):
            ap.error("--case-seed needs --op and --provider")
        case = Case(args.op, args.provider, args.device, args.case_seed)
        try:
            check_case(case)
        except Exception:
            traceback.print_exc()
            return 1
        print(f"ok: {case}")
        return 0
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    if args.workers > 1:
        rep = _run_workers(args)
    else:
        shard = (0, 1)
        if args.shard:
            i, n = (int(v) for v in args.shard.split("/"))
            shard = (i, n)
        rep = run(
            device=args.device,
            cases=args.cases,
            seed=args.seed,
            ops=args.ops.split(",") if args.ops else None,
            providers=args.providers.split(",") if args.providers else None,
            budget=args.budget,
            progress=True,
            shard=shard,
        )
    out = {**rep.as_dict(), **_run_identity(args.device, args.seed)}
    if args.workers > 1:
        out["workers"] = args.workers
        if args.device == "cuda":
            out["gpus"] = len(_visible_gpus())
    if args.extras:
        extras: dict[str, Any] = {}
        for name, fn in (("long_inputs", long_inputs), ("model_repeats", model_repeats)):
            t0 = time.perf_counter()
            try:
                extras[name] = {**fn(args.device), "seconds": round(time.perf_counter() - t0, 1)}
            except Exception as exc:
                extras[name] = {"error": f"{type(exc).__name__}: {exc}"}
                out["failed"] += 1
        out["extras"] = extras
    print(json.dumps({k: v for k, v in out.items() if k != "failures"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
