"""Tensor-parallel experts (``moe_experts(..., groups=G)``, ``moe_experts_subtree``,
``rl_engine::moe_experts_tp``): every expert's intermediate dimension cut into ``t`` contiguous
shards (``w13`` rows ``[gate_r; up_r]``, ``w2`` columns ``r``), each rank's fp32 subtree of
``G / t`` groups, combined and rounded once == the grouped op on the whole weights, bitwise;
batch invariance; the backward is the plain form's; the exchange op over ``t`` simulated ranks;
the missing-provider error. The vLLM engine at TP 2 with TP-sharded experts is in
tests/adapters/test_vllm_moe_ep.py."""

from __future__ import annotations

import pytest
import torch

from rl_engine import KernelRegistry
from rl_engine.ops import det_gemm, moe_experts, silu_and_mul
from rl_engine.ops.det_gemm import tp as tpm
from rl_engine.ops.moe_experts import moe_experts_subtree
from rl_engine.ops.moe_experts import tp as etp
from rl_engine.registry import BackendUnavailableError
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from tests.ops.test_det_gemm_tp import _run_ranks

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

G = 8
DTYPES = [torch.float32, torch.bfloat16]


def _case(dtype, *, t=23, k=2, e=6, h=40, i=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[:, 1] = (ids[:, 0] + 1 + ids[:, 1] % (e - 1)) % e  # distinct experts per token
    return x, ids, w13, w2


def _shard(w13, w2, tp, r):
    """Rank ``r``'s shard of every expert at TP ``tp`` (vLLM's layout: ``[gate_r; up_r]``)."""
    i = w2.shape[-1]
    c = i // tp
    gate, up = w13[:, :i], w13[:, i:]
    w13_r = torch.cat([gate[:, r * c : (r + 1) * c], up[:, r * c : (r + 1) * c]], dim=1)
    return w13_r.contiguous(), w2[:, :, r * c : (r + 1) * c].contiguous()


@pytest.mark.parametrize("expert_map", [False, True], ids=["all-local", "expert-map"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_equal_the_grouped_op(tp, dtype, expert_map):
    x, ids, w13, w2 = _case(dtype)
    emap = None
    if expert_map:  # experts 1..4 local (an EP rank), the rest +0 rows
        emap = torch.full((w13.shape[0] + 2,), -1, dtype=torch.int64)
        emap[1:5] = torch.arange(4)
        ids = ids % emap.shape[0]
        w13, w2 = w13[:4].contiguous(), w2[:4].contiguous()
    full = moe_experts(x, ids, w13, w2, expert_map=emap, groups=G)
    assert full.dtype == dtype and full.shape == (*ids.shape, x.shape[1])
    subs = []
    for r in range(tp):
        w13_r, w2_r = _shard(w13, w2, tp, r)
        sub = moe_experts_subtree(x, ids, w13_r, w2_r, G // tp, expert_map=emap)
        assert sub.dtype == torch.float32 and sub.shape == full.shape
        subs.append(sub)
    assert_bitwise(tpm.finish(tpm.combine(subs), None, dtype), full, f"TP {tp} shards")
    if expert_map:
        off = emap[ids] < 0
        assert off.any() and (full[off] == 0).all() and not torch.signbit(full[off]).any()


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_activation_is_the_columns_of_the_whole(tp):
    """Column invariance on the MoE path: a rank's gate/up product and activation are its
    columns of the one-device ones (native det_gemm / silu_and_mul), for every expert."""
    x, _, w13, w2 = _case(torch.bfloat16)
    i = w2.shape[-1]
    c = i // tp
    for e in range(w13.shape[0]):
        whole = silu_and_mul(det_gemm(x, w13[e].t()))
        for r in range(tp):
            w13_r, _ = _shard(w13, w2, tp, r)
            part = silu_and_mul(det_gemm(x, w13_r[e].t()))
            assert_bitwise(part, whole[:, r * c : (r + 1) * c], f"expert {e} rank {r}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_differs_from_plain(dtype):
    """The control: the grouped down product is another reduction order than the plain
    ``det_gemm`` (so the tests above can tell the two forms apart)."""
    # (bf16 rounding hides most differences: 2 of 5120 elements differ on this case)
    x, ids, w13, w2 = _case(dtype, t=64, i=512, seed=1)
    plain = moe_experts(x, ids, w13, w2)
    grouped = moe_experts(x, ids, w13, w2, groups=G)
    assert not torch.equal(plain, grouped)
    assert torch.equal(plain, moe_experts(x, ids, w13, w2, groups=None))


def test_grouped_rows_batch_invariant():
    x, ids, w13, w2 = _case(torch.bfloat16, t=41, seed=7)

    def fwd(rows):
        idx = rows[:, 0].long()
        return moe_experts(x[idx], ids[idx], w13, w2, groups=G)

    check_row_invariance(fwd, torch.arange(41, dtype=torch.float32)[:, None],
                         counts=(1, 2, 17, 33), what="moe_experts groups=8")  # fmt: skip
    # a rank's subtree rows too (what the exchange combines)
    w13_r, w2_r = _shard(w13, w2, 2, 1)
    whole = moe_experts_subtree(x, ids, w13_r, w2_r, G // 2)
    assert_bitwise(moe_experts_subtree(x[5:6], ids[5:6], w13_r, w2_r, G // 2), whole[5:6], "row")


def test_grouped_backward_is_the_plain_rule():
    x, ids, w13, w2 = _case(torch.bfloat16, seed=2)
    grad = torch.randn(*ids.shape, x.shape[1], generator=torch.Generator().manual_seed(9))
    grads = []
    for groups in (None, G):
        xs, a, b = (t.clone().requires_grad_() for t in (x, w13, w2))
        moe_experts(xs, ids, a, b, groups=groups).backward(grad.to(x.dtype))
        grads.append((xs.grad, a.grad, b.grad))
    for name, p, q in zip(("dx", "dw13", "dw2"), *grads):
        assert_bitwise(q, p, f"{name}: groups=8 vs plain")


def test_grouped_op_opcheck():
    x, ids, w13, w2 = _case(torch.float32, t=5, e=3, h=8, i=16)
    prov = etp.resolve("cpu")
    torch.library.opcheck(
        torch.ops.rl_engine.moe_experts_grouped.default, (x, ids, w13, w2, None, G, prov),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip
    torch.library.opcheck(
        torch.ops.rl_engine.moe_experts_subtree.default, (x, ids, w13, w2, G, None, prov),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


@pytest.mark.parametrize("tp", [2, 4])
def test_exchange_op_equals_the_grouped_op(tp):
    """``rl_engine::moe_experts_tp`` on ``t`` simulated ranks (threads), each with its shard and
    its exchange registered by name: every rank gets the one-device grouped rows."""
    x, ids, w13, w2 = _case(torch.bfloat16, t=7)  # 14 slot rows: column blocks at TP 4
    want = moe_experts(x, ids, w13, w2, groups=G)

    def rank(r, ex):
        name = f"test-moe-tp:{tp}:{r}"
        tpm.register_exchange(name, ex)
        try:
            w13_r, w2_r = _shard(w13, w2, tp, r)
            return etp.moe_experts_tp(x, ids, w13_r, w2_r, G // tp, name)
        finally:
            tpm._EXCHANGES.pop(name, None)

    for r, got in enumerate(_run_ranks(tp, rank)):
        assert_bitwise(got, want, f"rank {r}")


def test_families_tell_grouped_from_plain():
    fam = etp.family("cpu", "native")
    assert fam == "moe_experts_tp/g8[moe_experts/native]"
    op = KernelRegistry.get_op("moe_experts_tp", device="cpu", backend="native")
    assert op.numerics == fam != KernelRegistry.get_op("moe_experts", device="cpu").numerics
    x, ids, w13, w2 = _case(torch.float32, t=4)
    assert torch.equal(op(x, ids, w13, w2), moe_experts(x, ids, w13, w2, groups=G))
    moe_experts(x, ids, w13, w2, groups=G)
    recorded = {r["op"]: r["numerics"] for r in KernelRegistry.report()}
    assert recorded["moe_experts_tp"] == fam


def test_missing_subtree_extra_raises(monkeypatch):
    """A provider without the ``"subtree"`` extra: a clear error naming it, never the plain
    form or another provider."""
    (prov,) = [p for p in KernelRegistry.providers("moe_experts") if p.name == "native"]
    monkeypatch.delitem(prov.extras, "subtree")
    x, ids, w13, w2 = _case(torch.float32, t=4)
    msg = "moe_experts provider 'native' has no 'subtree' extra"
    with pytest.raises(BackendUnavailableError, match=msg):
        moe_experts(x, ids, w13, w2, groups=G, backend="native")
    with pytest.raises(BackendUnavailableError, match=msg):
        moe_experts_subtree(x, ids, w13, w2, G, backend="native")
    with pytest.raises(BackendUnavailableError, match=msg):
        etp.moe_experts_tp(x, ids, w13, w2, G, "unused", backend="native")
    with pytest.raises(BackendUnavailableError, match=msg):
        KernelRegistry.get_op("moe_experts_tp", device="cpu", backend="native")
    moe_experts(x, ids, w13, w2, backend="native")  # the plain form needs no subtree


@pytest.mark.parametrize(
    "groups,err,msg",
    [(3, ValueError, "power of two"), (0, ValueError, "power of two"),
     (128, ValueError, "does not split into 128"), (2.0, TypeError, "must be an int")],
)  # fmt: skip
def test_bad_groups(groups, err, msg):
    x, ids, w13, w2 = _case(torch.float32, t=4)
    with pytest.raises(err, match=msg):
        moe_experts(x, ids, w13, w2, groups=groups)
    with pytest.raises(err, match=msg):
        moe_experts_subtree(x, ids, w13, w2, groups)
