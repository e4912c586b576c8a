"""The TP reduction's one-launch Triton subtree kernel: all of a rank's group products and
their pair tree in one kernel, bitwise (``torch.equal``) the bits of the reference path it
replaces, ``tp.subtree_per_group`` (one ``det_gemm_wgrad`` launch per group, ``torch.stack``,
``pair_tree``).

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``, scripts/test.sh; fp32 /
fp16) and skip otherwise; on a CUDA device they run on the GPU (bf16 too).

The one-shot exchange's combine kernel must give ``finish(combine(subtrees), bias, dtype)``, the
NCCL exchange's bits: here its ranks are buffers of one process (barriers off), and ranks in
processes sharing memory exercise its barriers (interpreter; the interpreter rounds fp32 -> bf16
by truncation, so fp32 / fp16 outputs). The GPU check with symmetric memory and NCCL is
``torchrun --nproc-per-node 2 -m rl_engine.harness.tp_exchange_check``.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile

import pytest
import torch

from rl_engine.ops.det_gemm import config as gemm_config
from rl_engine.ops.det_gemm import oneshot
from rl_engine.ops.det_gemm import tp as tpm
from rl_engine.ops.det_gemm import triton as gemm_triton
from tests.conftest import DEVICE, ON_GPU, TRITON_DTYPES, skip_unless_triton

pytestmark = skip_unless_triton(gemm_triton)


def _shard(m, k, n, dtype, seed=0, layout="linear"):
    """``a [m, k]``, ``b [k, n]``: ``b`` as a row-parallel layer passes it (``weight.t()``,
    K-contiguous) or, ``layout="kn"``, N-contiguous (the column-parallel input gradient's
    ``weight``); ``a`` transposed-strided for ``layout="strided"``."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    if layout == "strided":
        a = a.t().contiguous().t()
    b = w.t().contiguous() if layout == "kn" else w.t()
    return a.to(DEVICE), b.to(DEVICE)


# ------------------------------------------------------------------- one-launch group subtree
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize(
    "m,k,n,groups,glu,layout",
    [
        (1, 64, 24, 8, False, "linear"),  # decode: one row, 8 groups of 8 (TP 1)
        (17, 96, 40, 4, False, "linear"),  # TP 2's 4 groups, odd rows and columns
        (33, 64, 16, 2, False, "kn"),  # TP 4's 2 groups, N-contiguous b
        (5, 72, 12, 8, False, "strided"),  # groups of 9: masked K tail in every group
        (7, 48, 8, 1, False, "linear"),  # TP 8: one group, no tree
        (9, 128, 24, 4, True, "kn"),  # GLU (Megatron's [gate; up] column-parallel dx)
        (3, 96, 16, 2, True, "linear"),  # GLU, gate/up blocks of 24: a step straddles them
    ],
)
def test_subtree_one_launch_equals_per_group(m, k, n, groups, glu, layout, dtype):
    """The one-launch kernel == the per-group launches + stack + pair_tree, bitwise; and
    ``tp.subtree`` (what every adapter calls) takes the one-launch kernel for Triton."""
    a, b = _shard(m, k, n, dtype, seed=m + k, layout=layout)
    want = tpm.subtree_per_group(a, b, groups, glu=glu, backend="triton")
    got = gemm_triton.det_gemm_tp_subtree(a, b, groups, glu=glu)
    assert got.dtype == torch.float32
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(tpm.subtree(a, b, groups, glu=glu, backend="triton"), want)


