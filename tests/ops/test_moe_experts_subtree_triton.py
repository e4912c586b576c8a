"""The Triton ``moe_experts`` provider's ``subtree`` extra: the experts' down projection as a
rank's fp32 subtree of the TP-invariant reduction (expert tensor parallelism).

Contract: for every slot ``(t, s)`` with local expert ``e``, ``out[t, s]`` is bitwise
``det_gemm.tp.subtree(a_rows, w2[e].T, groups, backend="triton")`` where ``a_rows`` is the
activation the provider's forward computes (det_gemm gate / up then silu_and_mul, Triton, model
dtype: here computed independently through those providers); +0 rows for non-local experts;
whatever the batch, the routing or the tile config; a rank's shard (``[gate_r; up_r]``,
``w2[:, :, r-th slice]``, ``groups / t``) gives that rank's subtree, and the ranks' subtrees
combine to the one-device bits.

On the CPU these run in the Triton interpreter (``TRITON_INTERPRET=1``, scripts/test.sh). There
bf16 is included for the subtree contract (both sides go through the interpreter's rounding),
but not for ``groups=1 rounded == the forward``: the interpreter rounds the forward's fp32 ->
bf16 store by truncation, torch's ``.to`` to nearest even. On a CUDA device they run on the GPU,
with the model-shape and CUDA-graph checks.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine import KernelRegistry
from rl_engine.ops.det_gemm import tp
from rl_engine.ops.det_gemm import triton as gemm_triton
from rl_engine.ops.moe_experts import triton as mt
from rl_engine.ops.silu_and_mul import triton as act_triton
from rl_engine.testing.invariance import assert_bitwise
from tests.conftest import DEVICE, gpu, skip_unless_triton
from tests.ops.test_moe_experts_triton import _inputs, _weights, graph_replays

pytestmark = skip_unless_triton(mt)

E, K, H, FFN = 4, 2, 64, 128  # experts, top-k, hidden, expert FFN (interpreter-sized)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _act(x, w13, e):
    """Expert ``e``'s activation rows of ``x`` through the det_gemm / silu_and_mul providers."""
    return act_triton.silu_and_mul(gemm_triton.det_gemm(x, w13[e].t()))


def _check_contract(x, ids, w13, w2, groups, out, expert_map=None, experts=None):
    """Every slot's row of ``out`` == ``tp.subtree`` of its expert's activation rows (one
    call per expert: the subtree kernel is row invariant, its own suite proves it); non-local
    slots +0 (sign bit clear)."""
    local = ids if expert_map is None else expert_map[ids]
    assert out.shape == (*ids.shape, x.shape[1]) and out.dtype == torch.float32
    for e in range(w13.shape[0]) if experts is None else experts:
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        if tok.numel():
            want = tp.subtree(_act(x[tok], w13, e), w2[e].t(), groups, backend="triton")
            assert_bitwise(out[tok, slot], want, f"expert {e}'s rows, {groups} groups")
    off = out[local < 0]
    assert not bool(off.ne(0).any() or off.signbit().any()), "non-local rows must be +0"


def _shard(w13, w2, rank, world):
    """Rank ``rank``'s expert-TP shard: ``[gate_r; up_r]`` and the ``r``-th column block of
    ``w2`` (a strided view)."""
    i = w2.shape[2]
    c = i // world
    sl = slice(rank * c, (rank + 1) * c)
    w13_r = torch.cat([w13[:, :i][:, sl], w13[:, i:][:, sl]], dim=1)
    return w13_r, w2[:, :, sl]


