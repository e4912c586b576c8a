"""One-shot exchange of the TP reduction's fp32 subtrees through symmetric memory (small messages).

:class:`rl_engine.ops.det_gemm.tp.Exchange` combines the ranks' fp32 subtrees with an all-to-all
and an all-gather (NCCL): two collectives, each a few microseconds of latency, which is most of
the cost at decode sizes. The one-shot path (:class:`OneShot`) is one Triton kernel:

1. every rank's subtree ``[M, N]`` (fp32) is in its own **symmetric-memory** buffer
   (``torch.distributed._symmetric_memory``: the same allocation on every rank, each rank can
   load from every other rank's through NVLink); the one-launch subtree kernel writes it there
   directly (``Exchange.subtree_out``), else it is copied in;
2. the kernel's programs meet their peers' at a barrier (phase A: "my subtree is written");
3. each rank loads every rank's subtree and adds them with the tree's top levels in rank order
   (:func:`rl_engine.ops.det_gemm.tp.pair_tree`'s adjacent pairs), adds the bias in fp32 and
   rounds once: the whole ``[M, N]`` result (or, ``rows``, its own block of rows: sequence
   parallelism's reduce-scatter);
4. a second barrier (phase B: "I have read your buffer") before the kernel ends, so that no rank
   overwrites its buffer with the next subtree while a peer still reads it.

Same adds in the same order as ``finish(combine(subtrees), bias, dtype)``: the NCCL path's bits
(elementwise IEEE fp32 adds, one round-to-nearest-even conversion) and the TP = 1 bits.

The barriers: each of a rank's programs ``b`` writes an epoch number into slot ``(phase, b,
rank)`` of every peer's buffer (atomic exchange, release, system scope) and waits until its own
slots ``(phase, b, j)`` hold the same number (compare-and-swap of the number with itself,
acquire, system scope). The epoch of program ``b`` lives in device memory (``+ 1`` per call,
written back by the kernel), so the kernel is capturable in CUDA graphs and replays keep
counting; slots are compared for equality, so the 32-bit counter may wrap. This is the pattern
of vLLM's custom all-reduce (per-block flags in peer memory, a start and an end barrier),
written here as Triton with its own slot layout. Every rank must run the same sequence of
exchanges on one stream (as the collectives of a process group must).

Size switch: a subtree of at most :data:`ONESHOT_MAX_BYTES` (fp32 bytes, ``4 M N``) takes the
one-shot path when the exchange has one; larger ones NCCL's. Both paths are the same bits, so
the switch is a speed choice only. Availability: CUDA tensors, a process group whose ranks can
map each other's memory (symmetric-memory rendezvous), a power-of-two world of at most 8, and
Triton; :meth:`OneShot.over` raises with the reason otherwise (no silent fallback: a caller
that asked for the one-shot path gets it or an error).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._triton import tl, triton

__all__ = ["ONESHOT_MAX_BYTES", "OneShot", "for_group", "unavailable_reason"]

# The largest subtree (fp32 bytes, 4 * M * N) that takes the one-shot path: 4 MiB = 256 tokens at
# hidden 4096. Measured (4 x H200, 2026-11-27, `tp_exchange_check`, the Llama-3-8B down_proj
# layer under CUDA-graph replay, one-shot vs NCCL exchange): TP 2 50.2 vs 66.7 us at 64 tokens,
# 74.9 vs 93.2 at 128, 84.6 vs 106.9 at 256; TP 4 36.8 vs 47.3, 61.8 vs 76.2, 88.7 vs 87.6: the
# one-shot path wins up to 128 tokens at both degrees and ties (TP 4) or wins (TP 2) at 256; not
# measured above (the first setting, 1 MiB, was vLLM's custom all-reduce's one-shot limit).
ONESHOT_MAX_BYTES = 4 << 20
# Programs per launch (each one barrier participant); the kernel loops over the elements.
MAX_PROGRAMS = 64
_MAX_WORLD = 8
# int32 barrier slots at the start of every rank's buffer: [phase (2)][program][source rank]
_FLAG_WORDS = 2 * MAX_PROGRAMS * _MAX_WORLD
_BLOCK = 1024  # elements per program step


if triton is not None:
    # the tree's adds exactly as det_gemm's TP subtree kernel makes them: its own functions
    from rl_engine.ops.det_gemm.triton import _pair_tree_push, _pair_tree_start

    @triton.jit
    def _oneshot_barrier(ptrs_ptr, me, rank, slot, epoch, WORLD: tl.constexpr):
        """Tell every peer that this program reached ``slot`` in ``epoch``; wait for all of
        them (release writes, acquire reads, system scope)."""
        for j in tl.static_range(WORLD):
            if j != rank:
                peer = tl.load(ptrs_ptr + j).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer + slot * 8 + rank, epoch, sem="release", scope="sys")
        for j in tl.static_range(WORLD):
            if j != rank:
                # CAS(epoch -> epoch): an acquire read that never writes another value (the
                # slot's writer is peer j alone)
                seen = tl.atomic_cas(me + slot * 8 + j, epoch, epoch, sem="acquire", scope="sys")
                while seen != epoch:
                    seen = tl.atomic_cas(
                        me + slot * 8 + j, epoch, epoch, sem="acquire", scope="sys"
                    )

    @triton.jit
    def _tp_oneshot_kernel(
        ptrs_ptr,
        epoch_ptr,
        bias_ptr,
        out_ptr,
        rank,
        first,
        numel,
        N,
        WORLD: tl.constexpr,
        DATA: tl.constexpr,
        MAX_PROGS: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SYNC: tl.constexpr,
    ):
        # out[i] = (tree over ranks j of sub_j[first + i]) (+ bias[(first + i) % N]), rounded
        # once; sub_j at word DATA of rank j's buffer (ptrs_ptr[j]). The tree: adjacent pairs,
        # level by level (_pair_tree_push; lv<l>: the left subtree of 2^l ranks waiting for its
        # neighbour).
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        me = tl.load(ptrs_ptr + rank).to(tl.pointer_type(tl.int32))
        epoch = tl.load(epoch_ptr + pid) + 1
        if SYNC:
            tl.debug_barrier()
            _oneshot_barrier(ptrs_ptr, me, rank, pid, epoch, WORLD)
        for start in range(pid * BLOCK, numel, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            src = first + offs.to(tl.int64)
            x, lv0, lv1, lv2, lv3, lv4 = _pair_tree_start(tl.zeros((BLOCK,), tl.float32))
            for j in tl.static_range(WORLD):
                base = tl.load(ptrs_ptr + j).to(tl.pointer_type(tl.float32))
                x = tl.load(base + DATA + src, mask=mask, other=0.0, cache_modifier=".cv")
                x, lv0, lv1, lv2, lv3, lv4 = _pair_tree_push(x, j, lv0, lv1, lv2, lv3, lv4)
            if HAS_BIAS:
                x = x + tl.load(bias_ptr + src % N, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)
        if SYNC:
            tl.debug_barrier()
            _oneshot_barrier(ptrs_ptr, me, rank, MAX_PROGS + pid, epoch, WORLD)
        tl.store(epoch_ptr + pid, epoch)


def unavailable_reason(group: Any = None, device: torch.device | None = None) -> str | None:
    """Why the one-shot exchange cannot run for ``group`` on ``device`` (``None``: it can try;
    the rendezvous itself may still refuse)."""
    if triton is None:
        return f"triton is not importable ({_triton.IMPORT_ERROR})"
    if not torch.cuda.is_available():
        return "no CUDA device (symmetric memory is CUDA memory mapped by every rank)"
    if device is not None and device.type != "cuda":
        return f"tensors on {device}: the one-shot exchange needs CUDA tensors"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except Exception as exc:
        return f"torch.distributed._symmetric_memory is not importable ({exc})"
    if group is not None:
        import torch.distributed as dist

        world = dist.get_world_size(group)
        if world > _MAX_WORLD or world & (world - 1):
            return f"{world} ranks: the one-shot exchange takes a power of two <= {_MAX_WORLD}"
    return None


class OneShot:
    """The one-shot exchange of one TP group (see the module doc). Build it with
    :meth:`over` (or :func:`for_group`, cached per group); ``ex(sub, bias, dtype, rows=None)``.

    Holds this rank's symmetric buffer (barrier slots, then ``max_bytes`` of fp32 data), the
    device array of every rank's buffer address (rank order) and the programs' epochs.
    """

    def __init__(self, buffer: torch.Tensor, ptrs: torch.Tensor, rank: int, world: int,
                 max_bytes: int, handle: Any = None) -> None:  # fmt: skip
        if world < 2 or world > _MAX_WORLD or world & (world - 1):
            raise ValueError(f"OneShot: {world} ranks; expected a power of two in 2..{_MAX_WORLD}")
        if buffer.dtype != torch.int32 or buffer.numel() < _FLAG_WORDS + max_bytes // 4:
            raise ValueError("OneShot: the buffer must be int32 words: slots + max_bytes of data")
        self.buffer, self.ptrs, self.handle = buffer, ptrs, handle
        self.rank, self.world, self.max_bytes = rank, world, max_bytes
        self.data = buffer[_FLAG_WORDS:].view(torch.float32)  # this rank's subtree, flat
        self.epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=buffer.device)
        self.sync = True  # the barriers (tests of the combine alone turn them off)

    @classmethod
    def over(cls, group: Any, max_bytes: int = ONESHOT_MAX_BYTES) -> OneShot:
        """Allocate and rendezvous the symmetric buffers of ``group`` (a collective: every rank
        calls it, outside CUDA-graph capture). Raises ``RuntimeError`` with the reason when the
        one-shot path cannot run here."""
        import torch.distributed as dist

        device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        reason = unavailable_reason(group, device)
        if reason is None and torch.cuda.is_current_stream_capturing():
            reason = "built during CUDA-graph capture; build it before (one eager call)"
        if reason is not None:
            raise RuntimeError(f"TP one-shot exchange unavailable: {reason}")
        import torch.distributed._symmetric_memory as symm_mem

        if max_bytes <= 0 or max_bytes % 16:
            raise ValueError(f"OneShot: max_bytes={max_bytes} must be a positive multiple of 16")
        name = group.group_name if hasattr(group, "group_name") else dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch, a deprecated no-op need in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                if not symm_mem.is_symm_mem_enabled_for_group(name):
                    enable(name)
        try:
            buf = symm_mem.empty(_FLAG_WORDS + max_bytes // 4, dtype=torch.int32, device=device)
            buf.zero_()
            handle = symm_mem.rendezvous(buf, group)
        except Exception as exc:
            raise RuntimeError(
                f"TP one-shot exchange unavailable: symmetric-memory rendezvous failed "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        torch.cuda.synchronize(device)
        handle.barrier()  # every rank's slots are zero before any kernel signals
        ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        return cls(buf, ptrs, handle.rank, handle.world_size, max_bytes, handle)

    def fits(self, m: int, n: int) -> bool:
        """Whether a ``[m, n]`` fp32 subtree takes this path (:data:`ONESHOT_MAX_BYTES`)."""
        return 0 < 4 * m * n <= self.max_bytes

    def staging(self, m: int, n: int) -> torch.Tensor:
        """This rank's buffer as an fp32 ``[m, n]`` (where the subtree kernel writes)."""
        return self.data[: m * n].view(m, n)

    def __call__(self, sub: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 rows: bool = False) -> torch.Tensor:  # fmt: skip
        """``finish(combine(every rank's sub), bias, dtype)``: ``[M, N]``, or with ``rows``
        this rank's block of ``M / world`` rows."""
        m, n = sub.shape
        if sub.dtype != torch.float32 or not self.fits(m, n):
            raise ValueError(f"OneShot: an fp32 subtree of at most {self.max_bytes} bytes, "
                             f"got {sub.dtype} [{m}, {n}]")  # fmt: skip
        stage = self.staging(m, n)
        if sub.data_ptr() != stage.data_ptr() or not sub.is_contiguous():
            stage.copy_(sub)
        if rows:
            if m % self.world:
                raise ValueError(f"TP exchange: {m} rows do not split over {self.world} ranks")
            h = m // self.world
            first, numel, shape = self.rank * h * n, h * n, (h, n)
        else:
            first, numel, shape = 0, m * n, (m, n)
        out = torch.empty(shape, dtype=dtype, device=sub.device)
        if bias is not None:
            if bias.shape != (n,):
                raise ValueError(f"OneShot: bias {tuple(bias.shape)} for {n} columns")
            bias = bias.contiguous()
        progs = max(1, min(MAX_PROGRAMS, _triton.cdiv(numel, _BLOCK)))
        with _triton.device_guard(sub):
            _triton.launcher(_tp_oneshot_kernel, sub.device)[(progs,)](
                self.ptrs,
                self.epochs,
                bias if bias is not None else out,
                out,
                self.rank,
                first,
                numel,
                n,
                WORLD=self.world,
                DATA=_FLAG_WORDS,
                MAX_PROGS=MAX_PROGRAMS,
                BLOCK=_BLOCK,
                HAS_BIAS=bias is not None,
                SYNC=self.sync,
                num_warps=4,
            )
        return out


_GROUPS: dict[tuple, OneShot] = {}


def for_group(group: Any, max_bytes: int = ONESHOT_MAX_BYTES) -> OneShot:
    """The :class:`OneShot` of ``group`` on the current device (built on first use, a
    collective; kept after)."""
    import torch.distributed as dist

    key = (getattr(group, "group_name", None) or id(group), dist.get_rank(group),
           torch.cuda.current_device() if torch.cuda.is_available() else -1, max_bytes)  # fmt: skip
    ex = _GROUPS.get(key)
    if ex is None:
        ex = _GROUPS[key] = OneShot.over(group, max_bytes)
    return ex
