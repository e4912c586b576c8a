"""The row-grouped weight gradient of rms_norm (rl_engine.ops.rms_norm.tp): sequence-parallel
blocks of every allowed degree, combined as the ranks combine them, give the TP = 1 bits; the
input gradient is the op's own; Megatron's way (each rank's own weight gradient, then a sum)
does not. fp32 rows of varied scale, so that an order change shows in the bits.
(The same with real process groups: tests/adapters/test_megatron_tp.py, sequence parallelism.)
"""

from __future__ import annotations

import pytest
import torch

from rl_engine import ops
from rl_engine.ops.det_gemm.tp import Exchange, combine
from rl_engine.ops.rms_norm import tp as norm_tp
from tests.conftest import backend_fixture

# every invariant provider on its device (the Triton one on a GPU, or in the interpreter)
backend = backend_fixture("rms_norm")


def _data(m: int, h: int = 48, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 3, m).unsqueeze(1)
    x = torch.randn(m, h, generator=g) * scale
    grad = torch.randn(m, h, generator=g) * scale.flip(0)
    w = torch.randn(h, generator=g)
    return x.to(device), grad.to(device), w.to(device)


def _grads(x, grad, w, backend, fn=norm_tp.rms_norm_tp, **kw):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    fn(x, w, 1e-6, backend=backend, **kw).backward(grad)
    return x.grad, w.grad


@pytest.mark.parametrize("m", [64, 40, 8])
@pytest.mark.parametrize("t", [2, 4, 8])
def test_sequence_parallel_blocks_equal_tp1(t, m, backend):
    x, grad, w = _data(m, device=backend.device)
    dx1, dw1 = _grads(x, grad, w, backend)
    block = m // t
    rows = [slice(r * block, (r + 1) * block) for r in range(t)]
    # what each rank sends (its subtree of 8 / t groups), computed up front: the simulated
    # all-gather checks that the rank sends exactly that and returns every rank's, in order
    subs = [norm_tp.row_group_wgrad(grad[s], x[s], 1e-6, 8 // t, backend) for s in rows]
    for r, s in enumerate(rows):

        def gather(sub, r=r):  # every rank's [1, H], concatenated in rank order
            assert torch.equal(sub, subs[r][None])
            return torch.cat([x[None] for x in subs])

        dx, dw = _grads(x[s], grad[s], w, backend, exchange=Exchange(None, gather, r, t))
        assert torch.equal(dx, dx1[s]), f"rank {r}: input gradient"
        assert torch.equal(dw, dw1), f"rank {r}: weight gradient"


def test_input_gradient_is_the_ops(backend):
    x, grad, w = _data(40, device=backend.device)
    dx, _ = _grads(x, grad, w, backend)
    x2 = x.clone().requires_grad_(True)
    ops.rms_norm(x2, w, 1e-6, backend=backend).backward(grad)
    assert torch.equal(dx, x2.grad)


def test_weight_gradient_is_the_pair_tree_of_the_groups(backend):
    # 8 groups of 5 rows, the last one 2 rows (zero padding invariant)
    x, grad, w = _data(37, device=backend.device)
    _, dw = _grads(x, grad, w, backend)
    parts = [norm_tp.row_group_wgrad(grad[i : i + 5], x[i : i + 5], 1e-6, 1, backend)
             for i in range(0, 40, 5)]  # fmt: skip
    assert torch.equal(dw, combine(parts))


def test_megatrons_sum_of_rank_gradients_differs(backend):
    """The control: each rank's own (plain) weight gradient added up, as the finalize step's
    all-reduce does, is not the single-process gradient at TP 4."""
    x, grad, w = _data(64, device=backend.device)
    _, dw1 = _grads(x, grad, w, backend)
    plain = torch.zeros_like(w)
    for r in range(4):
        wr = w.clone().requires_grad_(True)
        rows = slice(r * 16, (r + 1) * 16)
        ops.rms_norm(x[rows], wr, 1e-6, backend=backend).backward(grad[rows])
        plain = plain + wr.grad
    assert not torch.equal(plain, dw1)


def test_bad_input():
    x, grad, w = _data(36)
    with pytest.raises(ValueError, match=r"degree 3 .* allowed degrees: \[1, 2, 4, 8\]"):
        norm_tp.rms_norm_tp(x, w, exchange=Exchange(None, None, 0, 3))
    with pytest.raises(ValueError, match="multiple of 8"):  # 9 rows, 2 groups on this rank
        norm_tp.rms_norm_tp(x[:9], w, exchange=Exchange(None, None, 0, 4))
    with pytest.raises(ValueError, match="power of two"):
        norm_tp.row_group_wgrad(grad, x, 1e-6, 3, "native")


@pytest.mark.parametrize("t", [2, 4])
def test_head_blocks_equal_tp1(t, backend):
    """Qwen3's q / k norm at TP t: rank r normalises heads [r n / t, (r + 1) n / t) of every
    token; the per-head partials all-gathered and tree-summed give the one-process gradient;
    with ``sole`` rank 0 holds it and the others zeros (their sum, as Megatron's finalize step
    adds them, is the same gradient)."""
    g = torch.Generator().manual_seed(1)
    scale = torch.logspace(-3, 3, 12).view(12, 1, 1)
    x = torch.randn(12, 8, 16, generator=g) * scale  # [tokens, heads, D]
    grad = torch.randn(12, 8, 16, generator=g) * scale.flip(0)
    w = torch.randn(16, generator=g)
    x, grad, w = (v.to(backend.device) for v in (x, grad, w))
    _, dw1 = _grads(x, grad, w, backend, fn=norm_tp.rms_norm_heads_tp)
    n = 8 // t
    blocks = [slice(r * n, (r + 1) * n) for r in range(t)]
    parts = [norm_tp.head_wgrad(grad[:, b], x[:, b], 1e-6, backend) for b in blocks]
    total = torch.zeros_like(w)
    for r, b in enumerate(blocks):

        def gather(p, r=r):
            assert torch.equal(p, parts[r])
            return torch.cat(parts)

        for sole in (False, True):
            ex = Exchange(None, gather, r, t)
            dx, dw = _grads(x[:, b], grad[:, b], w, backend, fn=norm_tp.rms_norm_heads_tp,
                            exchange=ex, sole=sole)  # fmt: skip
            assert torch.equal(dw, dw1 if (r == 0 or not sole) else torch.zeros_like(w))
        total = total + dw
    assert torch.equal(total, dw1)
    # the control: each rank's own weight gradient over its heads, summed (stock Megatron)
    stock = torch.zeros_like(w)
    for b in blocks:
        wr = w.clone().requires_grad_(True)
        ops.rms_norm(x[:, b], wr, 1e-6, backend=backend).backward(grad[:, b])
        stock = stock + wr.grad
    assert not torch.equal(stock, dw1)
