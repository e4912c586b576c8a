"""Triton provider of grouped_poly_norm: every row bitwise the poly_norm Triton provider's
fused_mul_poly_norm with its expert's weights (forward, dgate, dup), every expert's dweight /
dbias bitwise that provider's backward over the expert's rows in row order (exact zeros for an
expert without rows), batch invariance, the reference within tolerance, autograd through the
public op, the error paths.

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``; fp32 / fp16, small
shapes) and skip otherwise; on a CUDA device they run on the GPU (bf16 too), with a
model-sized case.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine import KernelRegistry
from rl_engine.ops import grouped_poly_norm
from rl_engine.ops.grouped_poly_norm import triton as gt
from rl_engine.ops.poly_norm import reference as pn_ref
from rl_engine.ops.poly_norm import triton as pt
from rl_engine.testing.invariance import assert_bitwise
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import DEVICE, TRITON_DTYPES, gpu, skip_unless_triton

pytestmark = skip_unless_triton(gt)
EPS = 1e-6
# 8 rows over 4 experts, interleaved, expert 2 without rows (interpreter-sized)
IDS = [3, 0, 1, 3, 0, 3, 3, 0]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(n, d, e, dtype, seed=0, ids=None):
    """gate, up, grad [n, d] in ``dtype``; weight [e, 3] / bias [e, 1] fp32 of mixed signs;
    expert ids (``IDS`` when n matches, else random)."""
    g = _gen(seed)
    gate, up, go = ((1.5 * torch.randn(n, d, generator=g)).to(DEVICE, dtype) for _ in range(3))
    w = (torch.randn(e, 3, generator=g) * 0.7).to(DEVICE)
    b = (torch.randn(e, 1, generator=g) * 0.1).to(DEVICE)
    if ids is None:
        ids = IDS if n == len(IDS) else torch.randint(0, e, (n,), generator=g).tolist()
    return gate, up, go, w, b, torch.tensor(ids, device=DEVICE)


def _run(gate, up, go, w, b, ids):
    """The Triton provider's forward and backward: ``(y, dgate, dup, dweight, dbias)``."""
    y = gt.grouped_poly_norm(gate, up, w, b, ids, EPS)
    return (y, *gt.grouped_poly_norm_backward(go, gate, up, w, b, ids, EPS))


def _per_expert_poly_norm(gate, up, go, w, b, ids):
    """The same five results assembled from the poly_norm Triton provider run on each expert's
    rows alone (in row order): what the contract says the grouped op equals bitwise."""
    prov = KernelRegistry.provider("poly_norm", "triton")
    fused, backward = prov.extras["fused_mul"], prov.extras["backward"]
    y, dg, du = torch.empty_like(gate), torch.empty_like(gate), torch.empty_like(up)
    dws, dbs = [], []
    for e in range(w.shape[0]):
        rows = (ids == e).nonzero().flatten()
        if rows.numel():
            y[rows] = fused(gate[rows], up[rows], w[e], b[e], EPS)
        dx, dm, dw, db = backward(go[rows], gate[rows], w[e], b[e], EPS, up[rows])
        dg[rows], du[rows] = dx, dm
        dws.append(dw)
        dbs.append(db)
    return y, dg, du, torch.stack(dws), torch.stack(dbs)


NAMES = ("y", "dgate", "dup", "dweight", "dbias")


def test_triton_provider_family_and_order():
    prov = KernelRegistry.provider("grouped_poly_norm", "triton")
    poly = KernelRegistry.provider("poly_norm", "triton")
    assert prov.invariant and prov.numerics == "grouped_poly_norm/triton-b256"
    # the family is poly_norm's Triton family per expert: same suffix, version follows it
    assert prov.numerics.split("/")[1] == poly.numerics.split("/")[1]
    assert prov.version == f"1.{poly.version}"
    assert [p.name for p in KernelRegistry.providers("grouped_poly_norm")][0] == "triton"


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("n,d,e", [(8, 40, 4), (5, 300, 3)])
def test_triton_rows_are_poly_norm_triton_bitwise(n, d, e, dtype):
    """D = 40: one masked block; D = 300: a whole block and a masked tail. Expert 2 of the
    first case has no rows; its gradients are exact zeros."""
    if n == 5 and dtype != TRITON_DTYPES[0] and DEVICE == "cpu":
        pytest.skip("interpreter time: fp32 covers D = 300")
    args = _inputs(n, d, e, dtype, seed=n + d)
    got = _run(*args)
    want = _per_expert_poly_norm(*args)
    for a, c, name in zip(got, want, NAMES, strict=True):
        assert_bitwise(a, c, f"{name} ({n}, {d}, {e}) {dtype} vs poly_norm triton per expert")
    ids = args[-1]
    for ex in range(e):
        if not bool((ids == ex).any()):
            zero = torch.zeros(4, device=DEVICE)
            dwb = torch.cat([got[3][ex], got[4][ex]])
            assert_bitwise(dwb, zero, f"expert {ex} without rows")
            assert not bool(dwb.signbit().any()), f"expert {ex} without rows: -0.0"


