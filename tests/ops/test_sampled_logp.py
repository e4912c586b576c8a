"""sampled_logp / logp_at: a rollout's per-row-temperature log-probs are bitwise ``logp`` of each
row at its own temperature (every invariant provider), ranks as vLLM counts them, errors.

The Triton provider runs on a CUDA device, or in the interpreter on the CPU
(``TRITON_INTERPRET=1``); the native provider everywhere.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops import logp
from rl_engine.ops.logp import logp_at, sampled_logp
from rl_engine.ops.logp import triton as lp_triton
from rl_engine.ops.logp.reference import VOCAB_TILE
from rl_engine.testing.invariance import assert_bitwise
from tests.conftest import backend_fixture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TEMPS = [0.7, 1.0, 1e-3, 100.0, 0.7, 1.3, 1.0]


backend = backend_fixture("logp", DEVICE)


def _case(rows, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
    x[:, 5] = x[:, 3]  # a tie with another column (rank counts strictly greater only)
    tok = torch.randint(0, vocab, (rows,), generator=g)
    tok[0] = 3
    temps = torch.tensor([TEMPS[i % len(TEMPS)] for i in range(rows)], dtype=torch.float32)
    return x.to(DEVICE), tok.to(DEVICE), temps.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 2 * VOCAB_TILE + 77])
def test_each_row_is_logp_at_its_temperature(backend, dtype, vocab):
    x, tok, temps = _case(9, vocab, dtype)
    lp, lse, rank = sampled_logp(x, tok, temps, backend=backend)
    assert lp.dtype == lse.dtype == torch.float32 and rank.dtype == torch.int64
    for t in range(x.shape[0]):
        one = logp(x[t : t + 1], tok[t : t + 1], float(temps[t]), backend=backend)
        assert_bitwise(lp[t : t + 1], one, f"row {t} at T={float(temps[t])}")
    # a batch at one temperature gives the same bits as rows of mixed temperatures
    same = temps == 0.7
    whole = logp(x, tok, 0.7, backend=backend)
    assert_bitwise(lp[same], whole[same], "rows at T=0.7 vs a batch at 0.7")
    # vLLM's rank: 1 + #(z > z[token]) over the scaled logits (elementwise ops and a count)
    z = x.float() / temps[:, None]
    want = (z > z.gather(1, tok[:, None])).sum(-1) + 1
    assert torch.equal(rank, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logp_at_is_logp_of_the_column(backend, dtype):
    x, tok, temps = _case(6, VOCAB_TILE + 33, dtype, seed=1)
    _, lse, _ = sampled_logp(x, tok, temps, backend=backend)
    top = torch.topk(x, 3, dim=-1).indices
    vals = logp_at(x, top, temps, lse)
    for t in range(x.shape[0]):
        for j in range(3):
            one = logp(x[t : t + 1], top[t, j : j + 1], float(temps[t]), backend=backend)
            assert_bitwise(vals[t, j : j + 1], one, f"row {t}, top-{j}")


def test_row_invariant_and_int32(backend):
    x, tok, temps = _case(13, 2 * VOCAB_TILE + 5, torch.float16, seed=2)
    full = sampled_logp(x, tok, temps, backend=backend)
    part = sampled_logp(x[4:9], tok[4:9].int(), temps[4:9], backend=backend)
    for a, b, what in zip(full, part, ("logp", "lse", "rank"), strict=True):
        assert_bitwise(a[4:9], b, what)


def test_triton_segments_and_rank(backend):
    if backend != "triton":
        pytest.skip("the Triton provider's vocabulary segments")
    x, tok, temps = _case(3, lp_triton.SEGMENT + 77, torch.float32, seed=3)
    lp, _, rank = sampled_logp(x, tok, temps, backend=backend)
    for t in range(3):
        assert_bitwise(lp[t : t + 1], logp(x[t : t + 1], tok[t : t + 1], float(temps[t])), "")
    z = x / temps[:, None]
    assert torch.equal(rank, (z > z.gather(1, tok[:, None])).sum(-1) + 1)


@pytest.mark.parametrize(
    "temps, exc, match",
    [
        (torch.ones(4, dtype=torch.float64), TypeError, "float32"),
        (torch.ones(3), ValueError, "one per row"),
        (torch.ones(4, 1), ValueError, "temperatures"),
    ],
)
def test_errors(temps, exc, match):
    x = torch.randn(4, 10, device=DEVICE)
    tok = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(exc, match=match):
        sampled_logp(x, tok, temps.to(DEVICE), backend="native")


def test_token_range_checked_unless_told():
    x = torch.randn(2, 10)
    temps = torch.ones(2)
    with pytest.raises(ValueError, match="token ids"):
        sampled_logp(x, torch.tensor([0, 10]), temps, backend="native")
    sampled_logp(x, torch.tensor([0, 9]), temps, backend="native", check_range=False)
