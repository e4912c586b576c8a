"""Verdicts that do not depend on the host CPU or its BLAS.

The invariance tests prove a property of rl_engine's code only if nothing between the code and the
assertion picks its arithmetic by shape. Two places could:

* the Triton interpreter's ``tl.dot`` (numpy's matmul, i.e. the host's BLAS): rl_engine's kernels
  run in the interpreter with :func:`rl_engine.ops._interpret.fixed_order_dot`; these tests pin
  that dot to a scalar loop, prove it is swapped in while rl_engine launches a kernel (and only
  then), and prove an interpreted kernel's rows do not depend on its tile height;
* the reference providers: they must be invariant by construction (DESIGN.md section 3). Every
  reference op runs here forward and backward under a dispatch mode that raises on any BLAS-backed
  aten op, and ``det_gemm``'s reference is pinned to a scalar loop of its documented order.

Each check would fail on a shape-variant BLAS (such as OpenBLAS 0.3.30 ``DYNAMIC_ARCH`` on an AMD
EPYC, where ``(a @ b)[:m]`` and ``a[:m] @ b`` differ for most small fp32 shapes), or if a BLAS call
crept into a reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl_engine import ops
from rl_engine.ops import _interpret
from tests.conftest import interpreter_on

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
# kernels defined here interpret only when TRITON_INTERPRET=1 was set at import (the second suite
# of scripts/test.sh, which selects "-k triton")
needs_interpreter = pytest.mark.skipif(
    not interpreter_on(), reason="interpreted kernels: run with TRITON_INTERPRET=1"
)


def _scalar_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """The documented order, one element at a time with Python floats (float64 scalars)."""
    m, k = a.shape
    n = b.shape[1]
    out = acc.copy()
    for i in range(m):
        for j in range(n):
            v = out[i, j]
            for k0 in range(0, k, _interpret.K_STEP):
                terms = [
                    float(a[i, kk]) * float(b[kk, j]) if kk < k else 0.0
                    for kk in range(k0, k0 + _interpret.K_STEP)
                ]
                while len(terms) > 1:
                    half = len(terms) // 2
                    terms = [terms[t] + terms[t + half] for t in range(half)]
                v = v + np.asarray(terms[0]).astype(out.dtype)
            out[i, j] = v
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(3, 16, 5), (4, 37, 3), (1, 1, 1), (2, 48, 7)])
def test_fixed_order_dot_is_the_scalar_loop(dtype, shape):
    m, k, n = shape
    rng = np.random.default_rng(m * 100 + k + n)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    acc = rng.standard_normal((m, n)).astype(np.float32)
    got = _interpret.fixed_order_dot(a.astype(np.float64), b.astype(np.float64), acc)
    assert got.dtype == np.float32
    assert np.array_equal(got, _scalar_dot(a, b, acc))


def test_fixed_order_dot_rows_and_columns_are_invariant():
    rng = np.random.default_rng(7)
    for m, k, n in [(64, 16, 48), (45, 200, 72), (33, 128, 17)]:
        a = rng.standard_normal((m, k)).astype(np.float32).astype(np.float64)
        b = rng.standard_normal((k, n)).astype(np.float32).astype(np.float64)
        full = _interpret.fixed_order_dot(a, b, np.zeros((m, n), np.float32))
        for rows in (1, 15, 16, m - 1):
            part = _interpret.fixed_order_dot(a[:rows], b, np.zeros((rows, n), np.float32))
            assert np.array_equal(full[:rows], part), (m, k, n, rows)
        cols = _interpret.fixed_order_dot(a, b[:, 3:11], np.zeros((m, 8), np.float32))
        assert np.array_equal(full[:, 3:11], cols), (m, k, n)


@triton.jit
def _tile_dot_kernel(
    a_ptr, b_ptr, c_ptr, M, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, K)
    cols = tl.arange(0, N)
    a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < M, other=0.0)
    b = tl.load(b_ptr + ks[:, None] * N + cols[None, :])
    acc = tl.zeros((BLOCK_M, N), dtype=tl.float32)
    acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc, mask=rows[:, None] < M)


def _run_tile_dot(a: torch.Tensor, b: torch.Tensor, block_m: int) -> torch.Tensor:
    from rl_engine.ops import _triton

    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=torch.float32)
    kern = _triton.interpreted(_tile_dot_kernel, a.device)
    kern[(triton.cdiv(m, block_m),)](a, b, c, m, K=k, N=n, BLOCK_M=block_m)
    return c


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_interpreted_kernel_rows_do_not_depend_on_the_tile(dtype):
    """A kernel whose tile height changes with M (as det_gemm's configs do): the rows agree."""
    torch.manual_seed(0)
    a = torch.randn(45, 64, dtype=dtype)
    b = torch.randn(64, 32, dtype=dtype)
    tall = _run_tile_dot(a, b, 64)
    short = _run_tile_dot(a[:16], b, 16)
    assert torch.equal(tall[:16], short)
    # and the interpreter computed exactly the fixed-order dot (not numpy's matmul)
    want = _interpret.fixed_order_dot(
        a.double().numpy(), b.double().numpy(), np.zeros((45, 32), np.float32)
    )
    assert torch.equal(tall, torch.from_numpy(want))


@needs_interpreter
def test_triton_interpreted_bf16_dot_is_decoded():
    """bf16 tiles are stored as raw uint16 in the interpreter; the dot uses their values."""
    torch.manual_seed(1)
    a = torch.randn(16, 32, dtype=torch.bfloat16)
    b = torch.randn(32, 16, dtype=torch.bfloat16)
    got = _run_tile_dot(a, b, 16)
    ref = a.double() @ b.double()
    assert (got.double() - ref).abs().max().item() < 1e-5


@needs_interpreter
def test_triton_dot_is_swapped_only_during_rl_engine_launches():
    from triton.runtime.interpreter import interpreter_builder

    assert "create_dot" not in vars(interpreter_builder)
    with _interpret._DotSwap():
        assert interpreter_builder.create_dot is _interpret._create_dot
        with _interpret._DotSwap():  # nested launches keep it
            assert interpreter_builder.create_dot is _interpret._create_dot
        assert interpreter_builder.create_dot is _interpret._create_dot
    assert "create_dot" not in vars(interpreter_builder)
    _run_tile_dot(torch.randn(4, 16), torch.randn(16, 16), 16)
    assert "create_dot" not in vars(interpreter_builder)


@triton.jit
def _pair_sum(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _pair_first(a0, b0, a1, b1):  # not a sum: always the interpreter's own element loop
    return a0, b0 + b1


@triton.jit
def _pair_reduce_kernel(
    x_ptr, y_ptr, s_ptr, t_ptr, R: tl.constexpr, H: tl.constexpr, SUM: tl.constexpr
):
    offs = tl.arange(0, R)[:, None] * H + tl.arange(0, H)[None, :]
    x = tl.load(x_ptr + offs)
    y = tl.load(y_ptr + offs)
    if SUM:
        s, t = tl.reduce((x * x, x * y), 1, _pair_sum)
    else:
        s, t = tl.reduce((x * x, x * y), 1, _pair_first)
    tl.store(s_ptr + tl.arange(0, R), s)
    tl.store(t_ptr + tl.arange(0, R), t)


_interpret.sequential_sum_combiner(_pair_sum)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_interpreted_sum_reduce_fast_path_keeps_the_bits(dtype):
    """A declared sum combine (rms_norm's joint row sums) reduces through numpy's accumulate in
    rl_engine's launches: bitwise what Triton's own element-by-element interpreter loop gives."""
    from triton.runtime.interpreter import InterpretedFunction, ReduceOps

    from rl_engine.ops import _triton

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 256, generator=g) * 30).to(dtype)
    y = (torch.randn(4, 256, generator=g) * 30).to(dtype)

    def run(kern, sum_: bool):
        s = torch.empty(4, dtype=dtype)
        t = torch.empty(4, dtype=dtype)
        kern[(1,)](x, y, s, t, R=4, H=256, SUM=sum_)
        return s, t

    generic = ReduceOps.generic_reduce
    fast = run(_triton.interpreted(_pair_reduce_kernel, x.device), True)
    assert ReduceOps.generic_reduce is generic  # restored after the launch
    slow = run(InterpretedFunction(_pair_reduce_kernel.fn), True)  # Triton's own path
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    # the order is the sequential one, not numpy's pairwise sum
    want = x[0, 0] * x[0, 0]
    for i in range(1, 256):
        want = want + x[0, i] * x[0, i]
    assert torch.equal(fast[0][0], want)
    # a combine that is not declared takes the interpreter's loop
    other = run(_triton.interpreted(_pair_reduce_kernel, x.device), False)
    assert torch.equal(other[0], x[:, 0] * x[:, 0])