def test_triton_row_alone_and_permuted_rows_bitwise():
    """A row's output and input gradients are the same alone, in the batch, and wherever a
    permutation of the batch puts it."""
    gate, up, go, w, b, ids = _inputs(8, 40, 4, TRITON_DTYPES[-1], seed=5)
    full = _run(gate, up, go, w, b, ids)
    perm = torch.randperm(8, generator=_gen(6)).to(DEVICE)
    permuted = _run(gate[perm], up[perm], go[perm], w, b, ids[perm])
    for i, name in enumerate(NAMES[:3]):
        assert_bitwise(permuted[i], full[i][perm], f"{name}: rows permuted")
    for r in (0, 7):
        alone = _run(gate[r : r + 1], up[r : r + 1], go[r : r + 1], w, b, ids[r : r + 1])
        for i, name in enumerate(NAMES[:3]):
            assert_bitwise(alone[i], full[i][r : r + 1], f"{name}: row {r} alone")


def test_triton_strided_inputs():
    """gate / up as the two halves of one fused gate_up output (row stride 2D), the weights a
    transposed view, the ids a strided view: the bits of contiguous copies."""
    dtype = TRITON_DTYPES[-1]
    gate, up, go, w, b, ids = _inputs(8, 40, 4, dtype, seed=13)
    gate_up = torch.cat([gate, up], dim=1)
    w_t = w.t().contiguous().t()  # [E, 3] with strides (1, E)
    ids2 = torch.stack([ids, ids], dim=1)[:, 0]  # stride 2
    assert w_t.stride() == (1, 4) and ids2.stride() == (2,)
    got = _run(gate_up[:, :40], gate_up[:, 40:], go, w_t, b, ids2)
    for a, c, name in zip(got, _run(gate, up, go, w, b, ids), NAMES, strict=True):
        assert_bitwise(a, c, f"{name}: strided inputs")


def test_triton_param_grads_depend_on_each_experts_rows_in_row_order():
    """dweight / dbias: run to run; the same when the experts' rows are interleaved otherwise
    (grouped by expert, as a grouped GEMM emits them) but each expert keeps its rows' order; the
    same with zero-gradient rows appended (a padded batch); changed when an expert's rows are
    reordered (the order is part of the numerics, so this check can fail)."""
    gate, up, go, w, b, ids = _inputs(8, 40, 4, torch.float32, seed=7)

    def bwd(rows, ids_=None):
        ids_ = ids[rows] if ids_ is None else ids_
        return gt.grouped_poly_norm_backward(go[rows], gate[rows], up[rows], w, b, ids_, EPS)

    first = bwd(torch.arange(8, device=DEVICE))
    for a, c, name in zip(bwd(torch.arange(8, device=DEVICE)), first, NAMES[1:], strict=True):
        assert_bitwise(a, c, f"{name}: run to run")
    regrouped = bwd(torch.sort(ids, stable=True).indices)
    assert_bitwise(regrouped[2], first[2], "dweight: rows grouped by expert")
    assert_bitwise(regrouped[3], first[3], "dbias: rows grouped by expert")
    pad = torch.tensor([0, 3, 2, 0, 0], device=DEVICE)  # to the experts with rows and without
    gp = torch.randn(5, 40, generator=_gen(8)).to(DEVICE)
    padded = gt.grouped_poly_norm_backward(
        torch.cat([go, torch.zeros_like(gp)]), torch.cat([gate, gp]), torch.cat([up, gp]),
        w, b, torch.cat([ids, pad]), EPS,
    )  # fmt: skip
    assert_bitwise(padded[2], first[2], "dweight: zero-gradient rows appended")
    assert_bitwise(padded[3], first[3], "dbias: zero-gradient rows appended")
    # expert 3's first two rows swapped (not a rotation or a reversal: those are symmetries of
    # the halving tree): its sums change, the other experts' do not
    rows3 = (ids == 3).nonzero().flatten()
    order = torch.arange(8, device=DEVICE)
    order[rows3[0]], order[rows3[1]] = rows3[1], rows3[0]
    swapped = bwd(order, ids)
    assert_bitwise(swapped[2][:3], first[2][:3], "dweight of the other experts")
    assert_bitwise(swapped[3][:3], first[3][:3], "dbias of the other experts")
    assert not torch.equal(torch.cat([swapped[2][3], swapped[3][3]]),
                           torch.cat([first[2][3], first[3][3]])), "expert 3 reordered: same bits"  # fmt: skip


