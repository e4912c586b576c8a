"""rope: numerics vs float64 (NeoX, GPT-J, partial rotary, linear / llama3 scaling), row
invariance (fwd + dX), inverse-rotation backward, errors, opcheck."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import rope, rope_qk
from rl_engine.ops.rope.reference import canonical_scaling, inv_freq_table
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import backend_fixture

DTYPES = [torch.float32, torch.bfloat16]
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# CPU tensors only: the Triton provider runs on a GPU in the test_*triton*.py files
backend = backend_fixture("rope", device="cpu")


def _inv_freq64(theta: float, rd: int, scaling: dict | None = None) -> torch.Tensor:
    """Independent float64 formula (vectorised, as Hugging Face writes it)."""
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    if scaling is None or scaling.get("rope_type", scaling.get("type")) == "default":
        return inv
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        return inv / scaling["factor"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > orig / low, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = (wavelen >= orig / high) & (wavelen <= orig / low)
    return torch.where(medium, smoothed, inv_l)


def _ref64(x, pos, theta=10000.0, rd=None, is_neox=True, scaling=None) -> torch.Tensor:
    rd = rd or x.shape[-1]
    ang = pos.double()[:, None] * _inv_freq64(theta, rd, scaling)[None, :]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x64 = x.double()
    xr, xp = x64[..., :rd], x64[..., rd:]
    if is_neox:  # Hugging Face: q * cos + rotate_half(q) * sin
        cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        rot = torch.cat([-xr[..., rd // 2 :], xr[..., : rd // 2]], -1)
        out = xr * cos2 + rot * sin2
    else:  # GPT-J: pairs (2i, 2i + 1)
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([out, xp], -1)


CASES = [  # (T, heads, head_dim, rotary_dim, is_neox, theta, scaling)
    (1, 1, 64, None, True, 10000.0, None),
    (33, 4, 128, None, True, 500000.0, LLAMA3),
    (17, 2, 64, 32, True, 10000.0, None),  # partial rotary (NeoX)
    (31, 3, 80, 20, False, 10000.0, None),  # partial rotary (GPT-J)
    (33, 2, 64, None, False, 10000.0, {"type": "linear", "factor": 4.0}),
    (0, 2, 64, None, True, 10000.0, None),
]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_numerics_vs_float64(backend, dtype, case):
    t, h, d, rd, neox, theta, scaling = case
    x = torch.randn(t, h, d, dtype=dtype)
    pos = torch.randint(0, 32768, (t,))
    y = rope(x, pos, theta, rd, neox, scaling, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    rtol, atol = tolerance(dtype)
    ref = _ref64(x, pos, theta, rd, neox, scaling)
    assert_close(y, ref, rtol=rtol, atol=atol, what=f"rope {case} {dtype}")
    if rd is not None:
        assert_bitwise(y[..., rd:], x[..., rd:], "pass-through channels")


def test_llama3_table_vs_float64_formula():
    table = torch.tensor(
        inv_freq_table(
            500000.0, 128, canonical_scaling(LLAMA3, theta=500000.0, head_dim=128, rotary_dim=128)
        ),
        dtype=torch.float64,
    )
    ref = _inv_freq64(500000.0, 128, LLAMA3)
    torch.testing.assert_close(table, ref, rtol=1e-14, atol=0)
    plain = _inv_freq64(500000.0, 128)
    n_kept = int((table == plain).sum())
    n_div = int(torch.isclose(table, plain / 8, rtol=1e-14, atol=0).sum())
    assert 0 < n_kept and 0 < n_div and n_kept + n_div < 64, "all three llama3 regimes covered"


def test_scaling_dict_forms(backend):
    x, pos = torch.randn(5, 2, 16), torch.arange(5)
    base = rope(x, pos, backend=backend)
    for s in ({"rope_type": "default"}, {"type": "default", "rope_theta": 10000.0}):
        assert_bitwise(rope(x, pos, scaling=s, backend=backend), base, f"scaling {s}")
    lin = rope(x, pos, scaling={"rope_type": "linear", "factor": 2.0}, backend=backend)
    assert_bitwise(rope(x, pos, scaling={"type": "linear", "factor": 2}, backend=backend), lin, "")
    part = {"rope_type": "default", "partial_rotary_factor": 0.5}
    assert_bitwise(
        rope(x, pos, rotary_dim=8, scaling=part, backend=backend),
        rope(x, pos, rotary_dim=8, backend=backend),
        "partial_rotary_factor",
    )


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_numerics_and_determinism(backend, dtype, neox):
    x = torch.randn(45, 3, 64, dtype=dtype, requires_grad=True)
    pos = torch.randint(0, 8192, (45,))
    g = torch.randn(45, 3, 64, dtype=dtype)

    def grad():
        x.grad = None
        rope(x, pos, 10000.0, 48, neox, LLAMA3, backend=backend).backward(g)
        return x.grad.clone()

    gx = grad()
    assert_bitwise(gx, grad(), "dx run-to-run")
    x64 = x.detach().double().requires_grad_(True)
    _ref64(x64, pos, 10000.0, 48, neox, LLAMA3).backward(g.double())
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(gx, x64.grad, rtol=rtol, atol=atol, what="dx")
    assert_bitwise(gx[..., 48:], g[..., 48:], "pass-through gradient")


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward_and_dx(backend, dtype, neox, partial):
    n, rd = 300, (32 if partial else None)
    x = torch.randn(n, 4, 64, dtype=dtype)
    gy = torch.randn(n, 4, 64, dtype=dtype)
    pos = torch.randint(0, 131072, (n,))

    # rows are addressed by index so that x, positions and the gradient are sliced together
    def fwd(idx):
        i = idx.long()
        return rope(x[i], pos[i], 500000.0, rd, neox, LLAMA3, backend=backend)

    def dx(idx):
        i = idx.long()
        xi = x[i].clone().requires_grad_(True)
        rope(xi, pos[i], 500000.0, rd, neox, LLAMA3, backend=backend).backward(gy[i])
        return xi.grad

    idx = torch.arange(float(n))
    check_row_invariance(fwd, idx, what=f"rope fwd neox={neox} partial={partial}")
    counts = (1, 17, 31, 33, 64, 65, 128, 129, 199, 300)
    check_row_invariance(dx, idx, counts=counts, what=f"rope dX neox={neox} partial={partial}")


def test_head_and_position_dtype_invariance(backend):
    x, pos = torch.randn(37, 8, 64), torch.randint(0, 4096, (37,))
    full = rope(x, pos, backend=backend)
    assert_bitwise(rope(x[:, 2:5], pos, backend=backend), full[:, 2:5], "heads 2:5 alone")
    assert_bitwise(rope(x, pos.to(torch.int32), backend=backend), full, "int32 positions")
    perm = torch.randperm(37)
    assert_bitwise(rope(x[perm], pos[perm], backend=backend), full[perm], "permuted tokens")


def test_inverse_rotation_roundtrip(backend):
    x = torch.randn(20, 2, 32, dtype=torch.float64).float()
    pos = torch.randint(0, 4096, (20,))
    xr = x.clone().requires_grad_(True)
    y = rope(xr, pos, backend=backend)
    (back,) = torch.autograd.grad(y, xr, y)  # backward applies the inverse rotation
    assert_close(back, x, rtol=1e-5, atol=1e-5, what="inverse(rope(x)) == x")


def test_strided_input(backend):
    qkv = torch.randn(19, 3 * 4 * 32)  # a fused QKV output; q is a strided view
    q = qkv[:, : 4 * 32].view(19, 4, 32)
    k = qkv[:, 4 * 32 : 8 * 32].view(19, 4, 32)
    pos = torch.arange(19)
    for t, n in ((q, "q"), (k, "k")):
        assert_bitwise(rope(t, pos, backend=backend), rope(t.contiguous(), pos), f"strided {n}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox,rd,scaling", [(True, 32, None), (False, 16, LLAMA3)])
def test_rope_qk_is_rope_of_each(backend, dtype, neox, rd, scaling):
    """The fused q/k op: bitwise ``rope`` of each tensor, forward and dX, on the strided views
    of a fused QKV output (how vLLM hands them over) and on contiguous tensors."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(23, (6 + 2 + 2) * 32, generator=g).to(dtype)
    views = (qkv[:, : 6 * 32].view(23, 6, 32), qkv[:, 6 * 32 : 8 * 32].view(23, 2, 32))
    pos = torch.randint(0, 9000, (23,), generator=g)
    kw = dict(theta=500000.0, rotary_dim=rd, is_neox=neox, scaling=scaling, backend=backend)
    for q, k in (views, (views[0].contiguous(), views[1].contiguous())):
        yq, yk = rope_qk(q, k, pos, **kw)
        assert_bitwise(yq, rope(q, pos, **kw), "rope_qk q")
        assert_bitwise(yk, rope(k, pos, **kw), "rope_qk k")
    q = views[0].detach().clone().requires_grad_(True)
    k = views[1].detach().clone().requires_grad_(True)
    gq = torch.randn(q.shape, generator=g).to(dtype)
    gk = torch.randn(k.shape, generator=g).to(dtype)
    torch.autograd.backward(rope_qk(q, k, pos, **kw), (gq, gk))
    q1 = views[0].detach().clone().requires_grad_(True)
    k1 = views[1].detach().clone().requires_grad_(True)
    torch.autograd.backward((rope(q1, pos, **kw), rope(k1, pos, **kw)), (gq, gk))
    assert_bitwise(q.grad, q1.grad, "rope_qk dq")
    assert_bitwise(k.grad, k1.grad, "rope_qk dk")


