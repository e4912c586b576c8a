"""Prefill / decode invariance of attention, bitwise (DESIGN.md section 1).

For every query token: full varlen prefill == chunked prefill through the paged cache (chunk
sizes 1, 7, 64, 128, 1000) == token-by-token decode (pages of 16 and 32) == any batch
composition (mixed prefill chunks and decode steps of other sequences, padding). Run for every
invariant provider the registry lists for the device (the ``triton`` cases on the CPU need
``TRITON_INTERPRET=1``; ``cuda`` cases run when a GPU is present).
"""

from __future__ import annotations

import pytest
import torch

from rl_engine import KernelRegistry
from rl_engine.ops import attention, paged_attention, write_kv_cache
from rl_engine.testing.invariance import assert_bitwise
from tests.ops.attention_cases import provider_cases, skip_unless_runnable

HQ, HKV, D = 4, 2, 16  # GQA, small head dim: the invariance does not depend on sizes


# many small elementwise ops: one intra-op thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _dtypes(provider: str, device: str) -> list[torch.dtype]:
    if device == "cuda":
        return [torch.bfloat16, torch.float32]
    if provider == "triton_split":  # interpreter time: its fp32 cases only
        return [torch.float32]
    if provider.startswith("triton"):  # interpreter: fp32 / fp16 (bf16 tl.dot wrong)
        return [torch.float32, torch.float16]
    return [torch.float32, torch.bfloat16]


@pytest.fixture(params=provider_cases(_dtypes))
def case(request, monkeypatch):
    device, backend, dtype = request.param
    skip_unless_runnable(device, backend)
    if backend == "triton_split":
        # splits of 128 positions (2 tiles): the short sequences here cross several split
        # boundaries (the shipped 512 is crossed by the 1030-token case only)
        from rl_engine.ops.attention import triton as at

        monkeypatch.setattr(at, "SPLIT_POSITIONS", 128)
    return device, backend, dtype


def _seq(n, dtype, device, seed, heads=(HQ, HKV)):
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    return tuple(torch.randn(n, h, D, generator=g).to(device, dtype) for h in (hq, hkv, hkv))


