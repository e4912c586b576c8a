"""MoE ops (moe_router / moe_topk, moe_experts, moe_combine, grouped_poly_norm): numerics vs a
float64 evaluation of the same math, bitwise batch invariance, the tie rule, expert
parallelism (the EP shards' sum == all experts local), backward, and the error paths."""

from __future__ import annotations

import pytest
import torch

from rl_engine import KernelRegistry
from rl_engine.ops import (
    det_gemm,
    fused_mul_poly_norm,
    grouped_poly_norm,
    moe_combine,
    moe_experts,
    moe_router,
    moe_topk,
    silu_and_mul,
)
from rl_engine.ops.moe_experts import TokenDroppingError, refuse_token_dropping
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import backend_fixture

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

SCORINGS = [("softmax", True), ("softmax", False), ("topk_softmax", False)]
DTYPES = [torch.float32, torch.bfloat16]

# CPU tensors throughout: the Triton cases run here in the interpreter suite only; on a GPU the
# Triton providers are tested on the GPU by test_moe_experts_triton.py / test_moe_triton.py.
topk_backend = backend_fixture("moe_router", device="cpu")
experts_backend = backend_fixture("moe_experts", device="cpu")
combine_backend = backend_fixture("moe_combine", device="cpu")
gpn_backend = backend_fixture("grouped_poly_norm", device="cpu")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(e: int, h: int, i: int, dtype: torch.dtype, g: torch.Generator):
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    return w13, w2


# --------------------------------------------------------------------------------- moe_topk
def _topk64(logits: torch.Tensor, ids: torch.Tensor, scoring: str, renorm: bool):
    l64 = logits.double()
    if scoring == "softmax":
        w = torch.softmax(l64, -1).gather(1, ids)
        return w / w.sum(-1, keepdim=True) if renorm else w
    return torch.softmax(l64.gather(1, ids), -1)


@pytest.mark.parametrize("scoring,renorm", SCORINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_matches_float64(topk_backend, scoring, renorm, dtype):
    logits = torch.randn(67, 16, generator=_gen()).to(dtype)
    w, ids = moe_topk(logits, 4, scoring=scoring, renormalize=renorm, backend=topk_backend)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (67, 4)
    # the chosen experts are the top-4 (ties impossible on random data)
    ref_ids = torch.topk(logits.double(), 4, dim=-1).indices
    assert torch.equal(ids, ref_ids)
    assert_close(w, _topk64(logits, ids, scoring, renorm), rtol=1e-6, atol=1e-7, what="weights")


@pytest.mark.parametrize("scoring,renorm", SCORINGS)
def test_topk_row_invariant_and_backward(topk_backend, scoring, renorm):
    x = torch.randn(67, 16, generator=_gen(1)).to(torch.bfloat16)

    def fwd(t):
        w, ids = moe_topk(t, 4, scoring=scoring, renormalize=renorm, backend=topk_backend)
        return torch.cat([w, ids.float()], dim=1)

    check_row_invariance(fwd, x, counts=(1, 2, 17, 31, 33), what="moe_topk")
    gw = torch.randn(67, 4, generator=_gen(2))

    def dlogits(idx):
        xi = x[idx.long()].clone().requires_grad_(True)
        w, _ = moe_topk(xi, 4, scoring=scoring, renormalize=renorm, backend=topk_backend)
        w.backward(gw[idx.long()])
        return xi.grad

    check_row_invariance(dlogits, torch.arange(67.0), counts=(1, 17, 33), what="dlogits")
    # gradient vs float64 autograd of the same math
    xd = x.double().requires_grad_(True)
    ids = moe_topk(x, 4, scoring=scoring, renormalize=renorm, backend=topk_backend)[1]
    _topk64(xd, ids, scoring, renorm).backward(gw.double())
    got = dlogits(torch.arange(67.0))
    assert_close(got, xd.grad, rtol=2e-2, atol=2e-3, what="dlogits vs float64")  # bf16 out


def test_topk_tie_rule_lower_id_first(topk_backend):
    logits = torch.tensor([[0.5, 1.0, 1.0, 0.2, 1.0, 1.0]])
    _, ids = moe_topk(logits, 3, backend=topk_backend)
    assert ids.tolist() == [[1, 2, 4]]
    _, ids = moe_topk(logits, 3, scoring="topk_softmax", backend=topk_backend)
    assert ids.tolist() == [[1, 2, 4]]
    _, ids = moe_topk(torch.zeros(2, 8), 8, backend=topk_backend)
    assert ids.tolist() == [list(range(8))] * 2


def test_router_is_det_gemm_then_topk():
    g = _gen(3)
    hidden = torch.randn(9, 32, generator=g).to(torch.bfloat16)
    gate = torch.randn(8, 32, generator=g).to(torch.bfloat16)
    w, ids, logits = moe_router(hidden, gate, 2, renormalize=True)
    assert_bitwise(logits, det_gemm(hidden, gate.t()), "router logits")
    w2, ids2 = moe_topk(logits, 2, renormalize=True)
    assert_bitwise(w, w2, "router weights")
    assert_bitwise(ids, ids2, "router ids")


def test_router_reaches_gate_weight_gradient():
    g = _gen(4)
    hidden = torch.randn(9, 32, generator=g).requires_grad_(True)
    gate = torch.randn(8, 32, generator=g).requires_grad_(True)
    w, _, _ = moe_router(hidden, gate, 2)
    w.sum().backward()
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs,err",
    [
        ({"top_k": 0}, ValueError),
        ({"top_k": 9}, ValueError),
        ({"top_k": 2.0}, TypeError),
        ({"top_k": 2, "scoring": "sigmoid"}, ValueError),
        ({"top_k": 2, "scoring": "topk_softmax", "renormalize": True}, ValueError),
    ],
)
def test_topk_bad_input(kwargs, err):
    with pytest.raises(err, match="moe_router"):
        moe_topk(torch.randn(3, 8), **kwargs)


