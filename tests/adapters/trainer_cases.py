"""Shared inputs of the trainer-adapter tests: variable-length sequences in three layouts."""

from __future__ import annotations

import torch

LENGTHS = (13, 5, 9, 3, 11)  # five sequences of different lengths
VOCAB = 512  # the tiny models' vocabulary


def sequences(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def right_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s
        mask[i, : s.numel()] = 1
    return ids, mask


def left_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, t - s.numel() :] = s
        mask[i, t - s.numel() :] = 1
    return ids, mask


def packed(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([s.numel() for s in seqs]), 0)
    return torch.cat(seqs), cu


def per_seq_from_right(lp: torch.Tensor, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [lp[i, : s.numel() - 1] for i, s in enumerate(seqs)]


def per_seq_from_left(lp: torch.Tensor, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    t = lp.shape[1] + 1
    return [lp[i, t - s.numel() :] for i, s in enumerate(seqs)]


def per_seq_from_packed(lp: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
    return [lp[int(cu[i]) : int(cu[i + 1]) - 1] for i in range(cu.numel() - 1)]


def micro_batched(fn, seqs: list[torch.Tensor], mbs: int) -> list[torch.Tensor]:
    """Run ``fn(ids, mask)`` on right-padded micro-batches of ``mbs`` sequences."""
    out: list[torch.Tensor] = []
    for i in range(0, len(seqs), mbs):
        chunk = seqs[i : i + mbs]
        ids, mask = right_padded(chunk)
        out.extend(per_seq_from_right(fn(ids, mask), chunk))
    return out


def assert_lists_bitwise(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    from rl_engine.testing.invariance import assert_bitwise

    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bitwise(x, y, f"{what}: sequence {i}")


def count_mismatches(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int((x != y).sum()) for x, y in zip(a, b))