def test_fp8_operands_are_refused():
    with pytest.raises(NotImplementedError, match="fp8"):
        _interpret._values(np.zeros(4, np.uint8), tl.float8e4nv)


# --- the reference providers use no BLAS --------------------------------------------------------

_BLAS_OPS = {
    "mm",
    "bmm",
    "addmm",
    "addbmm",
    "baddbmm",
    "matmul",
    "dot",
    "vdot",
    "mv",
    "addmv",
    "addr",
    "linear",
    "einsum",
    "tensordot",
    "convolution",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention_for_cpu",
}


class _NoBlas(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.lstrip("_") if func.overloadpacket else str(func)
        if name in _BLAS_OPS or func.overloadpacket.__name__ in _BLAS_OPS:
            raise AssertionError(f"reference provider called the BLAS-backed op {func}")
        return func(*args, **(kwargs or {}))


def _fwd_bwd(fn, *inputs):
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*ins)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)
    loss.backward()


def _cases():
    g = torch.Generator().manual_seed(3)

    def r(*s, dtype=torch.float32):
        return torch.randn(*s, generator=g).to(dtype)

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    tok = torch.tensor([1, 7, 3, 0, 9], dtype=torch.int64)
    return {
        "det_gemm": (
            lambda a, b, c: ops.det_gemm(a, b, c, backend="native"),
            r(6, 40),
            r(40, 9),
            r(9),
        ),
        "rms_norm": (
            lambda x, w, res: ops.rms_norm(x, w, 1e-6, res, backend="native"),
            r(5, 24),
            r(24),
            r(5, 24),
        ),
        "silu_and_mul": (lambda x: ops.silu_and_mul(x, backend="native"), r(5, 32)),
        "rope": (
            lambda x, p: ops.rope(x, p, 10000.0, backend="native"),
            r(5, 2, 16),
            torch.arange(5),
        ),
        "attention": (
            lambda q, k, v: ops.attention(q, k, v, cu, backend="native"),
            r(12, 4, 16),
            r(12, 2, 16),
            r(12, 2, 16),
        ),
        "logp": (lambda x: ops.logp(x, tok, 0.7, backend="native"), r(5, 50)),
        "entropy": (lambda x: ops.entropy(x, 0.7, backend="native"), r(5, 50)),
        "linear_logp": (
            lambda h, w: ops.linear_logp(h, w, tok, 0.7, True, backend="native"),
            r(5, 24),
            r(50, 24),
        ),
    }