def test_topk_bad_logits():
    with pytest.raises(ValueError):
        moe_topk(torch.randn(3, 4, 8), 2)
    with pytest.raises(TypeError):
        moe_topk(torch.randint(0, 3, (3, 8)), 2)


# ------------------------------------------------------------------------------ moe_experts
def _alone(x_row, e, w13, w2, backend=None):
    """The expert MLP of one row through the dense ops (the contract's right-hand side)."""
    h = det_gemm(x_row, w13[e].t(), backend=backend)
    return det_gemm(silu_and_mul(h, backend=backend), w2[e].t(), backend=backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_rows_equal_the_expert_alone(experts_backend, dtype):
    if experts_backend != "native":
        pytest.skip("the native families' dense ops are the comparison here")
    g = _gen(5)
    t, k, e, h, i = 23, 3, 8, 48, 40
    x = torch.randn(t, h, generator=g).to(dtype)
    w13, w2 = _weights(e, h, i, dtype, g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    y = moe_experts(x, ids, w13, w2, backend=experts_backend)
    assert y.shape == (t, k, h) and y.dtype == dtype
    for tok in (0, 7, t - 1):
        for s in range(k):
            alone = _alone(x[tok : tok + 1], int(ids[tok, s]), w13, w2, backend="native")
            assert_bitwise(y[tok, s : s + 1], alone, f"token {tok} slot {s}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_match_float64(experts_backend, dtype):
    g = _gen(6)
    t, k, e, h, i = 17, 2, 4, 64, 48
    x = torch.randn(t, h, generator=g).to(dtype)
    w13, w2 = _weights(e, h, i, dtype, g)
    ids = torch.randint(0, e, (t, k), generator=g)
    y = moe_experts(x, ids, w13, w2, backend=experts_backend)
    x64, a64, b64 = x.double(), w13.double(), w2.double()
    hh = torch.einsum("th,tsnh->tsn", x64, a64[ids])
    act = torch.nn.functional.silu(hh[..., :i]) * hh[..., i:]
    ref = torch.einsum("tsi,tshi->tsh", act, b64[ids])
    rtol, atol = tolerance(dtype, k=h)
    # bf16: the intermediate activation is rounded to bf16 (as every engine's expert MLP does)
    if dtype == torch.bfloat16:
        rtol, atol = 2 * rtol, 2 * atol
    assert_close(y, ref, rtol=rtol, atol=atol, what="moe_experts vs float64")


def test_experts_invariant_to_batch_and_load(experts_backend):
    """A token's rows are the same whatever else is routed: subsets, all tokens on one expert,
    empty experts, zero padding rows."""
    g = _gen(7)
    t, k, e, h, i = 41, 2, 8, 32, 24
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w13, w2 = _weights(e, h, i, torch.bfloat16, g)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[:, 1] = (ids[:, 0] + 1) % e  # distinct experts per token

    def fwd(rows):
        idx = rows[:, 0].long()
        return moe_experts(x[idx], ids[idx], w13, w2, backend=experts_backend)

    check_row_invariance(fwd, torch.arange(t, dtype=torch.float32)[:, None], counts=(1, 2, 17, 33),
                         what="moe_experts")  # fmt: skip
    full = moe_experts(x, ids, w13, w2, backend=experts_backend)
    crowd = ids.clone()
    crowd[:, 0] = 3  # every token's first slot to expert 3: a much larger group
    crowd[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
    same = ids[:, 0] == 3
    y = moe_experts(x, crowd, w13, w2, backend=experts_backend)
    assert_bitwise(y[same, 0], full[same, 0], "slot rows of expert 3, crowded vs not")


def test_experts_expert_parallel_shards_sum_to_all_local(experts_backend):
    g = _gen(8)
    t, k, e, h, i = 19, 4, 8, 32, 24
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w13, w2 = _weights(e, h, i, torch.bfloat16, g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    full = moe_experts(x, ids, w13, w2, backend=experts_backend)
    for ep in (2, 4):
        per = e // ep
        shards = []
        for rank in range(ep):
            emap = torch.full((e,), -1, dtype=torch.int64)
            emap[rank * per : (rank + 1) * per] = torch.arange(per)
            ys = moe_experts(x, ids, w13[rank * per : (rank + 1) * per],
                             w2[rank * per : (rank + 1) * per], expert_map=emap,
                             backend=experts_backend)  # fmt: skip
            off = (ids < rank * per) | (ids >= (rank + 1) * per)
            assert torch.equal(ys[off], torch.zeros_like(ys[off])), "off-rank slots are +0"
            shards.append(ys)
        total = shards[0]
        for ys in shards[1:]:
            total = total + ys
        assert_bitwise(total, full, f"EP {ep}: sum of the shards == all experts local")
        rev = shards[-1]
        for ys in reversed(shards[:-1]):
            rev = rev + ys
        assert_bitwise(rev, full, f"EP {ep}: in any order")


def test_experts_backward_deterministic_and_close(experts_backend):
    g = _gen(9)
    t, k, e, h, i = 13, 2, 4, 32, 24
    x = torch.randn(t, h, generator=g)
    w13, w2 = _weights(e, h, i, torch.float32, g)
    ids = torch.randint(0, e, (t, k), generator=g)
    gy = torch.randn(t, k, h, generator=g)

    def grads():
        xs, a, b = (v.clone().requires_grad_(True) for v in (x, w13, w2))
        moe_experts(xs, ids, a, b, backend=experts_backend).backward(gy)
        return xs.grad, a.grad, b.grad

    first, second = grads(), grads()
    for n, p, q in zip(("dx", "dw13", "dw2"), first, second):
        assert_bitwise(p, q, f"{n} run-to-run")
    x64, a64, b64 = (v.double().requires_grad_(True) for v in (x, w13, w2))
    hh = torch.einsum("th,tsnh->tsn", x64, a64[ids])
    act = torch.nn.functional.silu(hh[..., :i]) * hh[..., i:]
    torch.einsum("tsi,tshi->tsh", act, b64[ids]).backward(gy.double())
    for n, p, q in zip(("dx", "dw13", "dw2"), first, (x64.grad, a64.grad, b64.grad)):
        assert_close(p, q, rtol=1e-4, atol=1e-4, what=n)

    # dx row invariance
    def dx(rows):
        idx = rows[:, 0].long()
        xs = x[idx].clone().requires_grad_(True)
        moe_experts(xs, ids[idx], w13, w2, backend=experts_backend).backward(gy[idx])
        return xs.grad

    check_row_invariance(dx, torch.arange(t, dtype=torch.float32)[:, None], counts=(1, 5),
                         what="moe_experts dx")  # fmt: skip


def test_experts_bad_input():
    x = torch.randn(4, 16)
    w13, w2 = torch.randn(4, 24, 16), torch.randn(4, 16, 12)
    ids = torch.randint(0, 4, (4, 2))
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\)"):
        moe_experts(x, ids + 4, w13, w2)
    with pytest.raises(ValueError, match="w13"):
        moe_experts(x, ids, w13[:, :, :8], w2)
    with pytest.raises(ValueError, match="w2"):
        moe_experts(x, ids, w13, w2[:, :, :5])
    with pytest.raises(TypeError, match="ids"):
        moe_experts(x, ids.float(), w13, w2)
    with pytest.raises(ValueError, match="expert_map"):
        moe_experts(x, ids, w13[:2], w2[:2], expert_map=torch.tensor([0, 1, 2, -1]))
    with pytest.raises(TokenDroppingError, match="whole batch"):
        refuse_token_dropping("moe_expert_capacity_factor", 1.25)
    refuse_token_dropping("moe_expert_capacity_factor", None)


# ------------------------------------------------------------------------------ moe_combine
def test_combine_slot_order_and_shared(combine_backend):
    g = _gen(10)
    t, k, h = 21, 4, 40
    y = torch.randn(t, k, h, generator=g).to(torch.bfloat16)
    w = torch.rand(t, k, generator=g)
    shared = torch.randn(t, h, generator=g).to(torch.bfloat16)
    gate = torch.randn(t, 1, generator=g).to(torch.bfloat16)
    out = moe_combine(y, w, shared=shared, shared_gate=gate, backend=combine_backend)
    ref = (w.double()[..., None] * y.double()).sum(1) + torch.sigmoid(
        gate.double()
    ) * shared.double()
    assert_close(out, ref, rtol=1e-2, atol=1e-2, what="combine vs float64")
    # the fp32 sum in slot order, one rounding, by hand
    if combine_backend == "native":
        from rl_engine.ops._math import sigmoid

        acc = torch.zeros(t, h)
        for s in range(k):
            acc = acc + w[:, s : s + 1] * y[:, s].float()
        acc = acc + sigmoid(gate) * shared.float()
        assert_bitwise(out, acc.to(torch.bfloat16), "slot-order fp32 sum")
    # the slot order matters (a control, in fp32 where one rounding cannot hide it: another
    # order of the same terms is another sum)
    y32 = torch.randn(t, k, h, generator=g)
    perm = torch.tensor([3, 1, 0, 2])
    out32 = moe_combine(y32, w, backend=combine_backend)
    out_perm = moe_combine(y32[:, perm], w[:, perm], backend=combine_backend)
    assert not torch.equal(out_perm, out32)


def test_combine_row_invariant_and_grads(combine_backend):
    g = _gen(11)
    t, k, h = 33, 2, 24
    y = torch.randn(t, k, h, generator=g)
    w = torch.rand(t, k, generator=g)
    shared = torch.randn(t, h, generator=g)
    gate = torch.randn(t, 1, generator=g)
    go = torch.randn(t, h, generator=g)

    def grads(idx):
        ts = [v[idx].clone().requires_grad_(True) for v in (y, w, shared, gate)]
        moe_combine(ts[0], ts[1], shared=ts[2], shared_gate=ts[3],
                    backend=combine_backend).backward(go[idx])  # fmt: skip
        return [v.grad for v in ts]

    full = grads(torch.arange(t))
    part = grads(torch.arange(5))
    for n, a, b in zip(("dy", "dw", "dshared", "dgate"), full, part):
        assert_bitwise(a[:5], b, f"{n} rows 0-4")
    ts = [v.double().requires_grad_(True) for v in (y, w, shared, gate)]
    ((ts[1][..., None] * ts[0]).sum(1) + torch.sigmoid(ts[3]) * ts[2]).backward(go.double())
    for n, a, b in zip(("dy", "dw", "dshared", "dgate"), full, ts):
        assert_close(a, b.grad, rtol=1e-5, atol=1e-5, what=n)


def test_combine_bad_input():
    y, w = torch.randn(3, 2, 8), torch.rand(3, 2)
    with pytest.raises(TypeError, match="float32"):
        moe_combine(y, w.double())
    with pytest.raises(ValueError, match="weights"):
        moe_combine(y, w[:, :1])
    with pytest.raises(ValueError, match="shared"):
        moe_combine(y, w, shared=torch.randn(3, 7))
    with pytest.raises(ValueError, match="without shared"):
        moe_combine(y, w, shared_gate=torch.randn(3, 1))


# ------------------------------------------------------------------------ grouped_poly_norm
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_poly_norm_rows_equal_fused_mul_poly_norm(gpn_backend, dtype):
    g = _gen(12)
    n, d, e = 29, 72, 4
    gate = torch.randn(n, d, generator=g).to(dtype)
    up = torch.randn(n, d, generator=g).to(dtype)
    w = torch.rand(e, 3, generator=g)
    b = torch.rand(e, 1, generator=g)
    ids = torch.sort(torch.randint(0, e, (n,), generator=g)).values
    out = grouped_poly_norm(gate, up, w, b, ids, backend=gpn_backend)
    backend = "native" if gpn_backend == "native" else gpn_backend
    for r in (0, 11, n - 1):
        ex = int(ids[r])
        alone = fused_mul_poly_norm(gate[r : r + 1], up[r : r + 1], w[ex], b[ex], backend=backend)
        assert_bitwise(out[r : r + 1], alone, f"row {r}")


def test_grouped_poly_norm_backward(gpn_backend):
    g = _gen(13)
    n, d, e = 21, 40, 3
    gate, up, go = (torch.randn(n, d, generator=g) for _ in range(3))
    w = torch.rand(e, 3, generator=g)
    b = torch.rand(e, 1, generator=g)
    ids = torch.randint(0, e, (n,), generator=g)

    def grads():
        ts = [v.clone().requires_grad_(True) for v in (gate, up, w, b)]
        grouped_poly_norm(*ts[:2], ts[2], ts[3], ids, backend=gpn_backend).backward(go)
        return [v.grad for v in ts]

    a, bb = grads(), grads()
    for name, p, q in zip(("dgate", "dup", "dweight", "dbias"), a, bb):
        assert_bitwise(p, q, f"{name} run-to-run")
    # vs per-expert fused_mul_poly_norm autograd (float64 math, same formula)
    for ex in range(e):
        rows = (ids == ex).nonzero().flatten()
        ts = [v.clone().requires_grad_(True) for v in (gate[rows], up[rows], w[ex], b[ex])]
        fused_mul_poly_norm(*ts, backend="native").backward(go[rows])
        assert_close(a[0][rows], ts[0].grad, rtol=1e-5, atol=1e-5, what="dgate")
        assert_close(a[2][ex], ts[2].grad, rtol=1e-4, atol=1e-4, what="dweight")
        assert_close(a[3][ex], ts[3].grad, rtol=1e-4, atol=1e-4, what="dbias")


def test_grouped_poly_norm_bad_input():
    gate = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"\[E, 3\]"):
        grouped_poly_norm(gate, gate, torch.rand(2, 2), torch.rand(2, 1), torch.zeros(4).long())
    with pytest.raises(ValueError, match="expert ids"):
        grouped_poly_norm(gate, gate, torch.rand(2, 3), torch.rand(2, 1), torch.full((4,), 2))
    with pytest.raises(ValueError, match="rows"):
        grouped_poly_norm(gate, gate, torch.rand(2, 3), torch.rand(2, 1), torch.zeros(3).long())
    with pytest.raises(ValueError, match="hidden size"):  # at the entry, with or without rows
        grouped_poly_norm(gate[:0, :0], gate[:0, :0], torch.rand(2, 3), torch.rand(2, 1),
                          torch.zeros(0).long())  # fmt: skip


def test_registry_lists_the_moe_ops():
    for op in ("moe_router", "moe_experts", "moe_combine", "grouped_poly_norm"):
        assert op in KernelRegistry.known_ops()
        resolved = KernelRegistry.get_op(op, device="cpu")
        assert resolved.provider.invariant