def test_rope_qk_errors():
    pos = torch.arange(4)
    with pytest.raises(ValueError, match="does not go with q"):
        rope_qk(torch.randn(4, 2, 16), torch.randn(3, 2, 16), torch.arange(4))
    with pytest.raises(ValueError, match="does not go with q"):
        rope_qk(torch.randn(4, 2, 16), torch.randn(4, 2, 8), pos)
    with pytest.raises(ValueError, match="does not go with q"):
        rope_qk(torch.randn(4, 2, 16), torch.randn(4, 2, 16, dtype=torch.float64), pos)


def test_compile_matches_eager(backend):
    x, pos = torch.randn(9, 2, 32), torch.arange(9)
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(
        lambda a, p: rope(a, p, 500000.0, 16, False, LLAMA3, backend=backend),
        fullgraph=True,
        backend="eager",
    )
    want = rope(x, pos, 500000.0, 16, False, LLAMA3, backend=backend)
    assert_bitwise(f(x, pos), want, "compile vs eager")


def test_opcheck():
    x, g, pos = torch.randn(5, 2, 16, requires_grad=True), torch.randn(5, 2, 16), torch.arange(5)
    ops = torch.ops.rl_engine
    args = (10000.0, 8, True, "llama3", 8.0, 1.0, 4.0, 64, "native")
    torch.library.opcheck(ops.rope.default, (x, pos, *args))
    torch.library.opcheck(
        ops.rope.default, (x, pos, 10000.0, 16, False, "default", 1.0, 0.0, 0.0, 0, "native")
    )
    torch.library.opcheck(ops.rope_backward.default, (g, pos, *args))
    k, gk = torch.randn(5, 1, 16, requires_grad=True), torch.randn(5, 1, 16)
    torch.library.opcheck(ops.rope_qk.default, (x, k, pos, *args))
    torch.library.opcheck(ops.rope_qk_backward.default, (g, gk, pos, *args))


