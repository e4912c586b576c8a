"""``rl_engine.audit.DriftMonitor``: known values, masks, bins, one host sync, invariance, errors."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl_engine.audit import METRIC_DOCS, METRIC_NAMES, DriftMonitor


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Bitwise-equal metric dicts (NaN == NaN)."""
    if list(a) != list(b):
        return False
    return all(
        (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))
        for x, y in zip(a.values(), b.values())
    )


def _random(b: int, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(b, t, generator=g) * 4
    train = roll + torch.randn(b, t, generator=g) * 0.05
    train[:, ::3] = roll[:, ::3]  # some exact matches
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return roll, train, mask


def test_identical_inputs_are_all_zero_drift():
    roll, _, mask = _random(4, 9)
    out = DriftMonitor()(roll, roll.clone(), mask)
    n = float(mask.sum())
    assert out["tokens"] == n
    assert out["sequences"] == 4.0
    for k in (
        "abs_diff_mean",
        "abs_diff_std",
        "abs_diff_max",
        "abs_diff_seq_mean",
        "abs_diff_gt_ln2_frac",
        "kl_k1",
        "kl_k2",
        "kl_k3",
        "chi2_token",
        "chi2_seq",
        "is_ratio_std",
    ):
        assert out[k] == 0.0, k
    for k in ("bitwise_equal_frac", "exp_abs_diff_mean", "ppl_ratio"):
        assert out[k] == 1.0, k
    for k in ("is_ratio_mean", "is_ratio_min", "is_ratio_max"):
        assert out[k] == 1.0, k
    assert out["ppl_rollout"] == out["ppl_trainer"]
    assert out["pos_0_128/bitwise_equal_frac"] == 1.0
    assert out["pos_0_128/tokens"] == n


def test_hand_computed_values():
    nan, inf = math.nan, math.inf
    roll = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, nan]])
    train = torch.tensor([[-1.0, -1.0, -4.0], [-1.5, -1.0, inf]])  # masked-out NaN / inf ignored
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    r = [0.0, 1.0, -1.0, -0.5, 0.0]  # r = trainer - rollout over the masked tokens
    n = len(r)
    out = DriftMonitor()(roll, train, mask)

    def mean(xs):
        return sum(xs) / len(xs)

    a = [abs(x) for x in r]
    w = [math.exp(x) for x in r]
    approx = dict(rel=1e-6, abs=1e-12)
    assert out["tokens"] == 5.0 and out["sequences"] == 2.0
    assert out["abs_diff_mean"] == pytest.approx(0.5, **approx)
    assert out["abs_diff_std"] == pytest.approx(math.sqrt(0.2), **approx)
    assert out["abs_diff_max"] == 1.0
    assert out["abs_diff_seq_mean"] == pytest.approx((2 / 3 + 0.25) / 2, **approx)
    assert out["abs_diff_gt_ln2_frac"] == pytest.approx(2 / 5)
    assert out["exp_abs_diff_mean"] == pytest.approx(mean([math.exp(x) for x in a]), **approx)
    assert out["bitwise_equal_frac"] == pytest.approx(2 / 5)
    assert out["kl_k1"] == pytest.approx(0.1, **approx)  # mean(-r) = 0.5 / 5
    assert out["kl_k2"] == pytest.approx(mean([x * x / 2 for x in r]), **approx)
    assert out["kl_k3"] == pytest.approx(mean([math.exp(x) - 1 - x for x in r]), **approx)
    assert out["chi2_token"] == pytest.approx(mean([(math.exp(x) - 1) ** 2 for x in r]), **approx)
    # sequences: S = 0 and S = -0.5
    assert out["chi2_seq"] == pytest.approx(((math.exp(-0.5) - 1) ** 2) / 2, **approx)
    assert out["ppl_rollout"] == pytest.approx(math.exp(8 / 5), **approx)
    assert out["ppl_trainer"] == pytest.approx(math.exp(8.5 / 5), **approx)
    assert out["ppl_ratio"] == pytest.approx(math.exp(0.1), **approx)  # = exp(k1)
    w_mean = mean(w)
    assert out["is_ratio_mean"] == pytest.approx(w_mean, **approx)
    assert out["is_ratio_std"] == pytest.approx(
        math.sqrt(mean([(x - w_mean) ** 2 for x in w])), **approx
    )
    assert out["is_ratio_min"] == pytest.approx(math.exp(-1), **approx)
    assert out["is_ratio_max"] == pytest.approx(math.e, **approx)
    assert n == out["tokens"]


def test_importance_ratio_is_not_clamped():
    roll = torch.tensor([[-40.0, -1.0]])
    train = torch.tensor([[-10.0, -1.0]])  # r = 30: verl-style clamps would stop at exp(20)
    out = DriftMonitor()(roll, train)
    assert out["is_ratio_max"] == pytest.approx(math.exp(30.0), rel=1e-6)
    assert out["abs_diff_gt_ln2_frac"] == 0.5


