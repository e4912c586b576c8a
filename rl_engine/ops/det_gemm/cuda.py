"""``cuda`` provider of ``det_gemm``: CUDA C++ kernels for SM90 (wgmma + TMA, CUTLASS collectives).

Numerics (family ``det_gemm/cuda-sm90``; the kernels' source, ``csrc/det_gemm/``, is the
authority): for bf16 / fp16, every output element is one fp32 accumulator that walks K from
column 0 in blocks of 64, each block as four wgmma k16 steps in order (the tensor core's own
fixed unit), no split-K, no stream-K, no atomics; ``out = (acc + bias[j]).to(a.dtype)`` with one
rounding (no bias: ``acc.to(a.dtype)``). The weight gradient ``a.t() @ grad`` is the same
product with K = tokens, returned in fp32 (rows appended as zeros add exact zeros). fp32 inputs
run a CUDA-core kernel: ``acc = fma(a[i, k], b[k, j], acc)`` for k = 0 .. K-1 in order (IEEE,
no TF32). The tile shape along M and N, the schedule and the persistent grid are launch choices
(:data:`rl_engine.ops.det_gemm.config.CUDA_CONFIGS`): output element (i, j) depends on row i of
``a``, column j of ``b`` and K only, so the op is row (batch) and column invariant. Layout
adaptations made here (a contiguous copy of an operand TMA cannot read, zero padding of K or N
to a multiple of 8) do not change which products are added nor their order: the TMA fills the
same zeros past the matrix.

This family is **not** bitwise equal to ``det_gemm/triton-kc4096`` (other K order: the Triton
family adds 4096-column chunk partials) nor to ``native``. It is opt-in: resolution never picks
it by default; select it on **every** side (rollout and trainers) with
``RL_ENGINE_BACKEND_DET_GEMM=cuda`` (or ``backend="cuda"``). Ops that compute their GEMMs with
the Triton det_gemm internally (``linear_logp``'s Triton provider, the MoE Triton kernels) do
not follow it: see ``docs/operators/det_gemm.md``.

The kernels live in a C-ABI shared library (``librl_engine_sm90.so``, built by
``scripts/build_csrc.sh`` without a GPU) loaded with ctypes: no torch C++ ABI is involved, so the
same library serves every torch version; tensors cross as device pointers and the current
stream (CUDA-graph capture works as for any kernel launched on that stream).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from pathlib import Path
from typing import Any

import torch

from rl_engine.ops.det_gemm.config import (
    CUDA_CONFIGS,
    CUDA_WGRAD_CONFIG,
    get_cuda_config,
)
from rl_engine.ops.det_gemm.reference import _check, check_wgrad
from rl_engine.registry import Provider

__all__ = ["LIB_NAME", "PROVIDER", "det_gemm", "det_gemm_wgrad", "library_path"]

LIB_NAME = "librl_engine_sm90.so"
_ABI_VERSION = 1
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
_NT, _NN, _WGRAD = 0, 1, 2  # the library's RLE_NT / RLE_NN / RLE_WGRAD
_ALIGN = 8  # elements of a 16-bit operand per 16 bytes (TMA strides and base addresses)


class _Args(ctypes.Structure):
    """``rle_gemm_args`` of ``csrc/det_gemm/det_gemm_sm90.h``."""

    _fields_ = [
        ("m", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("a", ctypes.c_void_p),
        ("lda", ctypes.c_int64),
        ("b", ctypes.c_void_p),
        ("ldb", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("ldd", ctypes.c_int64),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_int64),
        ("stream", ctypes.c_void_p),
    ]


def _candidates() -> list[Path]:
    from rl_engine import config

    explicit = config.settings().csrc_lib
    if explicit:
        return [Path(explicit)]
    pkg = Path(__file__).resolve().parents[2]  # .../rl_engine
    return [pkg / "_lib" / LIB_NAME, pkg.parent / "build" / "csrc" / LIB_NAME]


def library_path() -> Path | None:
    """Where the library would be loaded from (``None``: not built / not found)."""
    for p in _candidates():
        if p.is_file():
            return p
    return None


@functools.cache
def _load() -> tuple[Any, str | None]:
    """``(library, None)`` or ``(None, why it cannot be loaded)``; loaded once per process."""
    path = library_path()
    if path is None:
        where = ", ".join(str(p) for p in _candidates())
        return None, (
            f"the CUDA library {LIB_NAME} is not built (looked in: {where}); build it with "
            "`CUTLASS_DIR=... bash scripts/build_csrc.sh` or point RL_ENGINE_CSRC_LIB at it"
        )
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load {path}: {exc}"
    lib.rle_abi_version.restype = ctypes.c_int
    lib.rle_last_error.restype = ctypes.c_char_p
    lib.rle_check_device.restype = ctypes.c_int
    lib.rle_det_gemm_sm90.restype = ctypes.c_int64
    lib.rle_det_gemm_sm90.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(_Args),
    ]
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rle_det_gemm_fp32.restype = ctypes.c_int
    lib.rle_det_gemm_fp32.argtypes = [i64, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr]
    lib.rle_det_gemm_fp32.argtypes += [i64, i64, ptr]
    abi = lib.rle_abi_version()
    if abi != _ABI_VERSION:
        return (
            None,
            f"{path} has ABI version {abi}, this rl_engine needs {_ABI_VERSION}: rebuild it",
        )
    return lib, None


def available(device: str, *, triton_interpret: bool) -> str | None:
    """The registry's availability check: the library, a CUDA device, SM90 (reads no env)."""
    if device != "cuda":
        return f"runs on CUDA only, not on {device!r}"
    lib, reason = _load()
    if lib is None:
        return reason
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        name = torch.cuda.get_device_name()
        return f"needs an SM90 GPU (H100 / H200); this device ({name}) is sm_{cap[0]}{cap[1]}"
    return None