@pytest.mark.parametrize("op", sorted(_cases()))
def test_reference_uses_no_blas(op):
    fn, *inputs = _cases()[op]
    with _NoBlas():
        _fwd_bwd(fn, *inputs)


def test_det_gemm_reference_is_its_documented_loop():
    """``det_gemm/native`` == fp32 products, tree16 per K chunk, chunks in order, + bias, round."""
    from rl_engine.ops._common import tree_sum  # noqa: F401  (the documented tree, by name)

    g = torch.Generator().manual_seed(5)
    m, k, n = 3, 37, 4
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n, generator=g)
    bias = torch.randn(n, generator=g)
    got = ops.det_gemm(a, b, bias, backend="native")
    f32 = np.float32
    an, bn, cn = a.numpy(), b.numpy(), bias.numpy()
    want = np.empty((m, n), f32)
    for i in range(m):
        for j in range(n):
            acc = f32(0.0)
            for k0 in range(0, k, 16):
                terms = [
                    f32(an[i, kk]) * f32(bn[kk, j]) if kk < k else f32(0.0)
                    for kk in range(k0, k0 + 16)
                ]
                while len(terms) > 1:
                    half = len(terms) // 2
                    terms = [f32(terms[t] + terms[t + half]) for t in range(half)]
                acc = f32(acc + terms[0])
            want[i, j] = f32(acc + f32(cn[j]))
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b: torch.mm(a, b),
        lambda a, b: a @ b,
        lambda a, b: torch.nn.functional.linear(a, b.t()),
    ],
)
def test_the_guard_catches_blas(call):
    """The guard above can fail: the BLAS paths of torch trip it."""
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with pytest.raises(AssertionError, match="BLAS-backed"), _NoBlas():
        call(a, b)


@triton.jit
def _scaled_exp_helper(x, scale):
    return tl.exp(x * scale) + tl.sqrt(tl.abs(x))


@triton.jit
def _helper_calls_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = _scaled_exp_helper(x, 0.5)
    y = _scaled_exp_helper(y, 0.25) + tl.sum(x, 0)
    tl.store(y_ptr + offs, y)


@needs_interpreter
def test_triton_language_patched_once_per_launch_keeps_the_bits(monkeypatch):
    """rl_engine's launches patch the language once (the launch's own patch), not again at
    each @triton.jit helper call: the same bits as Triton's own interpreter path, and the
    interpreter's ``_patch_lang`` restored after the launch."""
    from triton.runtime import interpreter

    from rl_engine.ops import _triton

    original = interpreter._patch_lang
    calls = []

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    x = torch.randn(64, generator=torch.Generator().manual_seed(2))

    def run(kern):
        y = torch.empty_like(x)
        kern[(1,)](x, y, N=64)
        return y

    fast = run(_triton.interpreted(_helper_calls_kernel, x.device))
    # the launch's patch; tl.sum (triton.language.standard sees tl.core, which this module's
    # kernel does not) patches tl.core once; this module's helper, called twice, never
    assert calls == ["_helper_calls_kernel", "sum"], calls
    assert interpreter._patch_lang is counting  # restored after the launch
    calls.clear()
    slow = run(interpreter.InterpretedFunction(_helper_calls_kernel.fn))  # Triton's own path
    assert calls.count("_scaled_exp_helper") == 2, calls
    assert torch.equal(fast, slow)
