"""``triton`` provider of ``det_gemm``: a batch- and column-invariant Triton GEMM.

Numerics (family ``det_gemm/triton``): every output tile accumulates K **sequentially into one fp32
accumulator** (``tl.dot`` chained over K steps; no split-K). Inside a step the tensor cores reduce
in their own fixed unit (k16 for bf16/fp16); fp32 inputs use IEEE FMA dots (``input_precision=
"ieee"``, no TF32). Output element (i, j) therefore depends on row i of ``a``, column j of ``b``
and K only: rows outside the matrix are clamped loads that never mix into other rows, and tile
shapes (chosen by M from the checked-in table in :mod:`.config`) do not change the order (a test
proves every shipped config bitwise equal). ``out = (acc + bias[j]).to(a.dtype)``.

Weight gradient ``a.t() @ grad`` (fp32): tokens are reduced in chunks of ``WGRAD_CHUNK`` rows,
each chunk sequentially into a fresh fp32 accumulator, chunk partials added in token order. Two
launch plans compute exactly that order: one program per output tile walking all chunks, or (few
output tiles, many tokens) one program per (tile, chunk) writing partials that a second kernel
adds in chunk order. Appending zero rows adds exact zeros: invariant to zero padding.

Not promised: identity with the ``native`` family, across GPU models, or across Triton versions.
On the CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``); there 16-bit tiles
are widened to fp32 before the dot (the interpreter computes bf16 dots wrongly) and the K step
is 16, so interpreter results are a test vehicle, not the GPU's bits.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _triton as _tr
from rl_engine.ops._common import FLOAT_DTYPES
from rl_engine.ops.det_gemm.config import (
    WGRAD_CHUNK,
    DetGemmConfig,
    WgradConfig,
    get_config,
    get_wgrad_config,
)
from rl_engine.ops.det_gemm.reference import _check
from rl_engine.registry import Provider

try:  # Triton is optional: without it the provider reports why it cannot run.
    import triton
    import triton.language as tl

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["PROVIDER", "det_gemm", "det_gemm_wgrad"]

_INT32_MAX = 2**31 - 1
# Split the weight gradient over token chunks only while the partials stay this small.
_WGRAD_WORKSPACE_BYTES = 64 << 20
# ...and only when there are fewer output tiles than this (a launch-shape heuristic: both plans
# compute the same bits, so it may depend on anything).
_WGRAD_SPLIT_BELOW_TILES = 128


if triton is not None:

    @triton.jit
    def _det_gemm_fwd_kernel(
        a_ptr,
        b_ptr,
        bias_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
        INT64: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        # Grouped launch order (GROUP_M row tiles share the column tiles of B in L2).
        num_in_group = GROUP_M * num_pid_n
        group_id = pid // num_in_group
        first_m = group_id * GROUP_M
        group_size = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((pid % num_in_group) % group_size)
        pid_n = (pid % num_in_group) // group_size
        if INT64:
            pid_m = pid_m.to(tl.int64)
            pid_n = pid_n.to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        if INT64:
            rk = rk.to(tl.int64)
        # Out-of-range rows / columns wrap around to valid ones: rows never mix in a dot, and
        # those results are not stored.
        ram = rm % M
        rbn = rn % N
        a_ptrs = a_ptr + ram[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + rk[:, None] * stride_bk + rbn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0.0)
                b = tl.load(b_ptrs, mask=rk[:, None] < K - k0, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(
            c_ptrs,
            acc.to(c_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )

    @triton.jit
    def _det_gemm_fwd_tma_kernel(
        a_desc,
        b_desc,
        bias_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        B_KMAJOR: tl.constexpr,
        NUM_PROGS: tl.constexpr,
    ):
        # Persistent variant (Hopper): TMA tile loads, tiles visited in the same grouped order.
        # Each tile is computed exactly as in _det_gemm_fwd_kernel (K in order into one fp32
        # accumulator; the TMA zero-fills the K tail), so the bits are the same; NUM_PROGS only
        # says how many programs share the tiles.
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_tiles = num_pid_m * num_pid_n
        k_tiles = tl.cdiv(K, BLOCK_K)
        num_in_group = GROUP_M * num_pid_n
        for tile in tl.range(start, num_tiles, NUM_PROGS, flatten=True):
            group_id = tile // num_in_group
            first_m = group_id * GROUP_M
            group_size = min(num_pid_m - first_m, GROUP_M)
            pid_m = first_m + ((tile % num_in_group) % group_size)
            pid_n = (tile % num_in_group) // group_size
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                off_k = ki * BLOCK_K
                a = a_desc.load([off_m, off_k])
                if B_KMAJOR:
                    b = b_desc.load([off_n, off_k]).T
                else:
                    b = b_desc.load([off_k, off_n])
                acc = tl.dot(a, b, acc)
            rm = off_m + tl.arange(0, BLOCK_M)
            rn = off_n + tl.arange(0, BLOCK_N)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
                acc = acc + bias.to(tl.float32)[None, :]
            c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
            tl.store(
                c_ptrs,
                acc.to(c_ptr.dtype.element_ty),
                mask=(rm[:, None] < M) & (rn[None, :] < N),
            )

    @triton.jit
    def _det_gemm_wgrad_kernel(
        a_ptr,
        g_ptr,
        out_ptr,
        T,
        KO,
        N,
        stride_at,
        stride_ak,
        stride_gt,
        stride_gn,
        stride_os,
        stride_ok,
        stride_on,
        chunks_per_prog,
        CHUNK: tl.constexpr,
        BLOCK_O: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_T: tl.constexpr,
        UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
        INT64: tl.constexpr,
    ):
        # out[split, o, n] = sum over this program's token chunks (in order) of
        #   chunk partial = sum_t a[t, o] * g[t, n]   (fresh fp32 accumulator per chunk)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_o = pid // num_pid_n
        pid_n = pid % num_pid_n
        ro = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rt = tl.arange(0, BLOCK_T)
        if INT64:
            ro = ro.to(tl.int64)
            rn = rn.to(tl.int64)
            rt = rt.to(tl.int64)
        ro_c = ro % KO
        rn_c = rn % N
        t_begin = split * chunks_per_prog * CHUNK
        t_end = tl.minimum(T, t_begin + chunks_per_prog * CHUNK)
        total = tl.zeros((BLOCK_O, BLOCK_N), dtype=tl.float32)
        for c0 in range(t_begin, t_end, CHUNK):
            part = tl.zeros((BLOCK_O, BLOCK_N), dtype=tl.float32)
            for t0 in range(c0, c0 + CHUNK, BLOCK_T):
                t = t0 + rt
                a_t = tl.load(
                    a_ptr + t[None, :] * stride_at + ro_c[:, None] * stride_ak,
                    mask=t[None, :] < T,
                    other=0.0,
                )
                g = tl.load(
                    g_ptr + t[:, None] * stride_gt + rn_c[None, :] * stride_gn,
                    mask=t[:, None] < T,
                    other=0.0,
                )
                if UPCAST:
                    a_t = a_t.to(tl.float32)
                    g = g.to(tl.float32)
                if IEEE:
                    part = tl.dot(a_t, g, part, input_precision="ieee")
                else:
                    part = tl.dot(a_t, g, part)
            total = total + part
        o_ptrs = out_ptr + split * stride_os + ro[:, None] * stride_ok + rn[None, :] * stride_on
        tl.store(o_ptrs, total, mask=(ro[:, None] < KO) & (rn[None, :] < N))

    @triton.jit
    def _det_gemm_wgrad_combine_kernel(ws_ptr, out_ptr, n_parts, numel, BLOCK: tl.constexpr):
        # out = ((0 + ws[0]) + ws[1]) + ...: the same order as the in-program chunk loop.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, n_parts):
            total = total + tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, total, mask=mask)


def _kernel(name: str, device: torch.device) -> Any:
    """The JIT kernel ``name``, interpreted for CPU tensors."""
    return _tr.interpreted(globals()[name], device)


def _check_device(*tensors: torch.Tensor) -> None:
    _tr.check_device("det_gemm", *tensors)


def _needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether some element offset (span of a tensor in memory) can exceed int32."""
    for t in tensors:
        span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)
        if span >= _INT32_MAX:
            return True
    return False