def test_subtree_env_per_group(monkeypatch):
    """``RL_ENGINE_TP_SUBTREE=per-group`` (a bisection aid) routes ``tp.subtree`` around the
    one-launch kernel: same bits, the kernel not called."""
    from rl_engine import config

    a, b = _shard(6, 64, 16, TRITON_DTYPES[-1], seed=5)
    want = tpm.subtree(a, b, 4, backend="triton")
    calls = []
    extras = gemm_triton.PROVIDER.extras
    monkeypatch.setitem(extras, "tp_subtree", lambda *x, **kw: calls.append(1))
    with config.override_env({"RL_ENGINE_TP_SUBTREE": "per-group"}):
        got = tpm.subtree(a, b, 4, backend="triton")
    assert not calls and torch.equal(got, want)
    tpm.subtree(a, b, 4, backend="triton")  # default: the one-launch entry
    assert calls == [1]
    with pytest.raises(ValueError, match="TP_SUBTREE"):
        with config.override_env({"RL_ENGINE_TP_SUBTREE": "x"}):
            pass


def test_subtree_one_launch_every_config_equal():
    """Every config of the launch table (tile shape, warps, stages) gives the same bits."""
    dtype = TRITON_DTYPES[-1]
    a, b = _shard(21, 128, 40, dtype, seed=3)
    want = tpm.subtree_per_group(a, b, 4, backend="triton")
    for cfg in gemm_config.all_tp_subtree_configs(dtype):
        got = gemm_triton.det_gemm_tp_subtree(a, b, 4, cfg=cfg)
        assert torch.equal(got, want), cfg


