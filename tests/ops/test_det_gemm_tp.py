"""The TP-invariant reduction (``rl_engine.ops.det_gemm.tp``): every TP degree's shards,
computed and combined in one process, give the TP = 1 bits, forward and backward.

The shards here are computed with the native det_gemm provider (the CPU's); the multi-process
versions (gloo) are in tests/adapters/test_megatron_tp.py.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops import det_gemm
from rl_engine.ops.det_gemm import tp as tpm

DEGREES = [2, 4, 8]


def _data(m, k, n, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return a, w, bias


def _gathering(parts_by_rank):
    """An exchange for rank-by-rank simulation: returns the list collected so far."""
    return lambda t: parts_by_rank


@pytest.mark.parametrize("tp", DEGREES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_parallel_shards_equal_tp1(tp, dtype):
    a, w, bias = _data(37, 96, 24, dtype)
    full = tpm.det_gemm_tp(a, w.t(), bias)
    step = a.shape[1] // tp
    subs = [
        tpm.subtree(a[:, r * step : (r + 1) * step], w.t()[r * step : (r + 1) * step], 8 // tp)
        for r in range(tp)
    ]
    assert torch.equal(tpm.finish(tpm.combine(subs), bias, dtype), full)


def test_tp_reduction_is_not_the_plain_gemm_order():
    """The grouping is real numerics: on this case it differs from det_gemm's own order
    (and a TP = 4 sum of det_gemm partials in rank order differs from TP = 1 det_gemm)."""
    a, w, _ = _data(64, 512, 64, torch.float32, seed=3)
    plain = det_gemm(a, w.t())
    grouped = tpm.det_gemm_tp(a, w.t())
    assert not torch.equal(plain, grouped)
    naive = sum(
        det_gemm(a[:, r * 128 : (r + 1) * 128], w.t()[r * 128 : (r + 1) * 128]) for r in range(4)
    )
    assert not torch.equal(naive, plain)


@pytest.mark.parametrize("tp", DEGREES)
def test_row_parallel_rows_are_batch_invariant(tp):
    a, w, bias = _data(33, 64, 16)
    full = tpm.det_gemm_tp(a, w.t(), bias)
    for rows in (slice(0, 1), slice(5, 17), slice(32, 33)):
        assert torch.equal(tpm.det_gemm_tp(a[rows], w.t(), bias), full[rows])


def _column_grad(x, w, glu, tp):
    """dx of a column-parallel layer sharded ``tp`` ways (GLU layout: rank r holds
    ``[gate_r; up_r]``), all shards run in this process."""
    n = w.shape[0]
    if glu:
        gate, up = w[: n // 2], w[n // 2 :]
        s = n // 2 // tp
        shards = [
            torch.cat([gate[r * s : (r + 1) * s], up[r * s : (r + 1) * s]]) for r in range(tp)
        ]
    else:
        s = n // tp
        shards = [w[r * s : (r + 1) * s] for r in range(tp)]
    g = torch.Generator().manual_seed(7)
    grad_out = torch.randn(x.shape[0], n, generator=g).to(x.dtype)
    if glu:
        gs, gu = grad_out[:, : n // 2], grad_out[:, n // 2 :]
        s = n // 2 // tp
        grad_shards = [
            torch.cat([gs[:, r * s : (r + 1) * s], gu[:, r * s : (r + 1) * s]], 1)
            for r in range(tp)
        ]
    else:
        grad_shards = [grad_out[:, r * s : (r + 1) * s] for r in range(tp)]
    subs = [tpm.subtree(gr, wr, 8 // tp, glu=glu) for gr, wr in zip(grad_shards, shards)]
    sharded = tpm.combine(subs).to(x.dtype)
    xs = x.clone().requires_grad_(True)
    y = tpm.tp_linear(xs, w, None, parallel="column", glu=glu)
    y.backward(grad_out)
    return xs.grad, sharded


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("tp", DEGREES)
def test_column_parallel_input_grad_shards_equal_tp1(glu, tp):
    x, w, _ = _data(19, 32, 96)
    full, sharded = _column_grad(x, w, glu, tp)
    assert torch.equal(full, sharded)


def test_column_parallel_forward_is_det_gemm():
    x, w, bias = _data(9, 32, 48)
    assert torch.equal(tpm.tp_linear(x, w, bias, parallel="column"), det_gemm(x, w.t(), bias))


def test_row_parallel_backward_is_det_gemm_rule():
    a, w, bias = _data(11, 64, 24)
    g = torch.randn(11, 24, generator=torch.Generator().manual_seed(1)).to(a.dtype)
    outs = []
    for fn in (lambda a, w, b: tpm.det_gemm_tp(a, w.t(), b), lambda a, w, b: det_gemm(a, w.t(), b)):
        a_, w_, b_ = (t.clone().requires_grad_(True) for t in (a, w, bias))
        fn(a_, w_, b_).backward(g)
        outs.append((a_.grad, w_.grad, b_.grad))
    for x, y in zip(*outs):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "k,tp,msg",
    [
        (96, 3, "allowed degrees: \\[1, 2, 4, 8\\]"),
        (100, 2, "not a multiple of 8"),
        (96, 16, "allowed"),
    ],
)
def test_bad_split_refused(k, tp, msg):
    with pytest.raises(ValueError, match=msg):
        tpm.check_split(k, tp, what="test")


def test_exchange_must_match_degree():
    x, w, _ = _data(4, 32, 8)
    with pytest.raises(ValueError, match="exchange"):
        tpm.tp_linear(x, w, parallel="row", tp=2)
    with pytest.raises(ValueError, match="parallel"):
        tpm.tp_linear(x, w, parallel="diagonal")


def test_family_names_provider():
    assert tpm.family("cpu", "native") == "det_gemm_tp/g8[det_gemm/native-k16]"


class _SimGroup:
    """``t`` ranks in threads: the all-to-all and the all-gather meet at a barrier, each rank
    receives what the collectives would give it (no process group, any exchange body)."""

    def __init__(self, t: int) -> None:
        import threading

        self.t, self.slots, self.barrier = t, [None] * t, threading.Barrier(t)

    def _share(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.barrier.wait()
        self.slots[rank] = x.clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def exchange(self, rank: int):
        def all_to_all(x):
            assert x.shape[0] == self.t
            return torch.stack([other[rank] for other in self._share(rank, x)])

        def all_gather(x):
            return torch.cat(self._share(rank, x))

        return tpm.Exchange(all_to_all, all_gather, rank, self.t)


def _run_ranks(t: int, fn) -> list:
    """``fn(rank, exchange)`` on ``t`` threads sharing one :class:`_SimGroup`."""
    from concurrent.futures import ThreadPoolExecutor

    grp = _SimGroup(t)
    with ThreadPoolExecutor(t) as pool:
        return list(pool.map(lambda r: fn(r, grp.exchange(r)), range(t)))


@pytest.mark.parametrize("rows", [8, 6, 7])  # row blocks (8 / t rows each); column blocks
@pytest.mark.parametrize("tp", [2, 4])
def test_exchange_equals_combine(tp, rows):
    """The all-to-all + all-gather exchange (row blocks when the rows split evenly, else column
    blocks), ``t`` ranks in threads, gives the bits of ``finish(combine(subtrees), bias)`` on
    every rank; ``scatter`` gives each rank its rows of it (sequence parallelism)."""
    g = torch.Generator().manual_seed(5)
    subs = [torch.randn(rows, 16, generator=g) * 10.0 ** (r - 2) for r in range(tp)]
    for dt in (torch.bfloat16, torch.float32):  # fp32: the combine's bits, unrounded
        bias = torch.randn(16, generator=g).to(dt)
        want = tpm.finish(tpm.combine(subs), bias, dt)
        got = _run_ranks(tp, lambda r, ex, bias=bias, dt=dt: ex(subs[r], bias, dt))
        for rank, out in enumerate(got):
            assert torch.equal(out, want), f"{dt}, rank {rank}"
        if rows % tp == 0:
            h = rows // tp
            got = _run_ranks(tp, lambda r, ex, bias=bias, dt=dt: ex.scatter(subs[r], bias, dt))
            for rank, out in enumerate(got):
                assert torch.equal(out, want[rank * h : (rank + 1) * h]), f"scatter, rank {rank}"
    if tp == 4:  # the control: the same partials added left to right give other bits
        assert not torch.equal(tpm.finish(sum(subs), bias, torch.float32), want)


def _triton_or_skip():
    from rl_engine.config import settings
    from rl_engine.registry import KernelRegistry

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    prov = KernelRegistry.provider("det_gemm", "triton")
    reason = prov.why_not(dev, triton_interpret=settings().triton_interpret)
    if reason is not None:
        pytest.skip(reason)
    return dev


@pytest.mark.parametrize("tp", [2, 4])
def test_triton_provider_shards_equal_tp1(tp):
    """The same identities with the Triton det_gemm provider's fp32 products (GPU, or the
    interpreter: scripts/test.sh runs this file with TRITON_INTERPRET=1, -k triton)."""
    dev = _triton_or_skip()
    a, w, bias = (t.to(dev) for t in _data(13, 64, 24, torch.float32, seed=4))
    full = tpm.det_gemm_tp(a, w.t(), bias, backend="triton")
    step = 64 // tp
    subs = [
        tpm.subtree(
            a[:, r * step : (r + 1) * step],
            w.t()[r * step : (r + 1) * step],
            8 // tp,
            backend="triton",
        )
        for r in range(tp)
    ]
    assert torch.equal(tpm.finish(tpm.combine(subs), bias, a.dtype), full)
    assert torch.equal(tpm.det_gemm_tp(a[3:7], w.t(), bias, backend="triton"), full[3:7])
    assert tpm.family(dev, "triton").startswith("det_gemm_tp/g8[det_gemm/triton-")


def test_exchange_built_on_first_use():
    """An exchange named by a registered prefix is built where the op first runs (a compiled
    graph loaded from a cache never ran the Python that registers it); an unknown name raises."""
    built = []

    def build(name):
        built.append(name)
        return tpm.Exchange()

    tpm.register_exchange_builder("test-prefix:", build)
    try:
        a, w, bias = _data(3, 64, 8)
        want = tpm.det_gemm_tp(a, w.t(), bias, groups=8)
        got = tpm.tp_row_parallel(a, w.t(), bias, 8, "test-prefix:g0")
        assert torch.equal(got, want)
        tpm.tp_row_parallel(a, w.t(), bias, 8, "test-prefix:g0")
        assert built == ["test-prefix:g0"]  # built once, then kept
        with pytest.raises(RuntimeError, match="no exchange registered"):
            tpm.tp_row_parallel(a, w.t(), bias, 8, "unknown:g0")
    finally:
        tpm._BUILDERS.pop("test-prefix:", None)
        tpm._EXCHANGES.pop("test-prefix:g0", None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 8B shapes: a GPU")
@pytest.mark.parametrize("tp", DEGREES)
@pytest.mark.parametrize(
    "k,n", [(4096, 4096), (14336, 4096)], ids=["llama3-8b.o_proj", "llama3-8b.down_proj"]
)
def test_gpu_8b_shapes_shards_equal_tp1(k, n, tp):
    """Issue 18's one-device check at the Llama-3-8B row-parallel shapes, bf16, Triton provider:
    each rank's shard of the reduction (its 8 / tp groups) computed alone and the shards combined
    in rank order give the TP = 1 bits; a slice of the rows gives its rows' bits."""
    dev = _triton_or_skip()
    a, w, bias = (t.to(dev) for t in _data(256, k, n, torch.bfloat16, seed=11))
    full = tpm.det_gemm_tp(a, w.t(), bias, backend="triton")
    step = k // tp
    subs = [
        tpm.subtree(a[:, r * step : (r + 1) * step], w.t()[r * step : (r + 1) * step], 8 // tp,
                    backend="triton")
        for r in range(tp)
    ]  # fmt: skip
    assert torch.equal(tpm.finish(tpm.combine(subs), bias, a.dtype), full)
    assert torch.equal(tpm.det_gemm_tp(a[5:22], w.t(), bias, backend="triton"), full[5:22])
    # the plain det_gemm reduction is another order: the grouping is what makes the shards agree
    assert not torch.equal(det_gemm(a, w.t(), bias, backend="triton"), full)
