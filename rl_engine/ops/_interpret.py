"""The Triton interpreter's ``tl.dot`` with a reduction order fixed by the operands alone.

Why: Triton's interpreter (``TRITON_INTERPRET=1``, the CPU test vehicle of every Triton provider)
computes ``tl.dot`` with ``numpy.matmul``, that is with the host's BLAS. BLAS libraries pick their
kernels by shape and by CPU (OpenBLAS ``DYNAMIC_ARCH`` on an AMD EPYC: ``(a @ b)[:m]`` differs from
``a[:m] @ b`` for most small fp32 shapes), so an interpreted kernel whose tiles differ between two
launches (a config picked by row count, a masked tail) reported row-variant results on some hosts
and row-invariant ones on others. A verdict that depends on the host proves nothing.

rl_engine's kernels therefore run in the interpreter with this dot, for ``acc = tl.dot(a, b, acc)``
with ``a`` [..., M, K], ``b`` [..., K, N]::

    for each step s of 16 along K (the last one zero-padded), in order:
        acc = acc + round_to_acc_dtype(tree16_f64(a[..., :, s] * b[..., s, :]))

Products of two operands of at most 24 significant bits (fp32 / fp16 / bf16) are exact in
float64; the 16 products of a step are summed pairwise in float64 in a fixed tree, rounded once to
the accumulator's dtype and added to the accumulator. Every step is an elementwise IEEE operation
(numpy computes ``+`` and ``*`` exactly rounded in SIMD and scalar code alike), so element
``(i, j)`` is a function of row ``i`` of ``a``, column ``j`` of ``b`` and ``acc[i, j]`` alone: the
interpreted kernel is row and column invariant exactly when its own reduction order is, on any CPU.
The model follows the GPU's MMA, which also adds one K step of 16 (bf16 / fp16) into the fp32
accumulator at a time; interpreter bits are still not the GPU's bits (the MMA's inner order and
rounding are its own). bf16 operands, which the interpreter stores as raw ``uint16`` and numpy
multiplies as integers, are decoded to their values here; fp8 operands are refused.

The dot is swapped in only while a kernel launched by rl_engine runs (:class:`FixedOrderKernel`),
so kernels of other libraries in the same process keep the interpreter's own. So are two changes
of the interpreter's speed, not its bits: the fast path of declared sum reductions
(:func:`sequential_sum_combiner`), and the language patched once per launch (:func:`_patch_once`)
instead of again at every ``@triton.jit`` helper call.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

K_STEP = 16  # elements of K summed per accumulator update (part of the interpreter's numerics)

_lock = threading.RLock()


def _values(data: np.ndarray, tl_dtype: Any) -> np.ndarray:
    """The float64 values of an interpreter operand (bf16 is stored as raw uint16 bits)."""
    name = getattr(tl_dtype, "name", str(tl_dtype))
    if name == "bf16":
        return (data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if name.startswith("fp8"):
        raise NotImplementedError(
            f"rl_engine's fixed-order interpreter dot does not model {name} operands"
        )
    if not np.issubdtype(data.dtype, np.floating):
        raise TypeError(f"fixed_order_dot: unexpected operand dtype {data.dtype} ({name})")
    return data.astype(np.float64)


def fixed_order_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``acc + a @ b`` in the fixed order of the module docstring; a, b float64 values.

    a [..., M, K], b [..., K, N], acc [..., M, N] (its dtype is the result's).
    """
    k = a.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"fixed_order_dot: shapes {a.shape} and {b.shape} do not multiply")
    pad = (-k) % K_STEP
    if pad:
        a = np.concatenate([a, np.zeros((*a.shape[:-1], pad), np.float64)], axis=-1)
        b = np.concatenate([b, np.zeros((*b.shape[:-2], pad, b.shape[-1]), np.float64)], axis=-2)
    out = np.array(acc, copy=True)
    for k0 in range(0, k + pad, K_STEP):
        prod = a[..., :, k0 : k0 + K_STEP, None] * b[..., None, k0 : k0 + K_STEP, :]
        width = K_STEP
        while width > 1:  # fixed pairwise tree over the step: element i + element i + width/2
            width //= 2
            prod = prod[..., :width, :] + prod[..., width : 2 * width, :]
        out = out + prod[..., 0, :].astype(out.dtype)
    return out


# ``tl.reduce`` combine functions (their Python ``fn``) that return ``acc_j + x_j`` for each
# operand j: see :func:`sequential_sum_combiner`.
_SUM_COMBINERS: set[Any] = set()


def sequential_sum_combiner(jit_fn: Any) -> Any:
    """Declare the ``@triton.jit`` combine function ``jit_fn(acc_0, .., acc_n, x_0, .., x_n)`` of a
    ``tl.reduce`` to return ``(acc_0 + x_0, .., acc_n + x_n)``.

    Triton's interpreter reduces with a custom combine function one element at a time in Python
    (``ReduceOps.generic_reduce``: left to right, ``acc = combine(acc, x[i])`` in the operands'
    dtype), about 0.1 ms per element. For a declared sum the interpreter (inside rl_engine's
    launches) takes ``numpy.add.accumulate`` along the axis instead: the same left-to-right
    sequence of IEEE additions in the same dtype, so the same bits, thousands of times faster
    (``tests/ops/test_host_independence.py`` compares the two)."""
    _SUM_COMBINERS.add(getattr(jit_fn, "fn", jit_fn))
    return jit_fn