def test_subtree_one_launch_across_chunks():
    """A group longer than ``WGRAD_CHUNK``: the chunk partials of the weight-gradient order
    (fresh fp32 partial per 4096 positions of the group, in order), GLU included."""
    chunk = gemm_config.WGRAD_CHUNK
    for k, groups, glu in ((chunk + 32, 1, False), (2 * (chunk // 2 + 48), 1, True)):
        a, b = _shard(2, k, 8, torch.float32, seed=k)
        want = tpm.subtree_per_group(a, b, groups, glu=glu, backend="triton")
        assert torch.equal(gemm_triton.det_gemm_tp_subtree(a, b, groups, glu=glu), want)


def test_subtree_one_launch_rows_invariant_and_out():
    """Rows are batch invariant (a row alone == in 23 rows); ``out`` (a strided fp32 view, as
    an exchange's buffer) receives the same bits."""
    a, b = _shard(23, 64, 24, torch.float32, seed=9)
    full = gemm_triton.det_gemm_tp_subtree(a, b, 8)
    for rows in (slice(0, 1), slice(4, 21), slice(22, 23)):
        assert torch.equal(gemm_triton.det_gemm_tp_subtree(a[rows], b, 8), full[rows])
    big = torch.full((23, 48), float("nan"), device=DEVICE)
    out = big[:, 8:32]
    res = gemm_triton.det_gemm_tp_subtree(a, b, 8, out=out)
    assert res.data_ptr() == out.data_ptr() and torch.equal(out, full)
    assert big[:, :8].isnan().all() and big[:, 32:].isnan().all()  # nothing outside out


def test_subtree_tree_order_is_checked():
    """The control: the same group products added left to right (not the pair tree) differ,
    so the equality tests above can fail on a wrong combine order."""
    a, b = _shard(32, 64, 32, torch.float32, seed=5)
    parts = [tpm.subtree_per_group(a[:, i : i + 8], b[i : i + 8], 1, backend="triton")
             for i in range(0, 64, 8)]  # fmt: skip
    left_to_right = parts[0]
    for p in parts[1:]:
        left_to_right = left_to_right + p
    tree = gemm_triton.det_gemm_tp_subtree(a, b, 8)
    assert torch.equal(tree, tpm.pair_tree(torch.stack(parts)))
    assert not torch.equal(tree, left_to_right)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_subtree_one_launch_shards_equal_tp1(tp):
    """Each rank's one-launch subtree, combined in rank order, == TP 1's one-launch result."""
    a, b = _shard(13, 128, 24, TRITON_DTYPES[-1], seed=tp)
    full = gemm_triton.det_gemm_tp_subtree(a, b, 8)
    s = 128 // tp
    subs = [gemm_triton.det_gemm_tp_subtree(a[:, r * s : (r + 1) * s], b[r * s : (r + 1) * s],
                                           8 // tp) for r in range(tp)]  # fmt: skip
    assert torch.equal(tpm.combine(subs), full)


def test_subtree_one_launch_errors():
    a, b = _shard(4, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        gemm_triton.det_gemm_tp_subtree(a, b, 3)
    with pytest.raises(ValueError, match="power of two"):
        gemm_triton.det_gemm_tp_subtree(a, b, 64)
    with pytest.raises(ValueError, match="do not split"):
        gemm_triton.det_gemm_tp_subtree(a[:, :60], b[:60], 8)
    with pytest.raises(ValueError, match="do not multiply"):
        gemm_triton.det_gemm_tp_subtree(a, b[:32], 8)
    with pytest.raises(TypeError, match="dtypes"):
        gemm_triton.det_gemm_tp_subtree(a, b.half(), 8)
    with pytest.raises(ValueError, match="out must be fp32"):
        gemm_triton.det_gemm_tp_subtree(a, b, 8, out=torch.empty(4, 8, dtype=torch.float16))
    empty = gemm_triton.det_gemm_tp_subtree(a[:0], b, 8)
    assert empty.shape == (0, 8)


# ---------------------------------------------------------------- one-shot exchange (combine)
def _subtrees(world, m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes far apart: the order of the adds shows in the bits
    return [torch.randn(m, n, generator=g) * 4.0 ** (r - 3) for r in range(world)]


def _local_ranks(world, max_bytes, device="cpu"):
    """``world`` :class:`OneShot` objects over buffers of this process on ``device`` (the
    barriers off: every rank's subtree is written before any combine runs; on a GPU the "peers"
    are buffers of the one device, addressed as the one-shot kernel addresses its peers)."""
    words = oneshot._FLAG_WORDS + max_bytes // 4
    bufs = [torch.zeros(words, dtype=torch.int32, device=device) for _ in range(world)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    exs = [oneshot.OneShot(bufs[r], ptrs, r, world, max_bytes) for r in range(world)]
    for ex in exs:
        ex.sync = False
    return exs, bufs


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("m", [8, 1, 300])  # 300 x 40: more elements than one program step
def test_oneshot_combine_equals_exchange_bits(world, m):
    """The one-shot kernel's combine == ``finish(combine(subtrees), bias, dtype)`` (what the
    NCCL exchange computes) on every rank, whole result and (``rows``) the rank's block of
    rows; fp32 (the unrounded tree) and fp16. One process: the ranks' buffers side by side on
    one device (the GPU, or the CPU in the interpreter)."""
    n = 40
    subs = [s.to(DEVICE) for s in _subtrees(world, m, n, seed=world + m)]
    exs, _ = _local_ranks(world, 4 * m * n, DEVICE)
    for r, ex in enumerate(exs):
        ex.staging(m, n).copy_(subs[r])
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16):
        bias = torch.randn(n, generator=g).to(dtype).to(DEVICE)
        want = tpm.finish(tpm.combine(subs), bias, dtype)
        for r, ex in enumerate(exs):
            assert torch.equal(ex(ex.staging(m, n), bias, dtype), want), f"{dtype} rank {r}"
            if m % world == 0:
                h = m // world
                got = ex(ex.staging(m, n), bias, dtype, rows=True)
                assert torch.equal(got, want[r * h : (r + 1) * h]), f"rows, rank {r}"
        assert torch.equal(exs[0](subs[0], None, dtype), tpm.finish(tpm.combine(subs), None, dtype))
    if world >= 4:  # the control: a left-to-right sum of the same subtrees differs
        assert not torch.equal(sum(subs), tpm.combine(subs))


def test_oneshot_refuses_what_it_cannot_take():
    """Refused before any launch: the checks are the same on every device."""
    exs, _ = _local_ranks(2, 4 * 8 * 8, DEVICE)
    ex = exs[0]
    assert ex.fits(8, 8) and not ex.fits(8, 9) and not ex.fits(0, 8)
    with pytest.raises(ValueError, match="at most"):
        ex(torch.zeros(8, 9, device=DEVICE), None, torch.float32)
    with pytest.raises(ValueError, match="fp32"):
        ex(torch.zeros(2, 2, dtype=torch.float16, device=DEVICE), None, torch.float16)
    with pytest.raises(ValueError, match="do not split"):
        ex(torch.zeros(3, 8, device=DEVICE), None, torch.float32, rows=True)
    with pytest.raises(ValueError, match="power of two"):
        oneshot.OneShot(torch.zeros(4096, dtype=torch.int32), torch.zeros(3), 0, 3, 64)


def _rank_proc(rank, world, files, words, m, n, rounds, result):
    """One rank in its own process: map every rank's buffer file, run ``rounds`` exchanges
    (barriers on) on fresh subtrees, write the results."""
    bufs = [torch.from_file(f, shared=True, size=words, dtype=torch.int32) for f in files]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    ex = oneshot.OneShot(bufs[rank], ptrs, rank, world, 4 * m * n)
    outs = []
    for i in range(rounds):
        sub = _subtrees(world, m, n, seed=100 + i)[rank]
        ex.staging(m, n).copy_(sub)  # safe: the previous call's phase B is behind us
        outs.append(ex(ex.staging(m, n), None, torch.float32))
        outs.append(ex(ex.staging(m, n), None, torch.float32, rows=True))
    torch.save([outs, ex.epochs.clone()], result)


@pytest.mark.skipif(ON_GPU, reason="ranks in CPU processes: the interpreter only")
@pytest.mark.parametrize("world", [2, 4])
def test_oneshot_barriers_between_processes(world):
    """Ranks in processes (shared-memory buffers, each mapping every rank's): with the phase A
    / phase B barriers on, consecutive exchanges of fresh subtrees each give the combine's bits
    on every rank (a missing or misplaced barrier reads a stale or half-written subtree, or
    hangs: the join timeout fails the test); every program's epoch counts the calls."""
    m, n, rounds = 2 * world, 600, 2  # 1,200+ elements: 2 programs, each its own barriers
    words = oneshot._FLAG_WORDS + m * n
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, f"buf{r}") for r in range(world)]
        for f in files:
            torch.zeros(words, dtype=torch.int32).numpy().tofile(f)
        results = [os.path.join(tmp, f"out{r}.pt") for r in range(world)]
        procs = [
            ctx.Process(target=_rank_proc,
                        args=(r, world, files, words, m, n, rounds, results[r]))
            for r in range(world)
        ]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        alive = [p.is_alive() for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert not any(alive), "a rank hung at a barrier"
        assert all(p.exitcode == 0 for p in procs)
        for r in range(world):
            outs, epochs = torch.load(results[r])
            for i in range(rounds):
                want = tpm.combine(_subtrees(world, m, n, seed=100 + i))
                h = m // world
                assert torch.equal(outs[2 * i], want), f"rank {r} round {i}"
                assert torch.equal(outs[2 * i + 1], want[r * h : (r + 1) * h])
            # a program counts the calls that ran it: every call runs programs 0 .. p - 1
            progs = [-(-numel // oneshot._BLOCK) for numel in (m * n, m * n // world)]
            want_epochs = [sum(rounds for p in progs if b < p) for b in range(len(epochs))]
            assert epochs.tolist() == want_epochs


def test_oneshot_unavailable_says_why(monkeypatch):
    """Asking for the one-shot path where it cannot run raises with the reason (here: no
    CUDA), never a silent NCCL fallback; the configuration switch reads RL_ENGINE_TP_ONESHOT."""
    from rl_engine import config

    if not ON_GPU:
        assert "CUDA" in oneshot.unavailable_reason()
        with pytest.raises(RuntimeError, match="unavailable: no CUDA"):
            oneshot.OneShot.over(None)
    monkeypatch.setenv("RL_ENGINE_TP_ONESHOT", "1")
    config.reload()
    assert config.settings().tp_oneshot
    monkeypatch.delenv("RL_ENGINE_TP_ONESHOT")
    config.reload()
    assert not config.settings().tp_oneshot
