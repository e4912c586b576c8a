"""``cuda`` provider of ``det_gemm``: CUDA C++ kernels for SM90 (wgmma + TMA, CUTLASS collectives).

Numerics (family ``det_gemm/cuda-sm90``; the kernels' source, ``csrc/det_gemm/``, is the
authority): for bf16 / fp16, every output element is one fp32 accumulator that walks K from
column 0 in blocks of 64, each block as four wgmma k16 steps in order (the tensor core's own
fixed unit), no split-K, no stream-K, no atomics; ``out = (acc + bias[j]).to(a.dtype)`` with one
rounding (no bias: ``acc.to(a.dtype)``). Split-K is built but switched off: where
:func:`~rl_engine.ops.det_gemm.config.get_cuda_split_k` says S > 1 for a product's (N, K) (no
entry does yet; tests and benchmarks force S with :func:`det_gemm_with_config`'s ``split_k``), K
is cut into S contiguous slices of K / S columns, each accumulated as above into an fp32 partial,
and the partials are added in slice order before the bias and the one rounding. The weight
gradient ``a.t() @ grad`` is the same product with K = tokens, returned in fp32 (rows appended
as zeros add exact zeros). fp32 inputs run a CUDA-core kernel:
``acc = fma(a[i, k], b[k, j], acc)`` for k = 0 .. K-1 in order (IEEE, no TF32). The tile shape
along M and N, the schedule and the persistent grid are launch choices
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

from rl_engine.ops.det_gemm import config as gemm_config
from rl_engine.ops.det_gemm.config import (
    CUDA_CONFIGS,
    CUDA_WGRAD_CONFIG,
    cuda_split_k_slices,
    get_cuda_config,
)
from rl_engine.ops.det_gemm.reference import _check, check_wgrad
from rl_engine.registry import Provider

__all__ = [
    "LIB_NAME",
    "PROVIDER",
    "det_gemm",
    "det_gemm_split_partials",
    "det_gemm_wgrad",
    "det_gemm_with_config",
    "library_path",
]

LIB_NAME = "librl_engine_sm90.so"
# 2: the split-K entry points; 3: the `narrow` tile configuration; 4: the `*_k128` stagings;
# 5: the 192-column tiles `large192` / `mid192` and the clustered `large_c2`
_ABI_VERSION = 5
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
    lib.rle_det_gemm_sm90_batched.restype = ctypes.c_int64
    lib.rle_det_gemm_sm90_batched.argtypes = [ctypes.c_int] * 3 + [i64] * 4
    lib.rle_det_gemm_sm90_batched.argtypes += [ctypes.POINTER(_Args)]
    lib.rle_splitk_reduce.restype = ctypes.c_int
    lib.rle_splitk_reduce.argtypes = [ctypes.c_int, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64]
    lib.rle_splitk_reduce.argtypes += [ptr]
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


def _launch(lib: Any, call: Any, key: tuple, args: _Args, like: torch.Tensor) -> None:
    """``call(args)`` (an ``rle_det_gemm_sm90*`` entry point with its other arguments bound):
    first with ``workspace_bytes = -1`` for the CUTLASS workspace size (cached per ``key``),
    then with that workspace."""
    need = _WS.get(key)
    if need is None:
        need = call(ctypes.byref(args))
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
    if call(ctypes.byref(args)) != 0:
        raise _fail(lib, "kernel launch failed")


def _run16(product: int, cfg: str, a_ptr, lda, b_ptr, ldb, bias, d, ldd, m, n, k, like) -> None:
    """One 16-bit product through the library on the current stream of ``like``'s device."""
    lib = _lib()
    dtype = _DTYPES[like.dtype]
    cfg_i = CUDA_CONFIGS[cfg]
    dev = like.get_device()
    stream = torch.cuda.current_stream(dev).cuda_stream
    args = _Args(m, n, k, a_ptr, lda, b_ptr, ldb, bias, d.data_ptr(), ldd, None, -1, stream)
    key = (dev, dtype, product, cfg_i, m, n, k, lda, ldb, ldd)
    _launch(lib, functools.partial(lib.rle_det_gemm_sm90, dtype, product, cfg_i), key, args, like)


