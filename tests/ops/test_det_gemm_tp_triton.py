"""The TP reduction's one-launch Triton subtree kernel: all of a rank's group products and
their pair tree in one kernel, bitwise (``torch.equal``) the bits of the reference path it
replaces, ``tp.subtree_per_group`` (one ``det_gemm_wgrad`` launch per group, ``torch.stack``,
``pair_tree``).

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``, scripts/test.sh; fp32 /
fp16) and skip otherwise; on a CUDA device they run on the GPU (bf16 too).
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops.det_gemm import config as gemm_config
from rl_engine.ops.det_gemm import tp as tpm
from rl_engine.ops.det_gemm import triton as gemm_triton
from tests.conftest import DEVICE, TRITON_DTYPES, skip_unless_triton

pytestmark = skip_unless_triton(gemm_triton)


def _shard(m, k, n, dtype, seed=0, layout="linear"):
    """``a [m, k]``, ``b [k, n]``: ``b`` as a row-parallel layer passes it (``weight.t()``,
    K-contiguous) or, ``layout="kn"``, N-contiguous (the column-parallel input gradient's
    ``weight``); ``a`` transposed-strided for ``layout="strided"``."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    if layout == "strided":
        a = a.t().contiguous().t()
    b = w.t().contiguous() if layout == "kn" else w.t()
    return a.to(DEVICE), b.to(DEVICE)


# ------------------------------------------------------------------- one-launch group subtree
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize(
    "m,k,n,groups,glu,layout",
    [
        (1, 64, 24, 8, False, "linear"),  # decode: one row, 8 groups of 8 (TP 1)
        (17, 96, 40, 4, False, "linear"),  # TP 2's 4 groups, odd rows and columns
        (33, 64, 16, 2, False, "kn"),  # TP 4's 2 groups, N-contiguous b
        (5, 72, 12, 8, False, "strided"),  # groups of 9: masked K tail in every group
        (7, 48, 8, 1, False, "linear"),  # TP 8: one group, no tree
        (9, 128, 24, 4, True, "kn"),  # GLU (Megatron's [gate; up] column-parallel dx)
        (3, 96, 16, 2, True, "linear"),  # GLU, gate/up blocks of 24: a step straddles them
    ],
)
def test_subtree_one_launch_equals_per_group(m, k, n, groups, glu, layout, dtype):
    """The one-launch kernel == the per-group launches + stack + pair_tree, bitwise; and
    ``tp.subtree`` (what every adapter calls) takes the one-launch kernel for Triton."""
    a, b = _shard(m, k, n, dtype, seed=m + k, layout=layout)
    want = tpm.subtree_per_group(a, b, groups, glu=glu, backend="triton")
    got = gemm_triton.det_gemm_tp_subtree(a, b, groups, glu=glu)
    assert got.dtype == torch.float32
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(tpm.subtree(a, b, groups, glu=glu, backend="triton"), want)


def test_subtree_one_launch_every_config_equal():
    """Every config of the launch table (tile shape, warps, stages) gives the same bits."""
    dtype = TRITON_DTYPES[-1]
    a, b = _shard(21, 128, 40, dtype, seed=3)
    want = tpm.subtree_per_group(a, b, 4, backend="triton")
    for cfg in gemm_config.all_tp_subtree_configs(dtype):
        got = gemm_triton.det_gemm_tp_subtree(a, b, 4, cfg=cfg)
        assert torch.equal(got, want), cfg


def test_subtree_one_launch_across_chunks():
    """A group longer than ``WGRAD_CHUNK``: the chunk partials of the weight-gradient order
    (fresh fp32 partial per 4096 positions of the group, in order), GLU included."""
    chunk = gemm_config.WGRAD_CHUNK
    for k, groups, glu in ((2 * (chunk + 32), 2, False), (2 * (chunk // 2 + 48), 1, True)):
        a, b = _shard(2, k, 8, torch.float32, seed=k)
        want = tpm.subtree_per_group(a, b, groups, glu=glu, backend="triton")
        assert torch.equal(gemm_triton.det_gemm_tp_subtree(a, b, groups, glu=glu), want)


def test_subtree_one_launch_rows_invariant_and_out():
    """Rows are batch invariant (a row alone == in 23 rows); ``out`` (a strided fp32 view, as
    an exchange's buffer) receives the same bits."""
    a, b = _shard(23, 64, 24, torch.float32, seed=9)
    full = gemm_triton.det_gemm_tp_subtree(a, b, 8)
    for rows in (slice(0, 1), slice(4, 21), slice(22, 23)):
        assert torch.equal(gemm_triton.det_gemm_tp_subtree(a[rows], b, 8), full[rows])
    big = torch.full((23, 48), float("nan"), device=DEVICE)
    out = big[:, 8:32]
    res = gemm_triton.det_gemm_tp_subtree(a, b, 8, out=out)
    assert res.data_ptr() == out.data_ptr() and torch.equal(out, full)
    assert big[:, :8].isnan().all() and big[:, 32:].isnan().all()  # nothing outside out


def test_subtree_tree_order_is_checked():
    """The control: the same group products added left to right (not the pair tree) differ,
    so the equality tests above can fail on a wrong combine order."""
    a, b = _shard(32, 64, 32, torch.float32, seed=5)
    parts = [tpm.subtree_per_group(a[:, i : i + 8], b[i : i + 8], 1, backend="triton")
             for i in range(0, 64, 8)]  # fmt: skip
    left_to_right = parts[0]
    for p in parts[1:]:
        left_to_right = left_to_right + p
    tree = gemm_triton.det_gemm_tp_subtree(a, b, 8)
    assert torch.equal(tree, tpm.pair_tree(torch.stack(parts)))
    assert not torch.equal(tree, left_to_right)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_subtree_one_launch_shards_equal_tp1(tp):
    """Each rank's one-launch subtree, combined in rank order, == TP 1's one-launch result."""
    a, b = _shard(13, 128, 24, TRITON_DTYPES[-1], seed=tp)
    full = gemm_triton.det_gemm_tp_subtree(a, b, 8)
    s = 128 // tp
    subs = [gemm_triton.det_gemm_tp_subtree(a[:, r * s : (r + 1) * s], b[r * s : (r + 1) * s],
                                           8 // tp) for r in range(tp)]  # fmt: skip
    assert torch.equal(tpm.combine(subs), full)


def test_subtree_one_launch_errors():
    a, b = _shard(4, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        gemm_triton.det_gemm_tp_subtree(a, b, 3)
    with pytest.raises(ValueError, match="power of two"):
        gemm_triton.det_gemm_tp_subtree(a, b, 64)
    with pytest.raises(ValueError, match="do not split"):
        gemm_triton.det_gemm_tp_subtree(a[:, :60], b[:60], 8)
    with pytest.raises(ValueError, match="do not multiply"):
        gemm_triton.det_gemm_tp_subtree(a, b[:32], 8)
    with pytest.raises(TypeError, match="dtypes"):
        gemm_triton.det_gemm_tp_subtree(a, b.half(), 8)
    with pytest.raises(ValueError, match="out must be fp32"):
        gemm_triton.det_gemm_tp_subtree(a, b, 8, out=torch.empty(4, 8, dtype=torch.float16))
    empty = gemm_triton.det_gemm_tp_subtree(a[:0], b, 8)
    assert empty.shape == (0, 8)