@pytest.mark.parametrize("counts", [[0, 1, 2, 3, 2048, 2049, 4100, 0], [5], [0, 0]])
def test_triton_expert_sums_are_poly_norm_row_sums(counts):
    """The per-expert sum program is poly_norm's row sum (bitwise ``reference.sum_rows``) of
    each expert's range of partials, below and above its step sizes (2048 rows in registers,
    levels in memory beyond); empty ranges are exact zeros."""
    offs = torch.tensor([0] + counts).cumsum(0)
    m = int(offs[-1])
    part = torch.randn(m, 4, generator=_gen(m)) * torch.logspace(-4, 4, max(m, 1))[:m, None]
    out = gt.sum_experts(part.to(DEVICE), offs.to(DEVICE)).cpu()
    for e, c in enumerate(counts):
        rows = part[int(offs[e]) : int(offs[e + 1])]
        assert_bitwise(out[e], pn_ref.sum_rows(rows), f"expert {e} of {c} rows")
        assert_bitwise(out[e], pt.sum_rows(rows.to(DEVICE)).cpu(), f"expert {e}: poly_norm's")
        if c > 3:  # the check can fail: another order of the same rows gives other bits
            shuffled = rows[torch.randperm(c, generator=_gen(c))]
            assert not torch.equal(out[e], pn_ref.sum_rows(shuffled)), f"expert {e}"