def _run_slices(
    product: int, cfg: str, a_ptr, lda, stride_a, b_ptr, ldb, stride_b, partials, m, n, k, like
) -> None:
    """The K slices of a split-K product in one batched launch: slice s reads A from
    ``a_ptr + s * stride_a`` and B from ``b_ptr + s * stride_b`` (elements), K = ``k`` columns
    (one slice), and writes ``partials[s]`` (fp32 [S, m, n] view, row stride ``n``)."""
    lib = _lib()
    dtype = _DTYPES[like.dtype]
    cfg_i = CUDA_CONFIGS[cfg]
    dev = like.get_device()
    stream = torch.cuda.current_stream(dev).cuda_stream
    splits, ldd, stride_d = partials.shape[0], partials.stride(1), partials.stride(0)
    args = _Args(m, n, k, a_ptr, lda, b_ptr, ldb, None, partials.data_ptr(), ldd, None, -1, stream)
    key = (dev, dtype, product, cfg_i, m, n, k, lda, ldb, ldd, splits, stride_a, stride_b, stride_d)
    call = functools.partial(
        lib.rle_det_gemm_sm90_batched, dtype, product, cfg_i, splits, stride_a, stride_b, stride_d
    )
    _launch(lib, call, key, args, like)


def _run_reduce(partials: torch.Tensor, bias, out: torch.Tensor, like: torch.Tensor) -> None:
    """``out = round(((p_0 + p_1) + ... + p_{S-1}) + bias)`` over ``partials`` [S, m, n] fp32
    (the split-K reduction, on the current stream)."""
    lib = _lib()
    splits, m, n = partials.shape
    stream = torch.cuda.current_stream(like.get_device()).cuda_stream
    rc = lib.rle_splitk_reduce(
        _DTYPES[like.dtype], m, n, splits, partials.data_ptr(), partials.stride(1),
        partials.stride(0), bias, out.data_ptr(), out.stride(0), stream,
    )  # fmt: skip
    if rc != 0:
        raise _fail(lib, "split-K reduction failed")


def _split_rows(splits: int, n: int, m: int) -> int:
    """Rows per split-K launch: all ``m`` when ``splits * m * n`` fp32 partials fit in
    ``CUDA_SPLIT_K_MAX_WORKSPACE``, else the most that fit (a multiple of 128 when >= 128; rows
    are independent, so chunking them changes no bits). Raises if one row does not fit."""
    cap = gemm_config.CUDA_SPLIT_K_MAX_WORKSPACE
    row_bytes = splits * n * 4
    rows = cap // row_bytes
    if rows < 1:
        raise ValueError(
            f"det_gemm[cuda]: split_k={splits}: workspace too large: one row of {splits} fp32 "
            f"partials over N={n} is {row_bytes} bytes > CUDA_SPLIT_K_MAX_WORKSPACE={cap}"
        )
    if rows >= m:
        return m
    return rows // 128 * 128 if rows >= 128 else rows


def _run_split(product, cfg, splits, a, b_ptr, ldb, bias, out, m, n, k, partials=None) -> None:
    """``out = a @ B (+ bias)`` with K cut into ``splits`` slices
    (:func:`~rl_engine.ops.det_gemm.config.cuda_split_k_slices`): per chunk of rows
    (:func:`_split_rows`) one batched launch of the slices' fp32 partials, then the reduction in
    slice order. ``partials`` given (an fp32 [splits, m, n] tensor): the partials are left there
    and nothing is reduced (``out`` unused)."""
    slices = cuda_split_k_slices(k, splits)
    ks = slices[0][1]  # every slice has ks columns; slice s starts at column s * ks
    # slice s of A (row-major) starts s * ks elements on; of B, s * ks elements on when it is
    # K-contiguous (NT), s * ks rows of ldb when N-contiguous (NN)
    stride_a = ks
    stride_b = ks if product == _NT else ks * ldb
    lda, esize = a.stride(0), a.element_size()
    rows = m if partials is not None else _split_rows(splits, n, m)
    buf = partials
    if buf is None:
        buf = torch.empty((splits, rows, n), dtype=torch.float32, device=a.device)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        p = buf[:, : r1 - r0]
        a_ptr = a.data_ptr() + r0 * lda * esize
        _run_slices(product, cfg, a_ptr, lda, stride_a, b_ptr, ldb, stride_b, p, r1 - r0, n, ks, a)
        if partials is None:
            _run_reduce(p, bias, out[r0:r1], a)


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


