"""Triton provider of moe_experts (grouped GEMMs): every slot's row bitwise the det_gemm /
silu_and_mul Triton providers of that row alone, batch / subset invariance, routing corner cases,
expert parallelism (+0 rows), the backward, the reference within tolerance.

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``; fp32 / fp16, small
shapes) and skip otherwise (the alignment tests are plain torch and always run); on a CUDA
device they run on the GPU (bf16 / fp16 / fp32) with the GPU-only checks: Qwen3-30B-A3B shapes,
every tile config, CUDA graphs replayed with other routings.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine import KernelRegistry, config
from rl_engine.ops.det_gemm import triton as gemm_triton
from rl_engine.ops.moe_experts import moe_experts, reference
from rl_engine.ops.moe_experts import triton as mt
from rl_engine.ops.silu_and_mul import triton as act_triton
from rl_engine.testing.invariance import assert_bitwise
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import DEVICE, ON_GPU, TRITON_DTYPES, gpu, skip_unless_triton

needs_triton = skip_unless_triton(mt)
E, K, H, FFN = 8, 2, 64, 48  # experts, top-k, hidden, expert FFN (interpreter-sized)


def _weights(dtype, e=E, h=H, i=FFN, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(device=DEVICE, dtype=dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(device=DEVICE, dtype=dtype)
    return w13, w2


def _inputs(t, dtype, e=E, k=K, h=H, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(device=DEVICE, dtype=dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else None
    if ids is None:
        ids = torch.zeros((0, k), dtype=torch.int64)
    return x, ids.to(DEVICE)


def _case(t, dtype):
    """``(x, ids, w13, w2)``: ``t`` token rows with their expert ids and the default weights."""
    return (*_inputs(t, dtype), *_weights(dtype))


def _alone(x_row, e, w13, w2):
    """The expert MLP of one row alone through the det_gemm / silu_and_mul Triton providers."""
    hh = gemm_triton.det_gemm(x_row[None], w13[e].t())
    return gemm_triton.det_gemm(act_triton.silu_and_mul(hh), w2[e].t())[0]


def _check_rows_alone(x, ids, w13, w2, y, rows=None):
    """``y[t, s]`` == the expert MLP of row ``t`` alone (det_gemm with M = 1) for the listed
    ``(t, s)``, every slot when ``rows`` is None."""
    t, k = ids.shape
    pairs = [(i, s) for i in range(t) for s in range(k)] if rows is None else rows
    for i, s in pairs:
        e = int(ids[i, s])
        assert_bitwise(y[i, s], _alone(x[i], e, w13, w2), f"row {i} slot {s} (expert {e}) alone")


def _check_rows_per_expert(x, ids, w13, w2, y):
    """Every slot's row == the det_gemm / silu_and_mul providers of its expert's rows taken
    together (det_gemm is row invariant: its own suite proves a row alone == in any batch)."""
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel():
            hh = gemm_triton.det_gemm(x[tok], w13[e].t())
            want = gemm_triton.det_gemm(act_triton.silu_and_mul(hh), w2[e].t())
            assert_bitwise(y[tok, slot], want, f"expert {e}'s rows")


# ----------------------------------------------------------------------- alignment (plain torch)
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("t", [0, 1, 7, 33, 200])
def test_align_layout(t, block_m):
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(0, 10, (t, 3), generator=g)
    emap = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, -1, 6])
    n_local = 7
    slots, block_expert, row_start, counts = mt.align_torch(ids, n_local, block_m, emap)
    s = t * 3
    nb = mt.max_blocks(s, n_local, block_m)
    assert slots.shape == (nb * block_m,) and block_expert.shape == (nb,)
    local = emap[ids.reshape(-1)]
    local = torch.where(local < 0, n_local, local)
    assert counts.tolist() == torch.bincount(local, minlength=n_local + 1).tolist()
    real = slots[slots < s]
    assert sorted(real.tolist()) == list(range(s))  # every slot exactly once
    for e in range(n_local + 1):
        st, c = int(row_start[e]), int(counts[e])
        assert st % block_m == 0
        run = slots[st : st + c]
        assert torch.equal(run, torch.nonzero(local == e).flatten().to(run.dtype))  # slot order
        assert bool((slots[st + c : st + c + (-c) % block_m] == s).all())  # padding
        for b in range(st // block_m, (st + c + block_m - 1) // block_m):
            assert int(block_expert[b]) == e
    used = int((row_start[-1] + counts[-1] + block_m - 1) // block_m)
    assert bool((block_expert[used:] == n_local + 1).all())


@needs_triton
@pytest.mark.parametrize(
    "t, k, e, block_m, mapped", [(1, 8, 128, 16, False), (7, 2, 8, 16, True), (33, 2, 8, 64, True),
                                 (200, 3, 7, 16, True), (64, 8, 128, 16, False),
                                 (300, 8, 128, 64, True), (2048, 8, 128, 128, False)]
)  # fmt: skip
def test_align_kernel_equals_torch(t, k, e, block_m, mapped):
    g = torch.Generator().manual_seed(t)
    n_global = e + 3 if mapped else e
    ids = torch.randint(0, n_global, (t, k), generator=g).to(DEVICE)
    emap = None
    if mapped:
        emap = torch.full((n_global,), -1)
        emap[torch.randperm(n_global, generator=g)[:e]] = torch.arange(e)
        emap = emap.to(DEVICE)
    want = mt.align_torch(ids, e, block_m, emap)
    got = mt.align_triton(ids, e, block_m, emap)
    for a, b, n in zip(got, want, ("slots", "block_expert", "row_start", "counts"), strict=True):
        assert_bitwise(a, b.to(a.dtype), f"align {n}")


def test_max_blocks_is_a_bound():
    # worst case: every bucket one slot (each a whole block)
    for s, e, bm in ((8, 8, 16), (9, 8, 16), (1, 128, 64), (300, 4, 16)):
        ids = torch.arange(s).reshape(s, 1) % (e + 1)
        emap = torch.cat([torch.arange(e), torch.tensor([-1])])
        slots, block_expert, *_ = mt.align_torch(ids, e, bm, emap)
        assert int((block_expert <= e).sum()) <= mt.max_blocks(s, e, bm)


# ------------------------------------------------------------------------------ forward bits
@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("t", [1, 7, 33])
def test_rows_equal_det_gemm_alone(t, dtype):
    x, ids, w13, w2 = _case(t, dtype)
    y = mt.moe_experts(x, ids, w13, w2)
    assert y.shape == (t, K, H) and y.dtype == dtype
    _check_rows_per_expert(x, ids, w13, w2, y)
    _check_rows_alone(x, ids, w13, w2, y, [(0, 0), (t - 1, K - 1)])  # M = 1 det_gemm


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_batch_subset_and_config_invariance(dtype):
    x, ids, w13, w2 = _case(33, dtype)
    full = mt.moe_experts(x, ids, w13, w2)
    for m in (1, 5, 17):
        assert_bitwise(mt.moe_experts(x[:m], ids[:m], w13, w2), full[:m], f"first {m} rows")
    perm = torch.randperm(33, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert_bitwise(mt.moe_experts(x[perm], ids[perm], w13, w2), full[perm], "permuted batch")
    for cfg in mt.all_configs(dtype):
        got = mt.moe_experts_with_config(x, ids, w13, w2, None, cfg)
        assert_bitwise(got, full, f"config {cfg}")
    assert_bitwise(mt.moe_experts(x, ids, w13, w2), full, "run to run")


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_empty_experts_and_all_to_one(dtype):
    x, _, w13, w2 = _case(9, dtype)
    one = torch.full((9, K), 5, dtype=torch.int64, device=DEVICE)  # all slots to expert 5
    y = mt.moe_experts(x, one, w13, w2)
    _check_rows_per_expert(x, one, w13, w2, y)
    two = torch.tensor([[2, 6]] * 9, device=DEVICE)  # six experts empty
    y2 = mt.moe_experts(x, two, w13, w2)
    _check_rows_per_expert(x, two, w13, w2, y2)
    assert_bitwise(mt.moe_experts(x, two[:, :1], w13, w2)[:, 0], y2[:, 0], "top-1 of the same")
    empty = mt.moe_experts(x[:0], two[:0], w13, w2)
    assert empty.shape == (0, K, H)


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_expert_map_zero_rows(dtype):
    x, ids, w13, w2 = _case(33, dtype)
    emap = torch.tensor([0, 1, -1, 2, 3, -1, 4, 5], device=DEVICE)
    keep = [0, 1, 3, 4, 6, 7]
    y = mt.moe_experts(x, ids, w13[keep], w2[keep], emap)
    full = mt.moe_experts(x, ids, w13, w2)
    local = emap[ids] >= 0
    assert_bitwise(y[local], full[local], "local slots == all experts local")
    off = y[~local]
    assert off.numel() and bool((off == 0).all()) and not bool(torch.signbit(off).any()), "+0 rows"
    # EP 2: the two ranks' outputs sum to the EP 1 output exactly
    emap_b = torch.tensor([-1, -1, 0, -1, -1, 1, -1, -1], device=DEVICE)
    yb = mt.moe_experts(x, ids, w13[[2, 5]], w2[[2, 5]], emap_b)
    assert_bitwise(y + yb, full, "EP 2 sum == EP 1")


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_forward_vs_reference(dtype):
    x, ids, w13, w2 = _case(33, dtype)
    got = mt.moe_experts(x, ids, w13, w2)
    want = reference.moe_experts(x, ids, w13, w2)  # the native family, same roundings
    rtol, atol = tolerance(dtype, k=max(H, FFN))
    assert_close(got, want, rtol=rtol, atol=atol, what="moe_experts vs reference")


# ------------------------------------------------------------------------------------ backward
def _backward_composed(dy, x, ids, w13, w2):
    """The reference's backward with the Triton det_gemm / silu_and_mul functions."""
    kern = reference.Kernels(
        lambda a, b, bias: gemm_triton.det_gemm(a, b, bias),
        gemm_triton.det_gemm_wgrad,
        act_triton.silu_and_mul,
        act_triton.silu_and_mul_backward,
    )
    return reference.experts_backward(dy, x, ids, w13, w2, None, kern)


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_backward_bits(dtype):
    x, ids, w13, w2 = _case(17, dtype)
    ids[:5] = torch.tensor([3, 1], device=DEVICE)
    dy = torch.randn(17, K, H, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    dx, dw13, dw2 = mt.moe_experts_backward(dy, x, ids, w13, w2)
    rdx, rdw13, rdw2 = _backward_composed(dy, x, ids, w13, w2)
    assert_bitwise(dx, rdx, "dx == det_gemm / silu_and_mul composition")
    assert_bitwise(dw13, rdw13, "dw13 == det_gemm_wgrad per expert")
    assert_bitwise(dw2, rdw2, "dw2 == det_gemm_wgrad per expert")
    dx5, *_ = mt.moe_experts_backward(dy[:5], x[:5], ids[:5], w13, w2)
    assert_bitwise(dx5, dx[:5], "dx row invariant")
    if ON_GPU:  # (the interpreter is deterministic by construction)
        again = mt.moe_experts_backward(dy, x, ids, w13, w2)
        for a, b, n in zip(again, (dx, dw13, dw2), ("dx", "dw13", "dw2"), strict=True):
            assert_bitwise(a, b, f"{n} run to run")
    # zero-padding rows (x and dy zero) leave the weight gradients unchanged
    pad_ids = torch.tensor([[3, 0]] * 4, device=DEVICE)
    xp = torch.cat([x, x.new_zeros(4, H)])
    dyp = torch.cat([dy, dy.new_zeros(4, K, H)])
    _, pw13, pw2 = mt.moe_experts_backward(dyp, xp, torch.cat([ids, pad_ids]), w13, w2)
    assert_bitwise(pw13, dw13, "dw13 with zero rows")
    assert_bitwise(pw2, dw2, "dw2 with zero rows")


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_backward_expert_map_and_reference(dtype):
    x, ids, w13, w2 = _case(17, dtype)
    dy = torch.randn(17, K, H, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    emap = torch.tensor([0, 1, -1, 2, 3, -1, 4, 5], device=DEVICE)
    keep = [0, 1, 3, 4, 6, 7]
    dx, dw13, dw2 = mt.moe_experts_backward(dy, x, ids, w13, w2)
    _, mdw13, mdw2 = mt.moe_experts_backward(dy, x, ids, w13[keep], w2[keep], emap)
    assert_bitwise(mdw13, dw13[keep], "dw13 of the local experts")
    assert_bitwise(mdw2, dw2[keep], "dw2 of the local experts")
    want = reference.moe_experts_backward(dy, x, ids, w13, w2)  # native family
    rtol, atol = tolerance(dtype, grad=True, k=max(H, 2 * FFN))
    for got, ref, n in zip((dx, dw13, dw2), want, ("dx", "dw13", "dw2"), strict=True):
        assert_close(got, ref, rtol=rtol, atol=atol, what=f"{n} vs reference")


# ------------------------------------------------------------------------- registry / public op
@needs_triton
def test_public_op_and_autograd(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        config.reload()
    dtype = torch.float32
    op = KernelRegistry.get_op("moe_experts", device=DEVICE, backend="triton")
    assert op.provider.name == "triton" and op.numerics.startswith("moe_experts/triton")
    x, ids, w13, w2 = _case(3, dtype)
    x.requires_grad_(True)
    w13.requires_grad_(True)
    w2.requires_grad_(True)
    y = moe_experts(x, ids, w13, w2, backend="triton")
    assert_bitwise(y.detach(), mt.moe_experts(x.detach(), ids, w13.detach(), w2.detach()), "op")
    dy = torch.randn_like(y)
    y.backward(dy)
    want = mt.moe_experts_backward(dy, x.detach(), ids, w13.detach(), w2.detach())
    for got, ref, n in zip((x.grad, w13.grad, w2.grad), want, ("dx", "dw13", "dw2"), strict=True):
        assert_bitwise(got, ref, f"autograd {n}")


def test_errors():
    w13, w2 = _weights(torch.float32)
    x, ids = _inputs(3, torch.float32)
    with pytest.raises(TypeError):
        mt.moe_experts(x.to(torch.int32), ids, w13, w2)
    with pytest.raises(ValueError):
        mt.moe_experts(x, ids, w13, w2[:, :, :5])
    with pytest.raises(ValueError):
        mt.moe_experts(x[:2], ids, w13, w2)


# -------------------------------------------------------------------------------- GPU only
QWEN3_MOE = dict(e=128, k=8, h=2048, i=768)  # Qwen3-30B-A3B experts


@gpu
@pytest.mark.parametrize("t", [1, 32, 129, 1000, 4096])
def test_gpu_qwen3_shapes_rows_alone(t):
    dtype = torch.bfloat16
    c = QWEN3_MOE
    w13, w2 = _weights(dtype, e=c["e"], h=c["h"], i=c["i"])
    x, ids = _inputs(t, dtype, e=c["e"], k=c["k"], h=c["h"])
    y = mt.moe_experts(x, ids, w13, w2)
    g = torch.Generator().manual_seed(t)
    rows = [(int(torch.randint(t, (1,), generator=g)), int(torch.randint(c["k"], (1,), generator=g)))
            for _ in range(24)]  # fmt: skip
    _check_rows_alone(x, ids, w13, w2, y, rows)
    for cfg in mt.all_configs(dtype):
        assert_bitwise(mt.moe_experts_with_config(x, ids, w13, w2, None, cfg), y, f"cfg {cfg}")
    # every expert's rows batched through det_gemm (det_gemm's own M-bucketed configs)
    _check_rows_per_expert(x, ids, w13, w2, y)


@gpu
@pytest.mark.parametrize("t", [1, 17, 130, 400])
def test_gpu_rows_alone_every_bucket(t):
    for dtype in (torch.bfloat16, torch.float16):
        x, ids, w13, w2 = _case(t, dtype)
        y = mt.moe_experts(x, ids, w13, w2)
        _check_rows_alone(x, ids, w13, w2, y, [(i, s) for i in range(min(t, 20)) for s in range(K)])
        _check_rows_per_expert(x, ids, w13, w2, y)
        dy = torch.randn_like(y)
        dx, dw13, dw2 = mt.moe_experts_backward(dy, x, ids, w13, w2)
        rdx, rdw13, rdw2 = _backward_composed(dy, x, ids, w13, w2)
        for got, ref, n in zip((dx, dw13, dw2), (rdx, rdw13, rdw2), ("dx", "dw13", "dw2")):
            assert_bitwise(got, ref, f"{dtype} T={t} {n} == composition")


def graph_replays(fn, c, dtype, t=64):
    """``fn(x, ids, expert_map)`` on ``t`` tokens of the expert shapes ``c`` captured in a CUDA
    graph (after two warm-up calls on a side stream), then replayed with three other token sets,
    routings (the last: every token to the same k experts) and expert maps (every third expert
    off the rank); yields ``(seed, out, x, ids, expert_map)`` after each replay (the inputs as
    copies, for the eager call)."""
    x, ids = _inputs(t, dtype, e=c["e"], k=c["k"], h=c["h"])
    emap = torch.arange(c["e"], device=DEVICE)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(x, ids, emap)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, ids, emap)
    for seed in range(3):
        x2, ids2 = _inputs(t, dtype, e=c["e"], k=c["k"], h=c["h"], seed=100 + seed)
        if seed == 2:
            ids2[:] = ids2[:1]  # every token to the same k experts
        x.copy_(x2)
        ids.copy_(ids2)
        emap.copy_(torch.where(torch.arange(c["e"]) % 3 == seed, -1, torch.arange(c["e"])))
        graph.replay()
        torch.cuda.synchronize()
        yield seed, out, x2, ids2, emap.clone()


@gpu
def test_gpu_cuda_graph_replay_other_routing():
    dtype = torch.bfloat16
    c = QWEN3_MOE
    w13, w2 = _weights(dtype, e=c["e"], h=c["h"], i=c["i"])

    def run(x, ids, emap):
        return mt.moe_experts(x, ids, w13, w2, emap)

    for seed, y, x2, ids2, emap in graph_replays(run, c, dtype):
        assert_bitwise(y, run(x2, ids2, emap), f"graph replay {seed} vs eager")


@gpu
@pytest.mark.parametrize("t", [1, 9, 44, 256])
def test_gpu_expert_parallel_model_shapes(t):
    """EP 4 of a Qwen3-MoE-shaped layer (64 experts, 16 a rank, vLLM's int32 ``expert_map``):
    each rank's local slots == the EP 1 rows, its other slots +0, the four ranks' outputs sum to
    the EP 1 output exactly."""
    dtype = torch.bfloat16
    e, k, h, i = 64, 8, 2048, 768
    w13, w2 = _weights(dtype, e=e, h=h, i=i)
    x, ids = _inputs(t, dtype, e=e, k=k, h=h)
    full = mt.moe_experts(x, ids, w13, w2)
    total = torch.zeros_like(full)
    for rank in range(4):
        local = torch.arange(rank * 16, (rank + 1) * 16, device=DEVICE)
        emap = torch.full((e,), -1, dtype=torch.int32, device=DEVICE)
        emap[local] = torch.arange(16, dtype=torch.int32, device=DEVICE)
        y = mt.moe_experts(x, ids, w13[local], w2[local], emap)
        mine = emap[ids] >= 0
        assert_bitwise(y[mine], full[mine], f"rank {rank}: local slots == EP 1")
        assert bool((y[~mine] == 0).all()) and not bool(torch.signbit(y[~mine]).any())
        total = total + y
    assert_bitwise(total, full, "EP 4 sum == EP 1")