def test_default_resolution_and_stock_audit_only():
    assert KernelRegistry.get_op("rope", device="cpu").provider.name == "native"
    x, pos = torch.randn(4, 2, 16), torch.arange(4)
    with pytest.raises(BackendUnavailableError, match="audit"):
        rope(x, pos, backend="stock")
    config.set_mode("audit")
    y = rope(x, pos, backend="stock")
    assert_close(y, _ref64(x, pos), rtol=1e-5, atol=1e-5, what="stock")


X, P = torch.randn(4, 2, 16), torch.arange(4)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((X.double(), P), {}, TypeError, "not supported"),
        ((X, P.float()), {}, TypeError, "int32 or int64"),
        ((X, P[:3]), {}, ValueError, "3 entries"),
        ((X[:, 0], P), {}, ValueError, "dims"),
        ((X, P[None]), {}, ValueError, "dims"),
        ((X, P.to("meta")), {}, ValueError, "device"),
        (([[1.0]], P), {}, TypeError, "Tensor"),
        ((X, P), {"rotary_dim": 7}, ValueError, "even"),
        ((X, P), {"rotary_dim": 18}, ValueError, "head_dim=16"),
        ((X, P), {"rotary_dim": 0}, ValueError, "rotary_dim"),
        ((X, P), {"rotary_dim": 8.0}, TypeError, "rotary_dim"),
        ((X, P), {"theta": 0.0}, ValueError, "theta"),
        ((X, P), {"theta": "1e4"}, ValueError, "theta"),
        ((X, P), {"is_neox": 1}, TypeError, "is_neox"),
        ((X, P), {"scaling": "llama3"}, TypeError, "dict"),
        ((X, P), {"scaling": {"rope_type": "yarn", "factor": 4.0}}, ValueError, "yarn"),
        ((X, P), {"scaling": {"rope_type": "linear"}}, ValueError, "needs"),
        ((X, P), {"scaling": {"rope_type": "linear", "factor": 0}}, ValueError, "factor"),
        (
            (X, P),
            {"scaling": {"rope_type": "linear", "factor": 2, "mscale": 1}},
            ValueError,
            "mscale",
        ),
        ((X, P), {"scaling": {**LLAMA3, "high_freq_factor": 1.0}}, ValueError, "high_freq"),
        (
            (X, P),
            {"scaling": {**LLAMA3, "original_max_position_embeddings": 8192.5}},
            ValueError,
            "int",
        ),
        (
            (X, P),
            {"scaling": {"rope_type": "default", "rope_theta": 5.0}},
            ValueError,
            "rope_theta",
        ),
        ((X, P), {"scaling": {"partial_rotary_factor": 0.5}}, ValueError, "partial_rotary_factor"),
    ],
)
def test_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        rope(*args, **kwargs, backend="native")