def _operands(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """The 16-bit operands as the library takes them: ``(a, b, bias, product, ldb, np_, kp)``
    with ``a`` row-major [M, kp], ``b`` K-contiguous (``_NT``) or N-contiguous (``_NN``) with
    leading dimension ``ldb``, N and K padded to ``np_`` / ``kp`` (multiples of 8)."""
    m, k = a.shape
    n = b.shape[1]
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
    return a, b, bias, product, ldb, np_, kp


def _check_config_k(cfg: str, k: int) -> None:
    """Raises ``ValueError`` where ``cfg`` cannot stage a K (per slice) of ``k`` columns."""
    if not gemm_config.cuda_config_fits(cfg, k):
        raise ValueError(
            f"det_gemm[cuda]: config {cfg!r} stages {gemm_config.CUDA_STAGE_K[cfg]} K columns; "
            f"K={k} (per slice, padded to a multiple of {_ALIGN}) is not a multiple of it"
        )


def _split_count(dtype: torch.dtype, n: int, k: int, split_k: int | None) -> int:
    """The split-K count of a product: ``split_k`` when given (tests, benchmarks), else the
    table's for 16-bit inputs (:func:`~rl_engine.ops.det_gemm.config.get_cuda_split_k`: a
    function of N and K, 1 everywhere today) and 1 for fp32 (the CUDA-core kernel does not
    split); checked (:func:`~rl_engine.ops.det_gemm.config.cuda_split_k_slices`)."""
    if split_k is not None:
        splits = split_k
    else:
        splits = gemm_config.get_cuda_split_k(n, k) if dtype in _DTYPES else 1
        if splits == 1:  # the table's default: nothing to check on the launch path
            return 1
    cuda_split_k_slices(k, splits)  # raises with the reason
    if splits > 1 and dtype not in _DTYPES:
        raise ValueError(
            f"det_gemm[cuda]: split_k={splits}: split-K is for bf16 / fp16 inputs, not {dtype}"
        )
    return splits


def det_gemm_with_config(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: str | None,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """:func:`det_gemm` with an explicit tile configuration (a name of ``CUDA_CONFIGS``; tests
    and tuning: every config gives the same bits) and split-K count.

    ``split_k``: ``None`` takes the table's count for (N, K) (1 everywhere today); an explicit S
    (tests and benchmarks only: S > 1 is other numerics than the family's) cuts K into S slices
    of K / S columns, K a multiple of ``64 * S``; S = 1 is the unsplit kernel. Raises
    ``ValueError`` / ``TypeError`` with the reason for an S it cannot run (no fallback)."""
    _check(a, b, bias)
    _check_cuda(a)
    m, k = a.shape
    n = b.shape[1]
    splits = _split_count(a.dtype, n, k, split_k)
    if m == 0 or n == 0 or k == 0:
        return _empty_result(m, n, bias, a)
    if a.dtype == torch.float32:
        return _fp32(a, b, bias)
    if a.dtype not in _DTYPES:
        raise TypeError(f"det_gemm[cuda]: dtype {a.dtype} is not supported")
    cfg = cfg or get_cuda_config(m, n, k, _sm_count(a), splits=splits)
    if cfg not in CUDA_CONFIGS:
        raise ValueError(f"det_gemm[cuda]: config {cfg!r}; expected one of {list(CUDA_CONFIGS)}")
    a, b, bias, product, ldb, np_, kp = _operands(a, b, bias)
    _check_config_k(cfg, kp // splits)
    out = torch.empty((m, np_), dtype=a.dtype, device=a.device)
    bias_ptr = None if bias is None else bias.data_ptr()
    with _device_guard(a):
        if splits == 1:
            _run16(product, cfg, a.data_ptr(), a.stride(0), b.data_ptr(), ldb, bias_ptr, out,
                   np_, m, np_, kp, a)  # fmt: skip
        else:
            _run_split(product, cfg, splits, a, b.data_ptr(), ldb, bias_ptr, out, m, np_, kp)
    return out if np_ == n else out[:, :n].contiguous()


def det_gemm_split_partials(
    a: torch.Tensor, b: torch.Tensor, split_k: int, cfg: str | None = None
) -> torch.Tensor:
    """The fp32 partials [S, M, N] of ``det_gemm_with_config(a, b, bias, cfg, split_k=S)``
    before its reduction (tests: partial s is the product of K slice s, accumulated from the
    slice's first column; the result is their sum in slice order, + bias, rounded once).
    16-bit inputs, S >= 2."""
    _check(a, b, None)
    _check_cuda(a)
    m, k = a.shape
    n = b.shape[1]
    splits = _split_count(a.dtype, n, k, split_k)
    if splits < 2 or m == 0 or n == 0 or k == 0:
        raise ValueError("det_gemm_split_partials[cuda]: needs S >= 2 and M, N, K >= 1")
    cfg = cfg or get_cuda_config(m, n, k, _sm_count(a), splits=splits)
    a, b, _, product, ldb, np_, kp = _operands(a, b, None)
    _check_config_k(cfg, kp // splits)
    partials = torch.empty((splits, m, np_), dtype=torch.float32, device=a.device)
    with _device_guard(a):
        _run_split(product, cfg, splits, a, b.data_ptr(), ldb, None, None, m, np_, kp, partials)
    return partials if np_ == n else partials[:, :, :n].contiguous()


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
