"""ratio_kl: numerics vs float64 (forward, gradients), row / padding invariance, errors."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine.ops import ratio_kl
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import FP32_OUT, assert_close, tolerance
from tests.conftest import backend_fixture

DTYPES = [torch.float32, torch.bfloat16]
_DIFF = ("log_ratio", "ratio", "k1", "k2", "k3", "seq_log_ratio", "seq_ratio")
_OPTS = dict(token_is_cap=1.5, seq_is_cap=3.0, token_mis=(0.4, 2.5), seq_mis=(0.2, 4.0))


# CPU tensors only: the Triton provider runs on a GPU in the test_*triton*.py files
backend = backend_fixture("ratio_kl", device="cpu")


def _data(b, t, dtype, *, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(b, t, generator=g) * 0.5 - 1.5).to(dtype)
    off = torch.randn(b, 1, generator=g) * 0.1
    old = (lp.float() + off + torch.randn(b, t, generator=g) * scale).to(dtype)
    mask = torch.rand(b, t, generator=g) > 0.25
    return lp, old, mask


def _ref64(
    lp,
    old,
    mask,
    *,
    clamp=20.0,
    token_is_cap=None,
    seq_is_cap=None,
    token_mis=None,
    seq_mis=None,
    seq_mode="sum",
):
    """The formulas of docs/operators/ratio_kl.md in float64 with torch autograd."""
    keep = mask.bool()
    raw = torch.where(keep, lp - old, torch.zeros_like(lp))
    lr = raw.clamp(-clamp, clamp)
    r = torch.exp(lr)
    tlo, thi = token_mis or (0.0, math.inf)
    slo, shi = seq_mis or (0.0, math.inf)
    tkeep = keep & (r >= tlo) & (r <= thi)
    tw = torch.where(tkeep, r.clamp(max=token_is_cap or math.inf), torch.zeros_like(r))
    s = lr.sum(-1)
    if seq_mode == "mean":
        s = s / keep.double().sum(-1).clamp(min=1)
    slr = s.clamp(-clamp, clamp)
    sr = torch.exp(slr)
    skeep = (sr >= slo) & (sr <= shi)
    sw = torch.where(skeep, sr.clamp(max=seq_is_cap or math.inf), torch.zeros_like(sr))
    return dict(
        log_ratio=lr,
        ratio=r,
        k1=-lr,
        k2=0.5 * lr * lr,
        k3=torch.expm1(lr) - lr,
        token_weight=tw.detach(),
        token_keep=tkeep,
        seq_log_ratio=slr,
        seq_ratio=sr,
        seq_weight=sw.detach(),
        seq_keep=skeep,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (17, 31), (33, 199), (0, 5), (3, 0)])
@pytest.mark.parametrize("seq_mode", ["sum", "mean"])
def test_forward_vs_float64(backend, dtype, shape, seq_mode):
    lp, old, mask = _data(*shape, dtype)
    out = ratio_kl(lp, old, mask, seq_mode=seq_mode, backend=backend, **_OPTS)
    ref = _ref64(lp.double(), old.double(), mask, seq_mode=seq_mode, **_OPTS)
    rtol, atol = FP32_OUT  # inputs are exact in fp32; only fp32 math rounds
    for name, r in ref.items():
        o = getattr(out, name)
        assert o.shape == r.shape, name
        if r.dtype == torch.bool:
            assert o.dtype == torch.bool and torch.equal(o, r), name
        else:
            assert o.dtype == torch.float32, name
            assert_close(o, r, rtol=rtol, atol=atol, what=f"{name} {shape} {dtype}")


def test_options_are_exercised_and_neutral_defaults(backend):
    lp, old, mask = _data(33, 40, torch.float32, scale=0.8)
    out = ratio_kl(lp, old, mask, backend=backend, **_OPTS)
    real = mask
    assert (out.token_weight[real] == 1.5).any(), "token cap never hit"
    assert (~out.token_keep[real]).any() and out.token_keep[real].any(), "token MIS inactive"
    assert (~out.seq_keep).any() and out.seq_keep.any(), "sequence MIS inactive"
    plain = ratio_kl(lp, old, mask, backend=backend)
    # no cap / no MIS: the weight is the ratio on real tokens and 0 on padding
    zero = torch.zeros(())
    assert_bitwise(plain.token_weight, torch.where(mask, plain.ratio, zero), "neutral weight")
    assert_bitwise(plain.token_keep, mask, "neutral keep")
    assert_bitwise(plain.seq_weight, plain.seq_ratio, "neutral seq weight")
    # masked tokens: log_ratio 0, ratio 1, k 0
    assert (plain.log_ratio[~mask] == 0).all() and (plain.ratio[~mask] == 1).all()
    assert (plain.k3[~mask] == 0).all()
    # no mask == all-ones mask
    full = ratio_kl(lp, old, None, backend=backend)
    assert_bitwise(full.seq_log_ratio, ratio_kl(lp, old, torch.ones_like(mask)).seq_log_ratio, "")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_mode", ["sum", "mean"])
def test_gradients_vs_float64(backend, dtype, seq_mode):
    lp, old, mask = _data(17, 31, dtype, scale=0.6)
    clamp = 0.9  # some tokens and sequences beyond the clamp: the gradient stops there
    g = torch.Generator().manual_seed(5)
    grads = {n: torch.randn(17, 31 if n[:3] != "seq" else 1, generator=g) for n in _DIFF}
    grads = {n: (v[:, 0] if n.startswith("seq") else v) for n, v in grads.items()}
    x, y = lp.clone().requires_grad_(True), old.clone().requires_grad_(True)
    out = ratio_kl(x, y, mask, log_ratio_clamp=clamp, seq_mode=seq_mode, backend=backend)
    outs = [getattr(out, n) for n in _DIFF]
    dx, dy = torch.autograd.grad(outs, (x, y), [grads[n] for n in _DIFF])
    assert dx.dtype == dtype and dy.dtype == dtype
    x64, y64 = lp.double().requires_grad_(True), old.double().requires_grad_(True)
    ref = _ref64(x64, y64, mask, clamp=clamp, seq_mode=seq_mode)
    rdx, rdy = torch.autograd.grad(
        [ref[n] for n in _DIFF], (x64, y64), [grads[n].double() for n in _DIFF]
    )
    # fp32 math, then one rounding to the input dtype (the forward table's row for it)
    rtol, atol = FP32_OUT if dtype == torch.float32 else tolerance(dtype)
    assert_close(dx, rdx, rtol=rtol, atol=atol, what=f"d logp {dtype}")
    assert_close(dy, rdy, rtol=rtol, atol=atol, what=f"d old_logp {dtype}")
    assert (rdx == 0).any() and (rdx != 0).any(), "clamp range not exercised"


def _pack(lp, old, mask):
    return torch.stack([lp.float(), old.float(), mask.float()], dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward(backend, dtype):
    lp, old, mask = _data(300, 37, dtype)

    def f(x):
        out = ratio_kl(x[:, 0].to(dtype), x[:, 1].to(dtype), x[:, 2], backend=backend, **_OPTS)
        return torch.cat([o.float().reshape(x.shape[0], -1) for o in out], dim=1)

    check_row_invariance(f, _pack(lp, old, mask), what=f"ratio_kl fwd {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_grad(backend, dtype):
    lp, old, mask = _data(199, 37, dtype)

    def f(x):
        a = x[:, 0].to(dtype).requires_grad_(True)
        out = ratio_kl(a, x[:, 1].to(dtype), x[:, 2], seq_mode="mean", backend=backend)
        (out.k3 * 0.5 + out.ratio).sum().backward(inputs=[a])  # grads of ones: row-local
        out2 = ratio_kl(a, x[:, 1].to(dtype), x[:, 2], seq_mode="mean", backend=backend)
        (gs,) = torch.autograd.grad(out2.seq_ratio, a, torch.ones(x.shape[0]))
        return torch.cat([a.grad, gs], dim=1)

    check_row_invariance(f, _pack(lp, old, mask), counts=(1, 17, 31, 33, 199), what="d logp")


class RatioKLFields:
    SEQ = ("seq_log_ratio", "seq_ratio", "seq_weight", "seq_keep")
    TOKEN = ("log_ratio", "ratio", "k1", "k2", "k3", "token_weight", "token_keep")


@pytest.mark.parametrize("seq_mode", ["sum", "mean"])
def test_right_padding_invariance(backend, seq_mode):
    """Masked tokens appended to the rows (any values, NaN included) change nothing."""
    lp, old, mask = _data(9, 21, torch.float32)
    base = ratio_kl(lp, old, mask, seq_mode=seq_mode, backend=backend, **_OPTS)
    for extra in (1, 11, 43):
        nan = torch.full((9, extra), math.nan)
        out = ratio_kl(
            torch.cat([lp, nan], 1),
            torch.cat([old, nan], 1),
            torch.cat([mask, torch.zeros(9, extra, dtype=torch.bool)], 1),
            seq_mode=seq_mode,
            backend=backend,
            **_OPTS,
        )
        for name in RatioKLFields.SEQ:
            assert_bitwise(getattr(out, name), getattr(base, name), f"{name} +{extra} tokens")
        for name in RatioKLFields.TOKEN:
            assert_bitwise(getattr(out, name)[:, :21], getattr(base, name), f"{name} +{extra}")
            assert torch.isfinite(getattr(out, name).float()).all()


def test_masked_nan_inputs_give_zero_grad(backend):
    lp, old, mask = _data(4, 9, torch.float32)
    lp = torch.where(mask, lp, torch.full_like(lp, math.nan)).requires_grad_(True)
    out = ratio_kl(lp, old, mask, backend=backend)
    (out.k3.sum() + out.seq_ratio.sum()).backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()


def test_run_to_run_and_compile(backend):
    lp, old, mask = _data(31, 17, torch.float32)
    a = ratio_kl(lp, old, mask, backend=backend, **_OPTS)
    b = ratio_kl(lp, old, mask, backend=backend, **_OPTS)
    for x, y, n in zip(a, b, a._fields):
        assert_bitwise(x, y, f"{n} run-to-run")
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(
        lambda x, y, m: ratio_kl(x, y, m, backend=backend, **_OPTS).k3,
        fullgraph=True,
        backend="eager",
    )
    assert_bitwise(f(lp, old, mask), a.k3, "compile vs eager")


def test_opcheck():
    lp, old, mask = _data(5, 7, torch.float32)
    opts = (20.0, 2.0, math.inf, 0.1, 10.0, 0.0, math.inf, False, "native")
    x = lp.clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.rl_engine.ratio_kl.default, (x, old, mask, *opts))
    torch.library.opcheck(torch.ops.rl_engine.ratio_kl.default, (x, old, None, *opts))
    gs = [torch.randn(5, 7) for _ in range(5)] + [torch.randn(5) for _ in range(2)]
    torch.library.opcheck(
        torch.ops.rl_engine.ratio_kl_backward.default,
        (*gs, lp, old, mask, 20.0, True, "native"),
    )


_LP = torch.randn(3, 4)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((_LP, torch.randn(3, 5)), {}, ValueError, "shape"),
        ((_LP, _LP, torch.ones(3, 5, dtype=torch.bool)), {}, ValueError, "mask has shape"),
        ((_LP.double(), _LP.double()), {}, TypeError, "not supported"),
        ((_LP, _LP.double()), {}, TypeError, "not supported"),
        ((_LP[0], _LP[0]), {}, ValueError, "dims"),
        ((_LP, torch.randn(3, 4, device="meta")), {}, ValueError, "device"),
        ((_LP, [[0.0]]), {}, TypeError, "Tensor"),
        ((_LP, _LP), {"log_ratio_clamp": 0.0}, ValueError, "log_ratio_clamp"),
        ((_LP, _LP), {"log_ratio_clamp": math.inf}, ValueError, "log_ratio_clamp"),
        ((_LP, _LP), {"token_is_cap": 0.0}, ValueError, "token_is_cap"),
        ((_LP, _LP), {"seq_is_cap": -1.0}, ValueError, "seq_is_cap"),
        ((_LP, _LP), {"token_mis": (2.0, 1.0)}, ValueError, "token_mis"),
        ((_LP, _LP), {"seq_mis": (-1.0, 1.0)}, ValueError, "seq_mis"),
        ((_LP, _LP), {"seq_mis": 2.0}, ValueError, "seq_mis"),
        ((_LP, _LP), {"seq_mode": "geo"}, ValueError, "seq_mode"),
    ],
)
def test_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ratio_kl(*args, backend="native", **kwargs)


def test_unknown_backend():
    from rl_engine import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="names no provider"):
        ratio_kl(_LP, _LP, backend="nope")


def test_numeric_mask_must_be_zero_or_one():
    lp, old = torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.ones(2, 5)
    ref = ratio_kl(lp, old, mask.bool())
    got = ratio_kl(lp, old, mask)  # 0 / 1 numbers: the same as the bool mask
    assert_bitwise(got.log_ratio, ref.log_ratio, "0/1 float mask")
    mask[1, 2] = 2.0  # e.g. two masks added up: refused, not read as "real"
    with pytest.raises(ValueError, match="0 or 1.*2.0"):
        ratio_kl(lp, old, mask)