def test_unknown_backend():
    with pytest.raises(BackendUnavailableError, match="names no provider"):
        rope(X, P, backend="nope")


def test_negative_positions_refused(monkeypatch):
    """A negative position is refused at the public entry (``rope`` and ``rope_qk``), whatever the
    provider; under ``torch.compile`` (and on a GPU) by a device-side assert with
    ``RL_ENGINE_DEVICE_CHECKS=1``."""
    x, pos = torch.randn(4, 2, 16), torch.tensor([0, 1, -1, 3])
    interp = config.settings().triton_interpret
    names = [
        p.name
        for p in KernelRegistry.providers("rope", "cpu")
        if p.invariant and p.why_not("cpu", triton_interpret=interp) is None
    ]
    assert "native" in names
    for name in names:
        with pytest.raises(ValueError, match="positions must be >= 0; got min -1"):
            rope(x, pos, backend=name)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        rope_qk(x, torch.randn(4, 1, 16), pos, backend="native")
    rope(x, pos.abs(), backend="native")  # the same call with valid positions runs
    monkeypatch.setenv("RL_ENGINE_DEVICE_CHECKS", "1")
    config.reload()
    f = torch.compile(lambda a, p: rope(a, p, backend="native"), fullgraph=True, backend="eager")
    assert_bitwise(f(x, pos.abs()), rope(x, pos.abs(), backend="native"), "compiled, checked")
    with pytest.raises(RuntimeError, match="positions must be >= 0"):
        f(x, pos)