def _sequential_sum_reduce(self: Any, input: Any) -> Any:
    """``ReduceOps.generic_reduce`` for a declared sum: ``np.add.accumulate``'s last element."""
    fn = getattr(self.combine_fn, "fn", self.combine_fn)
    if fn not in _SUM_COMBINERS or self.axis is None:
        return _ORIGINAL_GENERIC_REDUCE[0](self, input)
    out = []
    for arg in input:
        data = arg.handle.data
        n = data.shape[self.axis]
        total = np.take(np.add.accumulate(data, axis=self.axis, dtype=data.dtype), n - 1, self.axis)
        if self.keep_dims:
            total = np.expand_dims(total, self.axis)
        out.append(self.to_tensor(np.ascontiguousarray(total), arg.dtype))
    return out


_ORIGINAL_GENERIC_REDUCE: list[Any] = []


def _create_dot(a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
    """Drop-in for ``InterpreterBuilder.create_dot`` (same arguments, TensorHandle result)."""
    from triton.runtime.interpreter import TensorHandle

    acc = d.data
    if not np.issubdtype(acc.dtype, np.floating):  # integer dots: modular sums are order-free
        return TensorHandle(np.matmul(a.data, b.data, dtype=acc.dtype) + acc, d.dtype.scalar)
    out = fixed_order_dot(_values(a.data, a.dtype), _values(b.data, b.dtype), acc)
    return TensorHandle(out.astype(acc.dtype, copy=False), d.dtype.scalar)


# This thread's rl_engine launches in progress, innermost last: [patched, lang module ids].
_launches = threading.local()
_ORIGINAL_PATCH_LANG: list[Any] = []


def _lang_ids(fn: Any) -> frozenset[int]:
    """The Triton language modules (``tl``, ``tl.core``) that ``fn``'s globals see, as the
    interpreter's ``_patch_lang`` finds them."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def _patch_once_fits(interpreter: Any) -> bool:
    """Whether this Triton's interpreter has the two private names :func:`_patch_once` relies
    on (a Triton without them runs its own per-call patching: slower, the same bits)."""
    return hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "_LangPatchScope")


def _patch_once(fn: Any) -> Any:
    """The interpreter's ``_patch_lang`` during rl_engine's launches: the launch's own call (the
    first) patches; a ``@triton.jit`` helper called inside the kernel, whose language modules the
    launch has patched already, is not patched again. Triton's interpreter patches them again at
    every helper call (``InterpretedFunction.__call__``), a scan of the language's members that
    finds them all patched (its wrappers are not builtins) and rewraps a few core functions with
    the same behaviour; its scope is never restored. In det_gemm's kernels that was ~20% of the
    interpreter's time; the patched language, hence every bit, is the same."""
    stack = getattr(_launches, "stack", None)
    original = _ORIGINAL_PATCH_LANG[0]
    if not stack:  # not inside an rl_engine launch on this thread
        return original(fn)
    state = stack[-1]
    langs = _lang_ids(fn)
    if state[0] and langs <= state[1]:
        from triton.runtime.interpreter import _LangPatchScope

        return _LangPatchScope()  # nothing to restore
    scope = original(fn)
    state[0] = True
    state[1] = state[1] | langs  # a helper's patches stay until the launch's restore
    return scope


class _DotSwap:
    """Context: the interpreter's builder computes ``tl.dot`` with :func:`_create_dot` (and
    declared sums with :func:`_sequential_sum_reduce`, the language patched per launch with
    :func:`_patch_once`)."""

    _depth = 0

    def __enter__(self) -> None:
        from triton.runtime import interpreter

        _lock.acquire()
        if _DotSwap._depth == 0:
            from triton.runtime.interpreter import ReduceOps

            # instance attribute shadows the method
            interpreter.interpreter_builder.create_dot = _create_dot
            _ORIGINAL_GENERIC_REDUCE.append(ReduceOps.generic_reduce)
            ReduceOps.generic_reduce = _sequential_sum_reduce
            if _patch_once_fits(interpreter):  # speed only: another Triton keeps its own
                _ORIGINAL_PATCH_LANG.append(interpreter._patch_lang)
                interpreter._patch_lang = _patch_once
        _DotSwap._depth += 1
        if not hasattr(_launches, "stack"):
            _launches.stack = []
        _launches.stack.append([False, frozenset()])

    def __exit__(self, *exc: Any) -> None:
        from triton.runtime import interpreter

        _launches.stack.pop()
        _DotSwap._depth -= 1
        if _DotSwap._depth == 0:
            from triton.runtime.interpreter import ReduceOps

            del interpreter.interpreter_builder.create_dot
            ReduceOps.generic_reduce = _ORIGINAL_GENERIC_REDUCE.pop()
            if _ORIGINAL_PATCH_LANG:
                interpreter._patch_lang = _ORIGINAL_PATCH_LANG.pop()
        _lock.release()


@functools.cache
def _kernel_class() -> type:
    from triton.runtime.interpreter import InterpretedFunction, interpreter_builder

    if not callable(getattr(interpreter_builder, "create_dot", None)):
        raise RuntimeError(
            "this Triton's interpreter has no InterpreterBuilder.create_dot: rl_engine cannot "
            "give it a fixed-order dot, so interpreted results would depend on the host's BLAS"
        )

    class FixedOrderKernel(InterpretedFunction):
        """An interpreted kernel whose launches compute ``tl.dot`` with the fixed-order dot."""

        def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            with _DotSwap():
                return super().run(*args, grid=grid, warmup=warmup, **kwargs)

    return FixedOrderKernel


def fixed_order_kernel(fn: Any) -> Any:
    """The interpreter kernel of the Python function ``fn`` (a ``@triton.jit`` kernel's ``.fn``)
    whose launches compute ``tl.dot`` with :func:`fixed_order_dot`."""
    return _kernel_class()(fn)
