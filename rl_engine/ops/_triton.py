"""Host-side helpers shared by every Triton provider: availability, device checks, the device
guard, cached launches of ``@triton.jit`` kernels, and running a kernel in the interpreter for
CPU tensors.

Kernels live in each op's ``triton.py``; this module holds no kernel and no numerics.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from rl_engine import config as _rl_config
from rl_engine.ops._common import FLOAT_DTYPES
from rl_engine.registry import Provider

try:  # Triton is optional: without it every Triton provider reports why it cannot run.
    import triton
    import triton.language as tl

    IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a broken install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

try:  # what the cached launch path uses of Triton (present in the Triton versions we test)
    from triton import knobs as _knobs
    from triton.compiler import CompiledKernel as _CompiledKernel
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor

    _CACHED_LAUNCH = all(
        hasattr(_CompiledKernel, a) for a in ("run", "launch_metadata", "_init_handles")
    ) and hasattr(_knobs.runtime, "launch_enter_hook")
except Exception:  # older / newer Triton: every launch takes Triton's own path
    _knobs = None  # type: ignore[assignment]
    _TensorDescriptor = None  # type: ignore[assignment,misc]
    _CACHED_LAUNCH = False

_interpreted: dict[str, Any] = {}


def available(device: str, *, triton_interpret: bool) -> str | None:
    """The registry's availability check of a Triton provider (reads no environment)."""
    if triton is None:
        return f"triton is not importable ({IMPORT_ERROR})"
    if device == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is available"
    if device == "cpu":
        if triton_interpret:
            return None
        return (
            "Triton kernels need a CUDA device; set TRITON_INTERPRET=1 to run them in the "
            "interpreter"
        )
    return f"device {device!r} is not supported"


def triton_provider(*, numerics: str, fn: Any, op: str | None = None, **fields: Any) -> Provider:
    """An op's ``triton`` provider: CUDA (and the CPU through the Triton interpreter), the float
    dtypes, invariant, availability :func:`available` unless ``fields`` names another. ``op``
    defaults to the family's op, the part of ``numerics`` before its first ``/``
    (``"ratio_kl/triton"``: ``ratio_kl``)."""
    fields.setdefault("available", available)
    if op is None:
        op = numerics.partition("/")[0]
    return Provider(op=op, name="triton", devices=("cuda", "cpu"), dtypes=FLOAT_DTYPES,
                    invariant=True, numerics=numerics, fn=fn, **fields)  # fmt: skip


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """Raise unless the tensors can run Triton kernels (CUDA, or the CPU under the interpreter)."""
    if triton is None:
        raise RuntimeError(f"{op}[triton]: triton is not importable ({IMPORT_ERROR})")
    dev = tensors[0].device
    if dev.type == "cuda":
        return
    if dev.type == "cpu":
        if not _rl_config.settings().triton_interpret:
            raise RuntimeError(
                f"{op}[triton]: Triton kernels need a CUDA device; set TRITON_INTERPRET=1 "
                "to run them in the interpreter on the CPU"
            )
        return
    raise RuntimeError(f"{op}[triton]: tensors on {dev} are not supported (cuda or cpu)")


INT32_MAX = 2**31 - 1