def _lib() -> Any:
    lib, reason = _load()
    if lib is None:
        raise RuntimeError(f"det_gemm[cuda]: {reason}")
    return lib


def _fail(lib: Any, what: str) -> RuntimeError:
    msg = (lib.rle_last_error() or b"").decode(errors="replace")
    return RuntimeError(f"det_gemm[cuda]: {what}: {msg}")


def _check_cuda(*tensors: torch.Tensor) -> None:
    t = tensors[0]
    if t.device.type != "cuda":
        raise RuntimeError(f"det_gemm[cuda]: tensors on {t.device} are not supported (CUDA only)")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _ld_ok(ld: int, extent: int) -> bool:
    """A leading dimension TMA can use for rows of ``extent`` elements: 16-byte multiple, no
    overlap (an expanded operand's stride 0 is not one)."""
    return ld % _ALIGN == 0 and ld >= extent


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of ``t`` (a new allocation: 16-byte aligned, unlike a
    ``contiguous()`` that returns a misaligned view as is)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` [R, C] copied into a zero row-major [rows, cols] (rows >= R, cols >= C)."""
    out = t.new_zeros((rows, cols))
    out[: t.shape[0], : t.shape[1]] = t
    return out


_NO_GUARD = contextlib.nullcontext()
_SMS: dict[int, int] = {}  # device index -> streaming multiprocessors


def _sm_count(t: torch.Tensor) -> int:
    """The SM count of ``t``'s device (the tile choice's wave model), looked up once."""
    idx = t.get_device()
    sms = _SMS.get(idx)
    if sms is None:
        sms = _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return sms


def _device_guard(t: torch.Tensor) -> Any:
    """``torch.cuda.device(t.device)`` when it is not the current device (the library launches on
    the current device), else a no-op context."""
    idx = t.get_device()
    if idx == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(idx)


_WS: dict[tuple, int] = {}  # workspace bytes per (device, dtype, product, cfg, shapes, lds)
_MAX_WS = 8192


def _run16(product: int, cfg: str, a_ptr, lda, b_ptr, ldb, bias, d, ldd, m, n, k, like) -> None:
    """One 16-bit product through the library on the current stream of ``like``'s device."""
    lib = _lib()
    dtype = _DTYPES[like.dtype]
    cfg_i = CUDA_CONFIGS[cfg]
    dev = like.get_device()
    stream = torch.cuda.current_stream(dev).cuda_stream
    args = _Args(m, n, k, a_ptr, lda, b_ptr, ldb, bias, d.data_ptr(), ldd, None, -1, stream)
    key = (dev, dtype, product, cfg_i, m, n, k, lda, ldb, ldd)
    need = _WS.get(key)
    if need is None:
        need = lib.rle_det_gemm_sm90(dtype, product, cfg_i, ctypes.byref(args))
        if need < 0:
            raise _fail(lib, "cannot run this product")
        if len(_WS) >= _MAX_WS:
            _WS.clear()
        _WS[key] = need
    ws = None
    if need > 0:
        ws = torch.empty(need, dtype=torch.uint8, device=like.device)
        args.workspace = ws.data_ptr()
    args.workspace_bytes = need
    if lib.rle_det_gemm_sm90(dtype, product, cfg_i, ctypes.byref(args)) != 0:
        raise _fail(lib, "kernel launch failed")


def _fp32(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``a @ b (+ bias)`` on the CUDA cores (k in order, IEEE FMA), any strides."""
    lib = _lib()
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    if bias is not None:
        bias = bias.contiguous()
    stream = torch.cuda.current_stream(a.get_device()).cuda_stream
    with _device_guard(a):
        rc = lib.rle_det_gemm_fp32(
            m, n, k, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0),
            b.stride(1), None if bias is None else bias.data_ptr(), out.data_ptr(),
            out.stride(0), out.stride(1), stream,
        )  # fmt: skip
    if rc != 0:
        raise _fail(lib, "fp32 kernel launch failed")
    return out


def _empty_result(m: int, n: int, bias: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros((m, n), dtype=torch.float32, device=like.device)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(like.dtype)


def det_gemm_with_config(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cfg: str | None
) -> torch.Tensor:
    """:func:`det_gemm` with an explicit tile configuration (a name of ``CUDA_CONFIGS``; tests
    and tuning: every config gives the same bits)."""
    _check(a, b, bias)
    _check_cuda(a)
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return _empty_result(m, n, bias, a)
    if a.dtype == torch.float32:
        return _fp32(a, b, bias)
    if a.dtype not in _DTYPES:
        raise TypeError(f"det_gemm[cuda]: dtype {a.dtype} is not supported")
    cfg = cfg or get_cuda_config(m, n, k, _sm_count(a))
    if cfg not in CUDA_CONFIGS:
        raise ValueError(f"det_gemm[cuda]: config {cfg!r}; expected one of {list(CUDA_CONFIGS)}")
    kp = _round_up(k, _ALIGN)
    np_ = _round_up(n, _ALIGN)
    if (kp, np_) != (k, n):
        # TMA needs 16-byte aligned extents along the contiguous dims: zero-padded copies, the
        # problem run as [M, kp] x [kp, np_] (the same zeros TMA fills past K; extra columns cut)
        a = _padded(a, m, kp)
        b = _padded(b.t(), np_, kp).t()
        product, ldb = _NT, kp
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(np_ - n)])
    else:
        # A: row-major with a 16-byte aligned row stride, else a contiguous copy
        if not (a.stride(1) == 1 and _ld_ok(a.stride(0), k) and _aligned(a)):
            a = _copy(a)
        # B: K-contiguous (an nn.Linear weight as w.t(): "NT") or N-contiguous ("NN"), else a
        # K-contiguous copy
        if b.stride(0) == 1 and _ld_ok(b.stride(1), k) and _aligned(b):
            product, ldb = _NT, b.stride(1)
        elif b.stride(1) == 1 and _ld_ok(b.stride(0), n) and _aligned(b):
            product, ldb = _NN, b.stride(0)
        else:
            b = _copy(b.t()).t()
            product, ldb = _NT, b.stride(1)
        if bias is not None and (bias.stride(0) != 1 or not _aligned(bias)):
            bias = _copy(bias)
    out = torch.empty((m, np_), dtype=a.dtype, device=a.device)
    bias_ptr = None if bias is None else bias.data_ptr()
    with _device_guard(a):
        _run16(product, cfg, a.data_ptr(), a.stride(0), b.data_ptr(), ldb, bias_ptr, out, np_, m,
               np_, kp, a)  # fmt: skip
    return out if np_ == n else out[:, :n].contiguous()


def det_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch- and column-invariant ``a @ b (+ bias)`` on an SM90 GPU (CUDA C++).

    Args:
        a: [M, K] bfloat16 / float16 / float32, any strides.
        b: [K, N] same dtype, any strides (an ``nn.Linear`` weight as ``w.t()``).
        bias: optional [N], same dtype.

    Returns:
        [M, N] in ``a.dtype``: one fp32 accumulator over K in order (module doc), one rounding.
    """
    return det_gemm_with_config(a, b, bias, None)


def det_gemm_wgrad(a: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``a.t() @ grad`` in fp32 (the weight gradient): tokens walked in order into one fp32
    accumulator per element (64-token blocks, wgmma k16 steps); deterministic, invariant to
    appended zero rows.

    Args:
        a: [T, K] (the layer input), any strides.
        grad: [T, N] (the output gradient), same dtype.

    Returns:
        fp32 [K, N].
    """
    check_wgrad(a, grad)
    _check_cuda(a)
    t, ko = a.shape
    n = grad.shape[1]
    if t == 0 or ko == 0 or n == 0:
        return torch.zeros((ko, n), dtype=torch.float32, device=a.device)
    if a.dtype == torch.float32:
        # measured on an H200 (2026-11-27): the CUDA-core kernel walks all T tokens into one fp32
        # accumulator; at T = 5000 its error (3.4e-4 absolute on ~1e2 values) is above the
        # house's fp32 gradient tolerance, which the Triton family meets by summing chunks of
        # WGRAD_CHUNK tokens. Refused until this kernel chunks the tokens the same way.
        raise TypeError(
            "det_gemm_wgrad[cuda]: float32 inputs are not supported (the CUDA-core kernel sums "
            "all tokens into one fp32 accumulator: above the fp32 gradient tolerance at T = "
            "5000); use bf16 / fp16, or the triton family"
        )
    if a.dtype not in _DTYPES:
        raise TypeError(f"det_gemm_wgrad[cuda]: dtype {a.dtype} is not supported")
    kop = _round_up(ko, _ALIGN)
    np_ = _round_up(n, _ALIGN)
    # A = a.t() [K, T] M-contiguous: a row-major [T, kop] with an aligned row stride; B = grad
    # row-major [T, np_] likewise (zero-padded copies where needed: extra rows / columns cut)
    if not (kop == ko and a.stride(1) == 1 and _ld_ok(a.stride(0), ko) and _aligned(a)):
        a = _padded(a, t, kop)
    if not (np_ == n and grad.stride(1) == 1 and _ld_ok(grad.stride(0), n) and _aligned(grad)):
        grad = _padded(grad, t, np_)
    out = torch.empty((kop, np_), dtype=torch.float32, device=a.device)
    with _device_guard(a):
        _run16(_WGRAD, CUDA_WGRAD_CONFIG, a.data_ptr(), a.stride(0), grad.data_ptr(),
               grad.stride(0), None, out, np_, kop, np_, t, a)  # fmt: skip
    return out if (kop, np_) == (ko, n) else out[:ko, :n].contiguous()


def library_info() -> dict[str, Any]:
    """What the provider would load: path, build record (``librl_engine_sm90.txt``), reason."""
    path = library_path()
    info: dict[str, Any] = {"path": str(path) if path else None}
    if path is not None:
        rec = path.with_suffix(".txt")
        if rec.is_file():
            for line in rec.read_text().splitlines():
                key, _, value = line.partition("=")
                info[key] = value
        info["size_bytes"] = os.path.getsize(path)
    info["unavailable"] = _load()[1]
    return info


PROVIDER = Provider(
    op="det_gemm",
    name="cuda",
    devices=("cuda",),
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    invariant=True,
    numerics="det_gemm/cuda-sm90",
    fn=det_gemm,
    version="1",
    available=available,
    extras={"wgrad": det_gemm_wgrad},
    opt_in=True,
)