class PagedCache:
    """A paged KV cache with randomly scattered blocks, one block-table row per sequence."""

    def __init__(self, lens, page, dtype, device, seed=0, hkv=HKV):
        self.page, self.device = page, device
        need = [-(-n // page) for n in lens]
        total = sum(need) + 3
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
        self.table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
        i = 0
        for s, n in enumerate(need):
            self.table[s, :n] = perm[i : i + n].to(torch.int32)
            i += n
        self.table = self.table.to(device)
        self.k = torch.full((total, page, hkv, D), float("nan"), dtype=dtype, device=device)
        self.v = torch.full_like(self.k, float("nan"))  # unwritten slots must never be read

    def write(self, s, c0, c1, k, v, backend):
        write_kv_cache(k, v, self.k, self.v, self.slots(s, c0, c1), backend=backend)

    def slots(self, s, c0, c1):
        pos = torch.arange(c0, c1, device=self.device)
        return self.table[s].long()[pos // self.page] * self.page + pos % self.page

    def step(self, chunks, seqs, backend):
        """One batched step: ``chunks`` = [(seq, c0, c1)]; writes their KV, then attends."""
        k, v = (torch.cat([seqs[s][i][c0:c1] for s, c0, c1 in chunks]) for i in (1, 2))
        slots = torch.cat([self.slots(s, c0, c1) for s, c0, c1 in chunks])
        write_kv_cache(k, v, self.k, self.v, slots, backend=backend)
        q = torch.cat([seqs[s][0][c0:c1] for s, c0, c1 in chunks])
        qsl = [0]
        for _, c0, c1 in chunks:
            qsl.append(qsl[-1] + c1 - c0)
        ids = [s for s, _, _ in chunks]
        return paged_attention(
            q,
            self.k,
            self.v,
            self.table[ids],
            torch.tensor([c1 for _, _, c1 in chunks], dtype=torch.int32, device=self.device),
            torch.tensor(qsl, dtype=torch.int32, device=self.device),
            backend=backend,
        )


def _prefill(seqs, backend):
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    offs = [0]
    for s in seqs:
        offs.append(offs[-1] + s[0].shape[0])
    cu = torch.tensor(offs, dtype=torch.int32, device=q.device)
    out = attention(q, k, v, cu, backend=backend)
    return [out[a:b] for a, b in zip(offs, offs[1:])]


# chunk 1 = token-by-token decode from the first token; chunk 1000 needs a long sequence
PATHS = [(1, 16), (1, 32), (7, 16), (7, 32), (64, 16), (64, 32), (128, 16), (128, 32), (1000, 32)]


@pytest.mark.parametrize("chunk, page", PATHS, ids=[f"chunk{c}-page{p}" for c, p in PATHS])
def test_chunked_prefill_and_decode_equal_full_prefill(case, chunk, page):
    device, backend, dtype = case
    if backend == "triton_split" and device == "cpu" and (chunk in (128, 1000) or page == 32):
        pytest.skip("interpreter time: chunks 1, 7, 64 with pages of 16 cross the split bounds")
    n = {1: 80, 1000: 1030}.get(chunk, 200)
    heads = (1, 1) if chunk == 1000 else (HQ, HKV)  # keep the long case cheap on the CPU
    seq = _seq(n, dtype, device, seed=chunk, heads=heads)
    (full,) = _prefill([seq], backend)
    cache = PagedCache([n], page, dtype, device, seed=page, hkv=heads[1])
    outs = [cache.step([(0, c0, min(n, c0 + chunk))], [seq], backend) for c0 in range(0, n, chunk)]
    assert_bitwise(torch.cat(outs), full, f"chunk {chunk}, page {page} vs full prefill")


def test_mixed_batches_equal_prefill(case):
    """Steps that mix prefill chunks and decode tokens of several sequences (continuous batching)
    give every token the bits of its sequence's prefill, alone or packed with others."""
    device, backend, dtype = case
    lens = [80, 1, 70, 100]
    seqs = [_seq(n, dtype, device, seed=100 + i) for i, n in enumerate(lens)]
    ref = _prefill(seqs, backend)
    for i, s in enumerate(seqs):  # prefill batch composition
        assert_bitwise(_prefill([s], backend)[0], ref[i], f"seq {i} alone vs packed prefill")
    assert_bitwise(
        _prefill([seqs[2], seqs[0]], backend)[1], ref[0], "seq 0 after seq 2 in the batch"
    )
    for page in (16,) if device == "cpu" else (16, 32):  # pages of 32: test above
        cache = PagedCache(lens, page, dtype, device, seed=page + 1)
        done = [0] * len(lens)
        got = [[] for _ in lens]
        # chunk budget per step differs per sequence; decode once a sequence has 64 tokens
        budget = {0: 37, 1: 1, 2: 64, 3: 45}
        while any(d < n for d, n in zip(done, lens)):
            chunks = []
            for s, n in enumerate(lens):
                if done[s] < n:
                    c = 1 if done[s] >= 64 else budget[s]
                    chunks.append((s, done[s], min(n, done[s] + c)))
            out = cache.step(chunks, seqs, backend)
            i = 0
            for s, c0, c1 in chunks:
                got[s].append(out[i : i + c1 - c0])
                i += c1 - c0
                done[s] = c1
        for s in range(len(lens)):
            assert_bitwise(torch.cat(got[s]), ref[s], f"page {page}: seq {s} mixed vs prefill")


def test_decode_alone_equals_decode_in_batch(case):
    """One decode step of a sequence: alone, or with other sequences (in any order) in the batch."""
    device, backend, dtype = case
    lens = [129, 64, 3]
    seqs = [_seq(n, dtype, device, seed=200 + i) for i, n in enumerate(lens)]
    cache = PagedCache(lens, 16, dtype, device, seed=5)
    for s, n in enumerate(lens):
        cache.write(s, 0, n, seqs[s][1], seqs[s][2], backend)

    def decode(order):
        q = torch.cat([seqs[s][0][lens[s] - 1 :] for s in order])
        return paged_attention(
            q,
            cache.k,
            cache.v,
            cache.table[order],
            torch.tensor([lens[s] for s in order], dtype=torch.int32, device=device),
            torch.arange(len(order) + 1, dtype=torch.int32, device=device),
            backend=backend,
        )

    batch = decode([0, 1, 2])
    for s in range(3):
        assert_bitwise(decode([s]), batch[s : s + 1], f"seq {s} decode alone vs in batch")
    assert_bitwise(decode([2, 0])[1:], batch[:1], "seq 0 decode, other order")


@pytest.mark.parametrize(
    "case", [c for c in provider_cases(_dtypes) if c.values[0][1] == "triton_split"], indirect=True
)
def test_split_family_one_pass_and_split_programs_agree(case, monkeypatch):
    """The split family's two schedules of a paged call (split programs + combine, or one pass
    merging the splits in order) give the same bits; and the split family is not the one-pass
    family (its own numerics id)."""
    device, backend, dtype = case
    from rl_engine.ops.attention import triton as at

    lens = [300, 129, 7]
    seqs = [_seq(n, dtype, device, seed=300 + i) for i, n in enumerate(lens)]
    cache = PagedCache(lens, 16, dtype, device, seed=9)
    for s, n in enumerate(lens):
        cache.write(s, 0, n - 2, seqs[s][1][: n - 2], seqs[s][2][: n - 2], backend)
    chunks = [(s, n - 2, n) for s, n in enumerate(lens)]  # 2 tokens each: 6 query rows
    split_programs = cache.step(chunks, seqs, backend)
    monkeypatch.setattr(at, "SPLIT_PARTIAL_BYTES", 0)  # the one-pass kernel for this call
    one_pass = cache.step(chunks, seqs, backend)
    assert_bitwise(split_programs, one_pass, "split programs + combine vs one pass")
    ref = _prefill(seqs, backend)
    want = torch.cat([ref[s][n - 2 :] for s, n in enumerate(lens)])
    assert_bitwise(split_programs, want, "decode rows vs the family's prefill")
    p = KernelRegistry.provider("attention", "triton_split")
    assert p.numerics != KernelRegistry.provider("attention", "triton").numerics