def rows(t: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """``t`` as [M, n] rows (``n``: its last dim unless given) with a unit column stride: a view
    when possible, else a copy. A layout choice only: the row kernels' bits never depend on it."""
    t2 = t.reshape(-1, t.shape[-1] if n is None else n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def int64_offsets(m: int, *strides: int) -> bool:
    """Whether the offsets ``row * stride`` of ``m`` rows can reach ``2**31`` for one of
    ``strides`` (the kernel's ``INT64`` constexpr: its offset arithmetic in int64)."""
    return any(m * max(s, 1) >= INT32_MAX for s in strides)


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a constexpr function: slower to call)."""
    return -(-a // b)


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor) -> Any:
    """``torch.cuda.device(t.device)`` for CUDA tensors on another device than the current one,
    a no-op context otherwise (the common case: no device switch, no context-manager cost)."""
    idx = t.get_device()
    if idx < 0 or idx == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(idx)


def interpreted(kern: Any, device: torch.device) -> Any:
    """``kern`` itself for CUDA tensors; for CPU tensors its interpreter version, whatever
    ``TRITON_INTERPRET`` was when the kernel's module was imported, computing ``tl.dot`` in a
    fixed order that does not depend on the host's BLAS (:mod:`rl_engine.ops._interpret`)."""
    if device.type != "cpu":
        return kern
    from rl_engine.ops._interpret import fixed_order_kernel

    key = f"{kern.fn.__module__}.{kern.fn.__qualname__}"
    if key not in _interpreted:
        _interpreted[key] = fixed_order_kernel(kern.fn)
    return _interpreted[key]


# --- cached launches -------------------------------------------------------------------------

_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1


def _arg_spec(v: Any) -> Any:
    """What Triton's argument binding can specialize on in ``v``, or more: a tensor's dtype and
    16-byte alignment, an integer's value when it is -1, 0 or 1, else its divisibility by 16 and
    its width (i32 / i64 / u64), a bool's type and value, a float's type, a tensor descriptor's dtype, block shape, rank,
    padding and base alignment; anything else (``None``, constexpr values) as itself."""
    tp = type(v)
    if tp is int:
        if -1 <= v <= 1:
            return v
        return (v % 16 == 0, v < _I32_MIN or v > _I32_MAX, v > _I64_MAX)
    if tp is bool:
        return (bool, v)  # not equal to the key of the integer 1
    if v is None:
        return v
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if tp is float:
        return float
    if _TensorDescriptor is not None and tp is _TensorDescriptor:
        return (
            v.base.dtype,
            tuple(v.block_shape),
            len(v.shape),
            v.padding,
            v.base.data_ptr() % 16 == 0,
        )
    return v


class Launcher:
    """Launches of one ``@triton.jit`` kernel on CUDA that skip Triton's per-call binding.

    ``kernel[grid](*args, **kwargs)`` makes Triton bind and specialize every argument, build a
    cache key and look the compiled kernel up on every call: on a loaded host that is tens of
    microseconds of Python per launch, the GPU time of a whole decode-sized GEMM. A launcher
    keys the compiled kernel by the device, by a superset of what Triton specializes on in each
    positional argument (:func:`_arg_spec`), and by the keyword arguments (constexprs and
    launch options, which callers pass by keyword). The first call with a key goes through
    Triton (compiling if needed) and keeps what Triton picked; later calls launch that compiled
    kernel directly, with the same arguments Triton passes it. A launch choice, never numerics:
    the kernel is the one Triton's own path would run.

    ``RL_ENGINE_CHECK_LAUNCH=1`` asks Triton on every call which kernel its binding picks and
    raises if the cache picked another (the GPU test script runs with it). Triton versions
    without the internals used here take Triton's path on every call.
    """

    __slots__ = ("fn", "_names", "_defaults", "_kernels")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._names = tuple(fn.arg_names)
        # parameters with a default value: a call may leave them out (Triton binds the default)
        self._defaults = {
            p.name: p.default
            for p in getattr(fn, "params", ())
            if getattr(p, "default", inspect.Parameter.empty) is not inspect.Parameter.empty
        }
        self._kernels: dict[tuple, tuple[Any, tuple[str, ...]] | None] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Launch; returns the compiled kernel when later launches with these specializations
        may reuse it (``None``: Triton's path only)."""
        if not _CACHED_LAUNCH:
            self.fn[grid](*args, **kwargs)
            return None
        dev = torch.cuda.current_device()
        key = (dev, *map(_arg_spec, args), *kwargs.items())
        entry = self._kernels.get(key)
        if entry is None:
            kern = self.fn[grid](*args, **kwargs)  # Triton's path (compiles on first use)
            tail = self._names[len(args) :]
            # A parameter left out must have a default (a constant: not needed in the key).
            known = all(n in kwargs or n in self._defaults for n in tail)
            entry = self._kernels[key] = (kern, tail) if known else None
            return entry[0] if entry is not None else None
        kern, tail = entry
        if _rl_config.settings().check_launch:
            picked = self.fn.run(*args, grid=grid, warmup=True, **kwargs)
            if picked is not kern:
                raise RuntimeError(
                    f"{self.fn.__name__}: the launch cache picked another compiled kernel than "
                    "Triton's argument binding (the cache key misses a specialization)"
                )
        vals = args + self.tail_values(tail, kwargs)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _raw_stream(dev)
        kern.run(
            grid[0],
            g1,
            g2,
            stream,
            kern.function,
            kern.packed_metadata,
            kern.launch_metadata(grid, stream, *vals),
            _knobs.runtime.launch_enter_hook,
            _knobs.runtime.launch_exit_hook,
            *vals,
        )
        return kern

    def tail_names(self, n_args: int) -> tuple[str, ...]:
        """The parameter names after the first ``n_args`` (passed by keyword)."""
        return self._names[n_args:]

    def tail_values(self, names: tuple[str, ...], kwargs: dict[str, Any]) -> tuple:
        """The values of parameters ``names``: from ``kwargs``, else their defaults."""
        return tuple([kwargs[n] if n in kwargs else self._defaults[n] for n in names])


class Prepared:
    """One launch with everything but its leading arguments fixed.

    ``step(*lead)`` launches ``kernel[grid](*lead, *rest, **kwargs)``. The first call goes
    through the kernel's :class:`Launcher` (Triton's own path when the kernel is new); later calls
    launch the compiled kernel it used directly, without even the launcher's key. Valid while the
    leading arguments specialize as on the first call, so callers key prepared launches by what
    decides that (dtypes, shapes, strides, 16-byte alignment: see ``det_gemm``'s plans). With
    ``RL_ENGINE_CHECK_LAUNCH=1`` every call goes through the launcher (which asks Triton) and
    raises unless the kernel is the one kept. Interpreted kernels (CPU) launch plainly.
    """

    __slots__ = ("kern", "grid", "rest", "kwargs", "_ck", "_tail")

    def __init__(self, kern: Any, grid: tuple[int, ...], rest: tuple, kwargs: dict[str, Any]):
        self.kern = kern  # a Launcher, or an interpreted function
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.rest = rest
        self.kwargs = kwargs
        self._ck: Any = None
        self._tail: tuple = ()

    def __call__(self, *lead: Any) -> None:
        ck = self._ck
        if ck is None or not _CACHED_LAUNCH or _rl_config.settings().check_launch:
            if not isinstance(self.kern, Launcher):
                self.kern[self.grid](*lead, *self.rest, **self.kwargs)
                return
            used = self.kern.launch(self.grid, lead + self.rest, self.kwargs)
            if ck is not None and used is not None and used is not ck:
                raise RuntimeError(
                    f"{self.kern.fn.__name__}: a prepared launch kept another compiled kernel "
                    "than the launcher picks for these arguments (its key misses a "
                    "specialization)"
                )
            if used is not None and ck is None:
                names = self.kern.tail_names(len(lead) + len(self.rest))
                self._tail = self.rest + self.kern.tail_values(names, self.kwargs)
                self._ck = used
            return
        vals = lead + self._tail
        g0, g1, g2 = self.grid
        stream = _raw_stream(torch.cuda.current_device())
        ck.run(
            g0,
            g1,
            g2,
            stream,
            ck.function,
            ck.packed_metadata,
            ck.launch_metadata(self.grid, stream, *vals),
            _knobs.runtime.launch_enter_hook,
            _knobs.runtime.launch_exit_hook,
            *vals,
        )


_PREPARED: dict[tuple, Prepared] = {}
_MAX_PREPARED = 8192  # argument layouts seen in one process; beyond, the cache starts over


def prepared(key: tuple, make: Any) -> Prepared:
    """The :class:`Prepared` launch kept under ``key``, made by ``make()`` on first sight.

    ``key`` must hold everything that decides the launch's grid, fixed arguments and
    constexprs, and the specialization of its leading arguments (dtypes, 16-byte alignment).
    """
    step = _PREPARED.get(key)
    if step is None:
        if len(_PREPARED) >= _MAX_PREPARED:
            _PREPARED.clear()
        step = _PREPARED[key] = make()
    return step


def aligned(t: torch.Tensor) -> bool:
    """16-byte alignment of the data pointer (what Triton specializes pointers on)."""
    return t.data_ptr() % 16 == 0


def _raw_stream(dev: int) -> int:
    return torch._C._cuda_getCurrentRawStream(dev)


_launchers: dict[int, Launcher] = {}


def launcher(kern: Any, device: torch.device) -> Any:
    """``kern`` launched through a cached :class:`Launcher` for CUDA tensors, or its interpreter
    version for CPU tensors (see :func:`interpreted`)."""
    if device.type == "cpu":
        return interpreted(kern, device)
    lau = _launchers.get(id(kern))
    if lau is None or lau.fn is not kern:
        lau = _launchers[id(kern)] = Launcher(kern)
    return lau