# ------------------------------------------------------------------------------ the contract
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 2, 4, 8])
def test_rows_equal_tp_subtree(groups, dtype):
    w13, w2 = _weights(dtype, e=E, h=H, i=FFN)
    x, ids = _inputs(13, dtype, e=E, k=K, h=H)
    out = mt.moe_experts_subtree(x, ids, w13, w2, groups)
    _check_contract(x, ids, w13, w2, groups, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_group_rounded_is_the_forward(dtype):
    """``groups=1`` rounded once == the forward's rows: the activation the subtree reads is the
    forward's, and one group's product (det_gemm_wgrad's order: ``0 + chunk``) is the
    forward's down GEMM (det_gemm's order: the chunk itself) up to the sign of a zero."""
    w13, w2 = _weights(dtype, e=E, h=H, i=FFN)
    x, ids = _inputs(13, dtype, e=E, k=K, h=H)
    y = mt.moe_experts(x, ids, w13, w2)
    assert_bitwise(mt.moe_experts_subtree(x, ids, w13, w2, 1).to(dtype), y, "groups=1 rounded")


def test_the_check_can_fail():
    """Negative control: 8 groups are not the bits of 2 groups, nor of one product. (Not 4:
    with ``FFN / 8`` = 16 columns a group, one K step in the interpreter, a 4-group product is
    ``(0 + d0) + d1`` over two such steps: exactly the first tree level of 8 groups.)"""
    dtype = torch.float32
    w13, w2 = _weights(dtype, e=E, h=H, i=FFN)
    x, ids = _inputs(5, dtype, e=E, k=K, h=H)
    out = mt.moe_experts_subtree(x, ids, w13, w2, 8)
    for other in (2, 1):
        with pytest.raises(AssertionError, match="not bitwise equal"):
            _check_contract(x, ids, w13, w2, other, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 4])