def test_mask_kinds_agree_and_none_means_all():
    roll, train, mask = _random(3, 8, seed=1)
    mon = DriftMonitor()
    ref = mon(roll, train, mask)
    assert _same(ref, mon(roll, train, mask.to(torch.int64)))
    assert _same(ref, mon(roll, train, mask.to(torch.float32)))
    # garbage at masked-out positions changes nothing
    roll2, train2 = roll.clone(), train.clone()
    roll2[~mask] = math.nan
    train2[~mask] = -math.inf
    assert _same(ref, mon(roll2, train2, mask))
    full = torch.ones_like(mask)
    assert _same(mon(roll, train, full), mon(roll, train, None))


def test_bins_hand_computed():
    r = torch.tensor([[0.0, 0.25, 0.5, 1.0, 2.0, 7.0], [0.5, 0.0, 3.0, 3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    roll = torch.full((2, 6), -3.0)
    mon = DriftMonitor(position_bins=(0, 2, 4), seqlen_bins=(0, 3), prefix="d/")
    out = mon(roll, roll + r, mask)
    assert list(out) == list(mon.names)
    expect = {
        "d/pos_0_2/tokens": 4.0,
        "d/pos_0_2/abs_diff_mean": 0.1875,
        "d/pos_0_2/bitwise_equal_frac": 0.5,
        "d/pos_2_4/tokens": 2.0,
        "d/pos_2_4/abs_diff_mean": 0.75,
        "d/pos_2_4/bitwise_equal_frac": 0.0,
        "d/pos_4_inf/tokens": 1.0,
        "d/pos_4_inf/abs_diff_mean": 2.0,
        "d/seqlen_0_3/sequences": 1.0,
        "d/seqlen_0_3/tokens": 2.0,
        "d/seqlen_0_3/abs_diff_mean": 0.25,
        "d/seqlen_0_3/bitwise_equal_frac": 0.5,
        "d/seqlen_3_inf/sequences": 1.0,
        "d/seqlen_3_inf/tokens": 5.0,
        "d/seqlen_3_inf/abs_diff_mean": 0.75,
        "d/seqlen_3_inf/bitwise_equal_frac": 0.2,
    }
    for k, v in expect.items():
        assert out[k] == pytest.approx(v, rel=1e-12), k

    def k3(xs):
        return sum(math.exp(x) - 1 - x for x in xs) / len(xs)

    assert out["d/pos_0_2/kl_k3"] == pytest.approx(k3([0, 0.25, 0.5, 0]), rel=1e-6)
    assert out["d/pos_4_inf/kl_k3"] == pytest.approx(k3([2.0]), rel=1e-6)
    assert out["d/seqlen_3_inf/kl_k3"] == pytest.approx(k3([0, 0.25, 0.5, 1, 2]), rel=1e-6)


def test_empty_bin_reads_zero_tokens_and_nan():
    roll, train, mask = _random(2, 6, seed=2)
    out = DriftMonitor(position_bins=(0, 2, 100), seqlen_bins=None)(roll, train, mask)
    assert out["pos_100_inf/tokens"] == 0.0
    assert math.isnan(out["pos_100_inf/abs_diff_mean"])
    assert math.isnan(out["pos_100_inf/bitwise_equal_frac"])
    assert not any(k.startswith("seqlen_") for k in out)
    assert out["pos_0_2/tokens"] + out["pos_2_100/tokens"] == out["tokens"]


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def test_one_host_sync_no_item_calls():
    roll, train, mask = _random(4, 10, seed=3)
    mon = DriftMonitor()
    with _CountOps() as counter:
        out = mon(roll, train, mask.to(torch.int32))
    assert out["tokens"] == float(mask.sum())
    assert sum(counter.ops.values()) > 50  # the mode saw the computation
    assert torch.ops.rl_engine.ratio_kl.default in counter.ops
    # no .item() / float(t) / bool(t): the only transfer is the final .cpu().tolist()
    assert counter.ops[torch.ops.aten._local_scalar_dense.default] == 0
    assert counter.ops[torch.ops.aten.is_nonzero.default] == 0


def test_per_sequence_rows_are_batch_invariant():
    roll, train, mask = _random(5, 13, seed=4)
    mon = DriftMonitor()
    batch = mon.per_sequence(roll, train, mask)
    for i in range(5):
        alone = mon.per_sequence(roll[i : i + 1], train[i : i + 1], mask[i : i + 1])
        for k, v in batch.items():
            assert torch.equal(alone[k], v[i : i + 1]), (i, k)


def test_metrics_of_a_row_alone_equal_it_inside_a_masked_batch():
    roll, train, mask = _random(5, 13, seed=5)
    mon = DriftMonitor(position_bins=(0, 4, 8), seqlen_bins=(0, 6))
    for i in range(5):
        only = torch.zeros_like(mask)
        only[i] = mask[i]
        alone = mon(roll[i : i + 1], train[i : i + 1], mask[i : i + 1])
        assert _same(alone, mon(roll, train, only)), i


def test_right_padding_and_appended_rows_change_nothing():
    roll, train, mask = _random(5, 11, seed=6)
    mon = DriftMonitor(position_bins=(0, 4, 8), seqlen_bins=(0, 5))
    ref = mon(roll, train, mask)
    pad_t, pad_b = 6, 3
    g = torch.Generator().manual_seed(7)
    roll_p = -torch.rand(5 + pad_b, 11 + pad_t, generator=g)
    train_p = -torch.rand(5 + pad_b, 11 + pad_t, generator=g)
    mask_p = torch.zeros(5 + pad_b, 11 + pad_t, dtype=torch.bool)
    roll_p[:5, :11], train_p[:5, :11], mask_p[:5, :11] = roll, train, mask
    assert _same(ref, mon(roll_p, train_p, mask_p))


def test_bf16_inputs_and_grad_inputs():
    roll, train, mask = _random(2, 5, seed=8)
    out = DriftMonitor()(roll.bfloat16(), roll.bfloat16(), mask)
    assert out["bitwise_equal_frac"] == 1.0
    t = train.clone().requires_grad_(True)
    assert DriftMonitor()(roll, t, mask)["tokens"] == float(mask.sum())


def _bad_inputs():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    return [
        ((x, torch.zeros(2, 4), m), ValueError, "shape"),
        ((x, x, torch.ones(3, 2, dtype=torch.bool)), ValueError, "mask has shape"),
        ((torch.zeros(6), torch.zeros(6), None), ValueError, r"\[B, T\]"),
        ((x, x.double(), m), TypeError, "dtype"),
        ((x, x.half(), m), TypeError, "one dtype"),
        ((x.long(), x.long(), m), TypeError, "dtype"),
        ((x, [[0.0] * 3] * 2, m), TypeError, "torch.Tensor"),
        ((x, x, m.to("meta")), ValueError, "one device"),
        ((torch.zeros(0, 3), torch.zeros(0, 3), None), ValueError, "no tokens"),
        ((x, x, torch.zeros(2, 3, dtype=torch.bool)), ValueError, "no tokens"),
        ((x, x, torch.full((2, 3), 2.0)), ValueError, "0 / 1"),
        ((x, x, torch.full((2, 3), math.nan)), ValueError, "0 / 1"),
    ]


@pytest.mark.parametrize("args,exc,match", _bad_inputs())
def test_bad_inputs_raise_clear_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        DriftMonitor()(*args)


def test_non_finite_masked_tokens_raise_with_count():
    roll, train, mask = _random(2, 6, seed=9)
    mask[:, :2] = True
    train[0, 0] = math.nan
    roll[1, 1] = -math.inf
    with pytest.raises(ValueError, match="2 of .* masked tokens have a non-finite"):
        DriftMonitor()(roll, train, mask)


@pytest.mark.parametrize(
    "bins,exc",
    [((1, 5), ValueError), ((0, 5, 5), ValueError), ((0, 2.5), TypeError), ((0, True), TypeError)],
)
def test_bad_bins(bins, exc):
    with pytest.raises(exc):
        DriftMonitor(position_bins=bins)


def test_metric_names_mapping():
    assert list(METRIC_NAMES) == list(METRIC_DOCS)
    mon = DriftMonitor(position_bins=None, seqlen_bins=None)
    assert list(mon.names) == list(METRIC_DOCS)
    frameworks = {f for names in METRIC_NAMES.values() for f in names}
    assert frameworks == {"verl", "skyrl", "slime", "nemo_rl"}
    assert METRIC_NAMES["abs_diff_mean"]["skyrl"].endswith("rollout_train_logprobs_abs_diff_mean")
    assert METRIC_NAMES["kl_k3"]["nemo_rl"].endswith("gen_kl_error")
    assert all(
        v.startswith("rollout_corr/")
        for m in METRIC_NAMES.values()
        for f, v in m.items()
        if f == "verl"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_matches_the_cpu_and_is_batch_invariant():
    """On CUDA tensors (the registry's GPU ``ratio_kl``): the counts and the bitwise fraction as
    on the CPU, every metric within float64 rounding of the per-token fp32 terms, and a row's
    per-sequence metrics alone == in the batch, bitwise."""
    roll, train, mask = _random(6, 300, seed=3)
    mon = DriftMonitor()
    cpu = mon(roll, train, mask)
    gpu = mon(roll.cuda(), train.cuda(), mask.cuda())
    assert list(gpu) == list(cpu)
    for k in ("tokens", "sequences", "bitwise_equal_frac", "abs_diff_max"):
        assert gpu[k] == cpu[k], k
    for k, v in cpu.items():
        if math.isnan(v):
            assert math.isnan(gpu[k]), k
        else:
            assert gpu[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    roll, train, mask = roll.cuda(), train.cuda(), mask.cuda()
    per_seq = mon.per_sequence(roll, train, mask)
    for i in range(6):
        alone = mon.per_sequence(roll[i : i + 1], train[i : i + 1], mask[i : i + 1])
        for k, v in per_seq.items():
            assert torch.equal(alone[k], v[i : i + 1]), (i, k)
        only = torch.zeros_like(mask)
        only[i] = mask[i]
        assert _same(
            mon(roll[i : i + 1], train[i : i + 1], mask[i : i + 1]), mon(roll, train, only)
        )
