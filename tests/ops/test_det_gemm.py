"""det_gemm: numerics vs float64, row/column invariance, deterministic backward, errors, opcheck."""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops import det_gemm, det_gemm_cat
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.conftest import backend_fixture

DTYPES = [torch.float32, torch.bfloat16]


# CPU tensors only: the Triton provider runs on a GPU in the test_*triton*.py files
backend = backend_fixture("det_gemm", device="cpu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16, 8), (33, 100, 70), (17, 760, 129), (0, 8, 4), (5, 0, 3)])
def test_numerics_vs_float64(backend, dtype, shape):
    m, k, n = shape
    torch.manual_seed(m * 1000 + k + n)
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    bias = torch.randn(n, dtype=dtype)
    out = det_gemm(a, b, bias, backend=backend)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = a.double() @ b.double() + bias.double()
    rtol, atol = tolerance(dtype, k=k)
    assert_close(out, ref, rtol=rtol, atol=atol, what=f"det_gemm {shape} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_forward(backend, dtype):
    torch.manual_seed(1)
    b = torch.randn(96, 40, dtype=dtype)
    bias = torch.randn(40, dtype=dtype)
    x = torch.randn(300, 96, dtype=dtype)
    check_row_invariance(lambda t: det_gemm(t, b, bias, backend=backend), x, what="det_gemm fwd")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance_dx(backend, dtype):
    w = torch.randn(24, 48, dtype=dtype)  # nn.Linear weight [out, in]
    x = torch.randn(199, 48, dtype=dtype)
    g = torch.randn(199, 24, dtype=dtype)

    def dx(rows):
        n = rows.shape[0]
        xi = x[:n].clone().requires_grad_(True)
        det_gemm(xi, w.t(), backend=backend).backward(g[:n])
        return xi.grad

    full = dx(x)
    for k in (1, 17, 31, 33, 199):
        assert_bitwise(dx(x[:k]), full[:k], f"dX first {k} rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_invariance(backend, dtype):
    a = torch.randn(37, 64, dtype=dtype)
    b = torch.randn(64, 100, dtype=dtype)
    full = det_gemm(a, b, backend=backend)
    for j0, j1 in [(0, 1), (3, 50), (50, 100), (99, 100)]:
        assert_bitwise(det_gemm(a, b[:, j0:j1], backend=backend), full[:, j0:j1], f"cols {j0}:{j1}")
    # fused (concatenated) weights == separate weights, as vLLM QKV vs HF q/k/v
    w1, w2 = torch.randn(30, 64, dtype=dtype), torch.randn(20, 64, dtype=dtype)
    fused = det_gemm(a, torch.cat([w1, w2]).t(), backend=backend)
    assert_bitwise(fused[:, :30], det_gemm(a, w1.t(), backend=backend), "fused vs separate")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_numerics_and_determinism(backend, dtype):
    a = torch.randn(45, 33, dtype=dtype, requires_grad=True)
    b = torch.randn(33, 21, dtype=dtype, requires_grad=True)
    bias = torch.randn(21, dtype=dtype, requires_grad=True)
    g = torch.randn(45, 21, dtype=dtype)

    def grads():
        for t in (a, b, bias):
            t.grad = None
        det_gemm(a, b, bias, backend=backend).backward(g)
        return a.grad.clone(), b.grad.clone(), bias.grad.clone()

    ga, gb, gbias = grads()
    ga2, gb2, gbias2 = grads()
    for x, y, n in [(ga, ga2, "da"), (gb, gb2, "db"), (gbias, gbias2, "dbias")]:
        assert_bitwise(x, y, f"{n} run-to-run")
    g64 = g.double()
    rtol, atol = tolerance(dtype, grad=True)
    assert_close(ga, g64 @ b.detach().double().t(), rtol=rtol, atol=atol, what="da")
    assert_close(gb, a.detach().double().t() @ g64, rtol=rtol, atol=atol, what="db")
    assert_close(gbias, g64.sum(0), rtol=rtol, atol=atol, what="dbias")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_cat_equals_separate_layers(backend, dtype, with_bias):
    """det_gemm_cat (q/k/v as one GEMM): output columns, weight and bias gradients bitwise those
    of the separate layers; the input gradient (one reduction over the fused N) close; compile
    and no-grad paths equal the eager autograd path."""
    torch.manual_seed(11)
    x = torch.randn(37, 48, dtype=dtype)
    sizes = (24, 8, 8)
    ws = [torch.randn(n, 48, dtype=dtype) for n in sizes]
    bs = [torch.randn(n, dtype=dtype) for n in sizes] if with_bias else None
    g = torch.randn(37, sum(sizes), dtype=dtype)

    def leaves():
        return (
            x.clone().requires_grad_(),
            [w.clone().requires_grad_() for w in ws],
            [b.clone().requires_grad_() for b in bs] if bs else None,
        )

    xa, wa, ba = leaves()
    fused = det_gemm_cat(xa, wa, ba, backend=backend)
    fused.backward(g)
    xb, wb, bb = leaves()
    parts = [det_gemm(xb, w.t(), bb[i] if bb else None, backend=backend) for i, w in enumerate(wb)]
    sep = torch.cat(parts, dim=1)
    sep.backward(g)
    assert_bitwise(fused, sep, "forward: fused vs separate")
    for i in range(len(sizes)):
        assert_bitwise(wa[i].grad, wb[i].grad, f"dW[{i}]")
        if bs:
            assert_bitwise(ba[i].grad, bb[i].grad, f"dbias[{i}]")
    rtol, atol = tolerance(dtype, grad=True)
    dx64 = g.double() @ torch.cat(ws).double()
    assert_close(xa.grad, dx64, rtol=rtol, atol=atol, what="dx fused (one reduction)")
    assert_close(xb.grad, dx64, rtol=rtol, atol=atol, what="dx separate (summed products)")
    with torch.no_grad():
        assert_bitwise(det_gemm_cat(x, ws, bs, backend=backend), fused.detach(), "no-grad path")
    xc, wc, bc = leaves()
    xc.grad = None
    det_gemm_cat(xc, wc, bc, backend=backend).backward(g)
    assert_bitwise(xc.grad, xa.grad, "dx run-to-run")
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(
        lambda a, *w: det_gemm_cat(a, list(w), None, backend=backend),
        fullgraph=True,
        backend="eager",
    )
    assert_bitwise(f(x, *ws), det_gemm_cat(x, ws, None, backend=backend), "compile vs eager")


def test_cat_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="no weights"):
        det_gemm_cat(x, [])
    with pytest.raises(ValueError, match="2 biases for 3 weights"):
        det_gemm_cat(x, [torch.randn(2, 8)] * 3, [torch.randn(2)] * 2)
    with pytest.raises(ValueError, match="cannot be multiplied"):
        det_gemm_cat(x, [torch.randn(2, 8), torch.randn(2, 7)])


def test_weight_grad_zero_padding_invariant(backend):
    x = torch.randn(50, 16)
    g = torch.randn(50, 8)
    w = torch.randn(8, 16, requires_grad=True)

    def dw(xx, gg):
        w.grad = None
        det_gemm(xx, w.t(), backend=backend).backward(gg)
        return w.grad.clone()

    base = dw(x, g)
    for pad in (1, 14, 40):
        xp = torch.cat([x, torch.zeros(pad, 16)])
        gp = torch.cat([g, torch.zeros(pad, 8)])
        assert_bitwise(dw(xp, gp), base, f"dW with {pad} zero rows")


def test_strided_inputs(backend):
    a = torch.randn(64, 40)[::2, ::2]  # non-contiguous
    b = torch.randn(30, 20).t()
    out = det_gemm(a, b, backend=backend)
    assert_bitwise(out, det_gemm(a.contiguous(), b.contiguous(), backend=backend), "strided")


def test_compile_matches_eager(backend):
    a, b = torch.randn(9, 16), torch.randn(16, 5)
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(lambda x, y: det_gemm(x, y, backend=backend), fullgraph=True, backend="eager")
    assert_bitwise(f(a, b), det_gemm(a, b, backend=backend), "compile vs eager")


def test_opcheck():
    a, b, bias = torch.randn(5, 7), torch.randn(7, 3), torch.randn(3)
    torch.library.opcheck(torch.ops.rl_engine.det_gemm.default, (a, b, bias, "native"))
    torch.library.opcheck(torch.ops.rl_engine.det_gemm.default, (a, b, None, "native"))
    torch.library.opcheck(
        torch.ops.rl_engine.det_gemm_wgrad.default, (a, torch.randn(5, 3), "native")
    )


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.randn(3, 4), torch.randn(5, 6)), ValueError, "cannot be multiplied"),
        ((torch.randn(3, 4), torch.randn(4, 6, dtype=torch.float64)), TypeError, "dtype"),
        ((torch.randn(3, 4).double(), torch.randn(4, 6).double()), TypeError, "not supported"),
        ((torch.randn(3, 4), torch.randn(4, 6), torch.randn(5)), ValueError, "bias"),
        ((torch.randn(3, 4, 2), torch.randn(4, 6)), ValueError, "dims"),
        ((torch.randn(3, 4), torch.randn(4, 6, device="meta")), ValueError, "device"),
        (([[1.0]], torch.randn(1, 1)), TypeError, "Tensor"),
    ],
)
def test_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        det_gemm(*args, backend="native")