def test_rank_shards(world, dtype):
    """Each rank's shard (``I / t`` of every expert, ``8 / t`` groups) gives its subtree of
    its activation slice, and the ranks' subtrees combine to the one-device 8-group bits."""
    w13, w2 = _weights(dtype, e=E, h=H, i=FFN)
    x, ids = _inputs(5, dtype, e=E, k=K, h=H)
    full = mt.moe_experts_subtree(x, ids, w13, w2, tp.TP_GROUPS)
    parts = []
    for r in range(world):
        w13_r, w2_r = _shard(w13, w2, r, world)
        out = mt.moe_experts_subtree(x, ids, w13_r, w2_r, tp.TP_GROUPS // world)
        _check_contract(x, ids, w13_r, w2_r, tp.TP_GROUPS // world, out)
        parts.append(out)
    assert_bitwise(tp.combine(parts), full, f"TP {world} ranks combined == one device")


# ------------------------------------------------------------------------ invariance, routing
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_subset_and_config_invariance(dtype):
    """A row alone, a prefix batch and every shipped tile config (``for_subtree`` of each:
    another ``block_m`` alignment, ``block_n``) give the bits of the row in a larger batch
    with other experts' tokens."""
    groups = 4
    w13, w2 = _weights(dtype, e=E, h=H, i=FFN)
    x, ids = _inputs(13, dtype, e=E, k=K, h=H)
    ids[7:] = torch.tensor([3, 1], device=DEVICE)  # a crowded expert next to sparse ones
    out = mt.moe_experts_subtree(x, ids, w13, w2, groups)
    for t in (0, 9):
        alone = mt.moe_experts_subtree(x[t : t + 1], ids[t : t + 1], w13, w2, groups)
        assert_bitwise(alone[0], out[t], f"row {t} alone")
    assert_bitwise(mt.moe_experts_subtree(x[:5], ids[:5], w13, w2, groups), out[:5], "prefix")
    for cfg in mt.all_configs(dtype):
        got = mt.moe_experts_with_config(x, ids, w13, w2, None, cfg, groups=groups)
        assert_bitwise(got, out, f"cfg {cfg} (subtree {cfg.for_subtree(groups)})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_map(dtype):
    """Expert parallelism: +0 rows for the non-local experts, the local ones' rows as with
    every expert local."""
    groups = 2
    w13, w2 = _weights(dtype, e=E, h=H, i=FFN)
    x, ids = _inputs(7, dtype, e=E, k=K, h=H)
    emap = torch.tensor([0, -1, 1, -1], device=DEVICE)
    keep = [0, 2]
    out = mt.moe_experts_subtree(x, ids, w13[keep], w2[keep], groups, emap)
    _check_contract(x, ids, w13[keep], w2[keep], groups, out, emap)
    every = mt.moe_experts_subtree(x, ids, w13, w2, groups)
    mine = emap[ids] >= 0
    assert_bitwise(out[mine], every[mine], "local rows == with every expert local")
    assert bool(mine.any() and (~mine).any())


def test_empty_and_registered():
    w13, w2 = _weights(torch.float32, e=E, h=H, i=FFN)
    x, ids = _inputs(0, torch.float32, e=E, k=K, h=H)
    out = mt.moe_experts_subtree(x, ids, w13, w2, 8)
    assert out.shape == (0, K, H) and out.dtype == torch.float32
    prov = KernelRegistry.provider("moe_experts", "triton")
    assert prov.extras["subtree"] is mt.moe_experts_subtree
    assert prov.numerics == f"moe_experts/triton-kc{mt.K_CHUNK}"  # the forward's family


def test_errors():
    w13, w2 = _weights(torch.float32, e=E, h=H, i=48)
    x, ids = _inputs(3, torch.float32, e=E, k=K, h=H)
    with pytest.raises(ValueError, match="power of two"):
        mt.moe_experts_subtree(x, ids, w13, w2, 3)
    with pytest.raises(ValueError, match="power of two"):
        mt.moe_experts_subtree(x, ids, w13, w2, 0)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        mt.moe_experts_subtree(x, ids, w13, w2, 32)
    w13b, w2b = _weights(torch.float32, e=E, h=H, i=128)
    with pytest.raises(ValueError, match="at most 32"):
        mt.moe_experts_subtree(x, ids, w13b, w2b, 64)
    with pytest.raises(TypeError, match="groups must be an int"):
        mt.moe_experts_subtree(x, ids, w13, w2, 2.0)
    with pytest.raises(TypeError):
        mt.moe_experts_subtree(x.to(torch.int32), ids, w13, w2, 2)
    with pytest.raises(ValueError):
        mt.moe_experts_subtree(x[:2], ids, w13, w2, 2)


# -------------------------------------------------------------------------------- GPU only
MODEL = dict(e=64, k=8, h=2048, i=768)  # Qwen3-MoE-shaped experts


def _sampled_contract(x, ids, w13, w2, groups, out, expert_map=None, n_experts=8):
    """The contract for the rows of ``n_experts`` local experts (checking all 64 of the model
    shapes, three launches each, would be slow) and the +0 rows."""
    local = ids if expert_map is None else expert_map[ids]
    used = torch.unique(local[local >= 0]).tolist()
    _check_contract(x, ids, w13, w2, groups, out, expert_map, experts=used[:n_experts])


@gpu
@pytest.mark.parametrize("t", [1, 9, 256])
def test_gpu_model_shapes(t):
    dtype = torch.bfloat16
    c = MODEL
    w13, w2 = _weights(dtype, e=c["e"], h=c["h"], i=c["i"])
    x, ids = _inputs(t, dtype, e=c["e"], k=c["k"], h=c["h"])
    w13_r, w2_r = _shard(w13, w2, 0, 2)  # rank 0 of TP 2: 4 groups of its 384 columns
    for groups, a13, a2 in ((8, w13, w2), (4, w13_r, w2_r)):
        out = mt.moe_experts_subtree(x, ids, a13, a2, groups)
        _sampled_contract(x, ids, a13, a2, groups, out)
        assert_bitwise(mt.moe_experts_subtree(x, ids, a13, a2, groups), out, "run to run")
        for cfg in mt.all_configs(dtype):
            got = mt.moe_experts_with_config(x, ids, a13, a2, None, cfg, groups=groups)
            assert_bitwise(got, out, f"cfg {cfg}")
        alone = mt.moe_experts_subtree(x[-1:], ids[-1:], a13, a2, groups)
        assert_bitwise(alone[0], out[-1], "last row alone")
    y = mt.moe_experts(x, ids, w13, w2)
    assert_bitwise(mt.moe_experts_subtree(x, ids, w13, w2, 1).to(dtype), y, "groups=1 rounded")


@gpu
@pytest.mark.parametrize("groups", [8, 4])
def test_gpu_cuda_graph_replay(groups):
    """Captured once, replayed with other tokens, routings and expert maps: the eager bits."""
    dtype = torch.bfloat16
    c = MODEL
    w13, w2 = _weights(dtype, e=c["e"], h=c["h"], i=c["i"])

    def run(x, ids, emap):
        return mt.moe_experts_subtree(x, ids, w13, w2, groups, emap)

    for seed, out, x2, ids2, emap in graph_replays(run, c, dtype):
        assert_bitwise(out, run(x2, ids2, emap), f"graph replay {seed} vs eager")
        if seed == 0:
            _sampled_contract(x2, ids2, w13, w2, groups, out.clone(), emap, 4)