def test_triton_no_rows_and_one_expert_for_all():
    gate, up, go, w, b, _ = _inputs(0, 40, 3, torch.float32)
    y, dg, du, dw, db = _run(gate, up, go, w, b, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert y.shape == (0, 40) and dg.shape == (0, 40) and du.shape == (0, 40)
    assert_bitwise(torch.cat([dw, db], 1), torch.zeros(3, 4, device=DEVICE), "no rows: zeros")
    args = _inputs(3, 40, 3, torch.float32, seed=9, ids=[1] * 3)  # int64 ids, one expert
    got = _run(*args)
    for a, c, name in zip(got, _per_expert_poly_norm(*args), NAMES, strict=True):
        assert_bitwise(a, c, f"{name}: every row on expert 1")
    args = (*args[:-1], args[-1].to(torch.int32))  # int32 ids: the same bits
    for a, c, name in zip(_run(*args), got, NAMES, strict=True):
        assert_bitwise(a, c, f"{name}: int32 ids")


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_vs_reference_within_tolerance(dtype):
    """Against the ``native`` provider (the reference, another family: low bits differ) within
    the tolerance table; the comparison fails with another expert's weights per row."""
    gate, up, go, w, b, ids = _inputs(8, 40, 4, dtype, seed=10)
    got = _run(gate, up, go, w, b, ids)
    want = (
        grouped_poly_norm(gate, up, w, b, ids, EPS, backend="native"),
        *KernelRegistry.provider("grouped_poly_norm", "native").extras["backward"](
            go, gate, up, w, b, ids, EPS
        ),
    )
    rtol, atol = tolerance(dtype)
    assert_close(got[0], want[0], rtol=rtol, atol=atol, what=f"y {dtype}")
    rg, ag = tolerance(dtype, grad=True)
    for a, c, name in zip(got[1:], want[1:], NAMES[1:], strict=True):
        scale = max(1.0, float(c.abs().max()))  # dweight / dbias: sums over an expert's rows
        assert_close(a, c, rtol=rg, atol=ag * scale, what=f"{name} {dtype}")
    other = grouped_poly_norm(gate, up, w, b, (ids + 1) % 4, EPS, backend="native")
    with pytest.raises(AssertionError):
        assert_close(got[0], other, rtol=rtol, atol=atol, what="other experts' weights")


def test_triton_autograd_through_public_op():
    """``grouped_poly_norm(..., backend="triton")`` under torch.autograd: the provider's
    backward (the parameter gradients cast to the parameters' dtypes), bitwise."""
    dtype = TRITON_DTYPES[-1]
    gate, up, go, w, b, ids = _inputs(8, 40, 4, dtype, seed=11)
    w16, b16 = w.to(dtype), b.to(dtype)
    leaves = [t.clone().requires_grad_(True) for t in (gate, up, w16, b16)]
    y = grouped_poly_norm(leaves[0], leaves[1], leaves[2], leaves[3], ids, EPS, backend="triton")
    grads = torch.autograd.grad(y, leaves, go)
    want = _run(gate, up, go, w16, b16, ids)
    assert_bitwise(y.detach(), want[0], "y")
    for got, c, name in zip(grads, want[1:], NAMES[1:], strict=True):
        assert_bitwise(got, c.to(got.dtype), f"{name} through autograd")
    assert KernelRegistry.get_op("grouped_poly_norm", device=DEVICE, backend="triton")(
        gate, up, w16, b16, ids, EPS
    ).equal(want[0])


def test_triton_expert_id_out_of_range_gives_nan_rows():
    """The provider itself (the public entry refuses these on the CPU; on the GPU it does not
    check, to avoid a synchronisation): such a row reads no parameter memory and comes out NaN;
    the other rows and every expert's parameter gradients are untouched."""
    gate, up, go, w, b, ids = _inputs(8, 40, 4, torch.float32, seed=12)
    bad = ids.clone()
    bad[2], bad[4] = -1, 4
    got = _run(gate, up, go, w, b, bad)
    ok = (bad >= 0) & (bad < 4)
    keep = ok.nonzero().flatten()
    rest = _run(gate[keep], up[keep], go[keep], w, b, ids[keep])  # the other rows alone
    for i, name in enumerate(NAMES[:3]):
        assert bool(got[i][~ok].isnan().all()), f"{name}: rows of bad ids"
        assert_bitwise(got[i][ok], rest[i], f"{name}: the other rows")
    assert_bitwise(got[3], rest[3], "dweight without the bad rows")
    assert_bitwise(got[4], rest[4], "dbias without the bad rows")


_G = torch.ones(4, 8)
_W, _B, _IDS = torch.ones(2, 3), torch.zeros(2, 1), torch.tensor([0, 1, 1, 0])


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((_G, _G, torch.ones(2, 2), _B, _IDS), ValueError, r"\[E, 3\]"),
        ((_G, _G, _W, torch.zeros(2, 2), _IDS), ValueError, r"\[E, 1\]"),
        ((_G, _G, _W, torch.zeros(3, 1), _IDS), ValueError, r"\[E, 1\]"),
        ((_G, torch.ones(4, 9), _W, _B, _IDS), ValueError, "must match gate"),
        ((_G, _G.half(), _W, _B, _IDS), ValueError, "must match gate"),
        ((_G[0], _G[0], _W, _B, _IDS), ValueError, "2 dims"),
        ((_G, _G, _W, _B, _IDS[:3]), ValueError, "rows"),
        ((_G, _G, _W, _B, _IDS.float()), TypeError, "int32 / int64"),
        ((_G, _G, _W, _B, torch.tensor([0, 2, 1, 0])), ValueError, "expert ids"),
        ((_G, _G, _W, _B, torch.tensor([0, -1, 1, 0])), ValueError, "expert ids"),
        ((_G[:, :0], _G[:, :0], _W, _B, _IDS), ValueError, "hidden size"),
        ((_G.int(), _G.int(), _W, _B, _IDS), TypeError, "gate"),
    ],
)
def test_triton_bad_inputs_refused(args, exc, match):
    """Refused by the public entry's checks before the Triton provider runs."""
    if match == "expert ids" and DEVICE != "cpu":
        pytest.skip("id values are checked on the CPU (on the GPU: NaN rows, tested above)")
    with pytest.raises(exc, match=match):
        grouped_poly_norm(*(a.to(DEVICE) for a in args), backend="triton")


@gpu
@pytest.mark.parametrize("n,d,e", [(1000, 768, 8), (300, 4160, 64)])
def test_triton_cuda_model_shapes(n, d, e):
    """On the GPU in bf16 at model-like widths (768: whole blocks only; 4160: 16 whole blocks
    and a masked tail), 8 / 64 experts, the last two without rows: the contract of the interpreter
    tests, bitwise, and the reference within tolerance."""
    ids = torch.randint(0, e - 2, (n,), generator=_gen(n)).tolist()  # the last two: no rows
    args = _inputs(n, d, e, torch.bfloat16, seed=d, ids=ids)
    got = _run(*args)
    for a, c, name in zip(got, _per_expert_poly_norm(*args), NAMES, strict=True):
        assert_bitwise(a, c, f"{name} ({n}, {d}, {e}) vs poly_norm triton per expert")
    want = grouped_poly_norm(*args[:2], *args[3:], EPS, backend="native")
    rtol, atol = tolerance(torch.bfloat16)
    assert_close(got[0], want, rtol=rtol, atol=atol, what="y vs native")