_guard = _tr.device_guard


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a unit-stride last dim, 16-byte aligned base and other strides."""
    es = t.element_size()
    return (
        t.stride(1) == 1
        and (t.stride(0) * es) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.shape[1] * es >= 16
    )


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _launch_fwd_tma(a, b, bias, out, cfg: DetGemmConfig) -> bool:
    """Launch the persistent TMA kernel; ``False`` when the layouts do not allow TMA."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if a.dtype == torch.float32 or not _tma_ok(a):
        return False
    if b.stride(0) == 1 and _tma_ok(b.t()):
        b_kmajor, b_desc_t, b_block = True, b.t(), [cfg.block_n, cfg.block_k]
    elif _tma_ok(b):
        b_kmajor, b_desc_t, b_block = False, b, [cfg.block_k, cfg.block_n]
    else:
        return False
    m, k = a.shape
    n = b.shape[1]
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(b_desc_t, b_block)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    progs = max(1, min(_num_sms(a.device), tiles))
    _det_gemm_fwd_tma_kernel[(progs,)](
        a_desc,
        b_desc,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        out.stride(0),
        out.stride(1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None,
        B_KMAJOR=b_kmajor,
        NUM_PROGS=progs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return True


def _launch_fwd(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: DetGemmConfig,
) -> None:
    m, k = a.shape
    n = b.shape[1]
    on_cpu = a.device.type == "cpu"
    if on_cpu:
        cfg = cfg.for_interpreter()
    elif cfg.tma:
        with _guard(a):
            if _launch_fwd_tma(a, b, bias, out, cfg):
                return
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    with _guard(a):
        _kernel("_det_gemm_fwd_kernel", a.device)[grid](
            a,
            b,
            bias if bias is not None else out,
            out,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            HAS_BIAS=bias is not None,
            EVEN_K=k % cfg.block_k == 0,
            UPCAST=on_cpu and a.dtype != torch.float32,
            IEEE=a.dtype == torch.float32 or on_cpu,
            INT64=_needs_int64(a, b, out),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )


def det_gemm_with_config(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cfg: DetGemmConfig | None
) -> torch.Tensor:
    """:func:`det_gemm` with an explicit launch config (tests and tuning; same numerics)."""
    _check(a, b, bias)
    _check_device(a)
    if a.dtype not in FLOAT_DTYPES:
        raise TypeError(f"det_gemm[triton]: dtype {a.dtype} is not supported")
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
        if bias is not None:
            acc = acc + bias.float()
        return acc.to(a.dtype)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    _launch_fwd(a, b, bias, out, cfg or get_config(m, n, k, a.dtype))
    return out


def det_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch- and column-invariant ``a @ b (+ bias)`` on the GPU (Triton).

    Args:
        a: [M, K] float32 / bfloat16 / float16, any strides.
        b: [K, N] same dtype, any strides (an ``nn.Linear`` weight as ``w.t()``).
        bias: optional [N], same dtype.

    Returns:
        [M, N] in ``a.dtype``: fp32 accumulation over K in order, one final rounding.
    """
    return det_gemm_with_config(a, b, bias, None)


def det_gemm_wgrad_with_plan(
    a: torch.Tensor, grad: torch.Tensor, *, split: bool | None, cfg: WgradConfig | None = None
) -> torch.Tensor:
    """:func:`det_gemm_wgrad` with an explicit launch plan (``split`` over token chunks or not;
    ``None`` = heuristic). Both plans give the same bits."""
    if a.dim() != 2 or grad.dim() != 2 or a.shape[0] != grad.shape[0]:
        raise ValueError(
            f"det_gemm_wgrad: a {tuple(a.shape)} and grad {tuple(grad.shape)} need the same "
            "number of rows"
        )
    if a.dtype != grad.dtype:
        raise TypeError(f"det_gemm_wgrad: a is {a.dtype}, grad is {grad.dtype}")
    if a.device != grad.device:
        raise ValueError(f"det_gemm_wgrad: a on {a.device}, grad on {grad.device}")
    _check_device(a)
    t, ko = a.shape
    n = grad.shape[1]
    out = torch.zeros((ko, n), dtype=torch.float32, device=a.device)
    if t == 0 or ko == 0 or n == 0:
        return out
    on_cpu = a.device.type == "cpu"
    cfg = cfg or get_wgrad_config(a.dtype)
    if on_cpu:
        cfg = cfg.for_interpreter()
    tiles = triton.cdiv(ko, cfg.block_o) * triton.cdiv(n, cfg.block_n)
    n_chunks = triton.cdiv(t, WGRAD_CHUNK)
    if split is None:
        split = (
            n_chunks > 1
            and tiles < _WGRAD_SPLIT_BELOW_TILES
            and n_chunks * ko * n * 4 <= _WGRAD_WORKSPACE_BYTES
        )
    split = split and n_chunks > 1
    if split:
        dest = torch.empty((n_chunks, ko, n), dtype=torch.float32, device=a.device)
        chunks_per_prog, n_progs = 1, n_chunks
    else:
        dest = out.unsqueeze(0)
        chunks_per_prog, n_progs = n_chunks, 1
    common = dict(
        CHUNK=WGRAD_CHUNK,
        BLOCK_O=cfg.block_o,
        BLOCK_N=cfg.block_n,
        BLOCK_T=cfg.block_t,
        UPCAST=on_cpu and a.dtype != torch.float32,
        IEEE=a.dtype == torch.float32 or on_cpu,
        INT64=_needs_int64(a, grad, dest),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    with _guard(a):
        _kernel("_det_gemm_wgrad_kernel", a.device)[(tiles, n_progs)](
            a,
            grad,
            dest,
            t,
            ko,
            n,
            a.stride(0),
            a.stride(1),
            grad.stride(0),
            grad.stride(1),
            dest.stride(0),
            dest.stride(1),
            dest.stride(2),
            chunks_per_prog,
            **common,
        )
        if split:
            numel = ko * n
            block = 1024
            _kernel("_det_gemm_wgrad_combine_kernel", a.device)[(triton.cdiv(numel, block),)](
                dest, out, n_chunks, numel, BLOCK=block
            )
    return out


def det_gemm_wgrad(a: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``a.t() @ grad`` in fp32 (the weight gradient), tokens reduced in fixed chunks.

    Args:
        a: [T, K] (the layer input), any strides.
        grad: [T, N] (the output gradient), same dtype.

    Returns:
        fp32 [K, N]: chunks of ``WGRAD_CHUNK`` tokens, each summed in token order into a fresh
        fp32 accumulator, partials added in chunk order. Deterministic; invariant to appended
        zero rows.
    """
    return det_gemm_wgrad_with_plan(a, grad, split=None)


_available = _tr.available


PROVIDER = Provider(
    op="det_gemm",
    name="triton",
    devices=("cuda", "cpu"),
    dtypes=FLOAT_DTYPES,
    invariant=True,
    numerics="det_gemm/triton",
    fn=det_gemm,
    version="1",
    available=_available,
    extras={"wgrad": det_gemm_wgrad},
)
