"""The per-op self-tests that ``rl-engine check`` runs: quick bitwise invariance checks on small
inputs, one per registered op.

They live here, above the ops, so that no op module imports :mod:`rl_engine.testing` (the
layer rule of docs/where-things-live.md, checked by ``tests/test_layers.py``). A new op adds its
function here and one entry in :data:`SELF_TESTS`; ``rl-engine check`` reports an op without one
as a failure. Each function imports its op on call, so one op that cannot load does not stop
the others' checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from rl_engine.registry import KernelRegistry, resolve_provider
from rl_engine.testing.invariance import assert_bitwise, check_row_invariance

__all__ = ["SELF_TESTS", "self_test"]


def _det_gemm(device: str) -> None:
    """Quick bitwise row / column invariance check (used by ``rl-engine check``)."""
    from rl_engine.ops.det_gemm import det_gemm

    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        b = torch.randn(64, 48, generator=g).to(device=device, dtype=dtype)
        x = torch.randn(67, 64, generator=g).to(device=device, dtype=dtype)
        check_row_invariance(lambda t, b=b: det_gemm(t, b), x, counts=(1, 17, 33), what="det_gemm")
        assert_bitwise(det_gemm(x, b[:, 5:9]), det_gemm(x, b)[:, 5:9], "det_gemm columns")


def _det_gemm_tp(device: str) -> None:
    """Quick check (``rl-engine check``): TP 2 / 4 / 8 shards == TP 1, rows batch invariant."""
    from rl_engine.ops.det_gemm.tp import combine, det_gemm_tp, finish, subtree

    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(19, 64, generator=g).to(device=device, dtype=torch.float32)
    b = torch.randn(64, 24, generator=g).to(device=device, dtype=torch.float32)
    full = det_gemm_tp(a, b)
    for tp in (2, 4, 8):
        k = 64 // tp
        subs = [
            subtree(a[:, r * k : (r + 1) * k], b[r * k : (r + 1) * k], 8 // tp) for r in range(tp)
        ]
        assert_bitwise(finish(combine(subs), None, a.dtype), full, f"det_gemm_tp TP {tp} shards")
    check_row_invariance(lambda t: det_gemm_tp(t, b), a, counts=(1, 7), what="det_gemm_tp")


def _rms_norm(device: str) -> None:
    """Bitwise row invariance of forward and dX, fused == unfused (used by ``rl-engine check``)."""
    from rl_engine.ops.rms_norm import rms_norm

    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(72, generator=g).to(device=device, dtype=dtype)
        x = torch.randn(67, 72, generator=g).to(device=device, dtype=dtype)
        res = torch.randn(67, 72, generator=g).to(device=device, dtype=dtype)
        check_row_invariance(lambda t, w=w: rms_norm(t, w), x, counts=(1, 17, 33), what="rms_norm")
        y, s = rms_norm(x, w, 1e-6, res)
        assert_bitwise(s, x + res, "rms_norm residual sum")
        assert_bitwise(y, rms_norm(x + res, w, 1e-6), "rms_norm fused vs unfused")
        gy = torch.randn(67, 72, generator=g).to(device=device, dtype=dtype)

        def dx(idx, w=w, x=x, gy=gy):
            xi = x[idx.long()].clone().requires_grad_(True)
            rms_norm(xi, w).backward(gy[idx.long()])
            return xi.grad

        check_row_invariance(dx, torch.arange(67.0), counts=(1, 17, 33), what="rms_norm dX")


def _poly_norm(device: str) -> None:
    """Bitwise row invariance of forward and dX, fused == unfused (``rl-engine check``)."""
    from rl_engine.ops.poly_norm import fused_mul_poly_norm, poly_norm

    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.tensor([0.3, 0.5, 0.2], device=device)
    b = torch.tensor([0.1], device=device)
    for dtype in (torch.float32, torch.bfloat16):
        x = (2 * torch.randn(45, 77, generator=g)).to(device=device, dtype=dtype)
        m = torch.randn(45, 77, generator=g).to(device=device, dtype=dtype)
        check_row_invariance(lambda r: poly_norm(r, w, b), x, counts=(1, 17), what="poly_norm")
        assert_bitwise(
            fused_mul_poly_norm(x, m, w, b), poly_norm(x, w, b) * m, "fused_mul_poly_norm"
        )


def _silu_and_mul(device: str) -> None:
    """Bitwise row invariance of forward and dX (used by ``rl-engine check``)."""
    from rl_engine.ops.silu_and_mul import silu_and_mul

    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (3 * torch.randn(67, 2 * 45, generator=g)).to(device=device, dtype=dtype)
        gy = torch.randn(67, 45, generator=g).to(device=device, dtype=dtype)
        check_row_invariance(silu_and_mul, x, counts=(1, 17, 33), what="silu_and_mul")

        def dx(idx, x=x, gy=gy):
            xi = x[idx.long()].clone().requires_grad_(True)
            silu_and_mul(xi).backward(gy[idx.long()])
            return xi.grad

        check_row_invariance(dx, torch.arange(67.0), counts=(1, 17, 33), what="silu_and_mul dX")


def _rope(device: str) -> None:
    """Bitwise row invariance of forward and dX, both layouts (used by ``rl-engine check``)."""
    from rl_engine.ops.rope import rope

    g = torch.Generator(device="cpu").manual_seed(0)
    n = 67
    pos = torch.randint(0, 4096, (n,), generator=g).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, 3, 24, generator=g).to(device=device, dtype=dtype)
        gy = torch.randn(n, 3, 24, generator=g).to(device=device, dtype=dtype)
        for neox in (True, False):
            # rows are addressed by index so that x and positions are sliced together
            def fwd(idx, x=x, neox=neox):
                i = idx.long()
                return rope(x[i], pos[i], rotary_dim=16, is_neox=neox)

            def dx(idx, x=x, gy=gy, neox=neox):
                i = idx.long()
                xi = x[i].clone().requires_grad_(True)
                rope(xi, pos[i], rotary_dim=16, is_neox=neox).backward(gy[i])
                return xi.grad

            idx = torch.arange(float(n), device=device)
            check_row_invariance(fwd, idx, counts=(1, 17, 33), what=f"rope neox={neox}")
            check_row_invariance(dx, idx, counts=(1, 17, 33), what=f"rope dX neox={neox}")


def _logits(device: str) -> Iterator[tuple[torch.dtype, torch.Tensor]]:
    """``(dtype, logits [24, V])`` in fp32 then bf16 (one generator, seed 0), V two vocabulary
    tiles of ``logp`` / ``entropy``, the second one partial."""
    from rl_engine.ops.logp.reference import VOCAB_TILE

    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        yield dtype, (3 * torch.randn(24, VOCAB_TILE + 77, generator=g)).to(device, dtype)


def _logp(device: str) -> None:
    """Quick bitwise row-invariance check of forward and dlogits (used by ``rl-engine check``)."""
    from rl_engine.ops.logp import logp

    for dtype, x in _logits(device):

        def fwd(rows):
            tok = (rows[:, 0].float().abs() * 1000).long() % rows.shape[1]
            return logp(rows, tok, 0.7)

        def dx(rows):
            rows = rows.clone().requires_grad_(True)
            tok = (rows[:, 0].detach().float().abs() * 1000).long() % rows.shape[1]
            logp(rows, tok, 0.7).backward(rows[:, 1].detach().float() + 0.5)
            return rows.grad

        check_row_invariance(fwd, x, counts=(1, 17), what=f"logp {dtype}")
        check_row_invariance(dx, x, counts=(1, 17), what=f"logp dlogits {dtype}")


def _entropy(device: str) -> None:
    """Quick bitwise row-invariance check of forward and dlogits (used by ``rl-engine check``)."""
    from rl_engine.ops.entropy import entropy

    for dtype, x in _logits(device):

        def dx(rows):
            rows = rows.clone().requires_grad_(True)
            entropy(rows, 0.7).backward(rows[:, 1].detach().float() + 0.5)
            return rows.grad

        check_row_invariance(lambda r: entropy(r, 0.7), x, counts=(1, 17), what="entropy")
        check_row_invariance(dx, x, counts=(1, 17), what=f"entropy dlogits {dtype}")


def _linear_logp(device: str) -> None:
    """Bitwise fusion transparency and row invariance (used by ``rl-engine check``)."""
    from rl_engine.ops.det_gemm import det_gemm
    from rl_engine.ops.linear_logp import linear_logp
    from rl_engine.ops.logp import logp
    from rl_engine.ops.logp.reference import VOCAB_TILE

    g = torch.Generator(device="cpu").manual_seed(0)
    vocab = VOCAB_TILE + 77
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(vocab, 32, generator=g).to(device=device, dtype=dtype)
        h = torch.randn(20, 32, generator=g).to(device=device, dtype=dtype)
        tok = torch.randint(0, vocab, (20,), generator=g).to(device)
        assert_bitwise(
            linear_logp(h, w, tok, 0.7),
            logp(det_gemm(h, w.t()), tok, 0.7),
            f"linear_logp == logp(det_gemm) {dtype}",
        )

        def fwd(rows, w=w):
            t = (rows[:, 0].float().abs() * 1000).long() % vocab
            return linear_logp(rows, w, t, 0.7)

        check_row_invariance(fwd, h, counts=(1, 17), what=f"linear_logp {dtype}")


def _ratio_kl(device: str) -> None:
    """Bitwise row invariance of every output and of the gradient (``rl-engine check``)."""
    from rl_engine.ops.ratio_kl import ratio_kl

    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(37, 3, 29, generator=g) * 0.3).to(device)
    x[:, 2] = (torch.rand(37, 29, generator=g) > 0.2).to(device)

    def fwd(t: torch.Tensor) -> torch.Tensor:
        out = ratio_kl(t[:, 0], t[:, 1], t[:, 2], token_is_cap=2.0, seq_mis=(0.5, 2.0))
        cols = [o.float().reshape(t.shape[0], -1) for o in out]
        return torch.cat(cols, dim=1)

    check_row_invariance(fwd, x, counts=(1, 17, 33), what="ratio_kl")
    lp = x[:, 0].clone().requires_grad_(True)
    out = ratio_kl(lp, x[:, 1], x[:, 2])
    (out.k3.sum() + out.seq_ratio.sum()).backward()
    lp1 = x[:1, 0].clone().requires_grad_(True)
    out1 = ratio_kl(lp1, x[:1, 1], x[:1, 2])
    (out1.k3.sum() + out1.seq_ratio.sum()).backward()
    assert_bitwise(lp1.grad, lp.grad[:1], "ratio_kl d logp row 0")


def _grpo_loss(device: str) -> None:
    """Run-to-run and padding invariance of loss, metrics and d logp (``rl-engine check``)."""
    from rl_engine.ops.grpo_loss import grpo_loss

    g = torch.Generator(device="cpu").manual_seed(0)
    b, t = 9, 23
    lp = (torch.randn(b, t, generator=g) * 0.3 - 1.0).to(device)
    old = (lp.cpu() + torch.randn(b, t, generator=g) * 0.2).to(device)
    adv = torch.randn(b, generator=g).to(device)
    mask = (torch.rand(b, t, generator=g) > 0.2).to(device)

    def run(lp_, old_, adv_, mask_):
        x = lp_.clone().requires_grad_(True)
        out = grpo_loss(x, old_, adv_, mask_, clip_high=0.28, dual_clip=3.0)
        out.loss.backward()
        return torch.cat([out.loss[None], torch.stack(out.metrics)]), x.grad

    loss, grad = run(lp, old, adv, mask)
    loss2, grad2 = run(lp, old, adv, mask)
    assert_bitwise(loss2, loss, "grpo_loss run-to-run")
    assert_bitwise(grad2, grad, "grpo_loss d logp run-to-run")

    def pad(x, rows, cols, value):
        x = torch.cat([x, torch.full((x.shape[0], cols), value, dtype=x.dtype, device=device)], 1)
        return torch.cat([x, torch.full((rows, x.shape[1]), value, dtype=x.dtype, device=device)])

    adv_p = torch.cat([adv, torch.zeros(5, device=device)])
    loss_p, grad_p = run(pad(lp, 5, 4, 0.0), pad(old, 5, 4, 0.0), adv_p, pad(mask, 5, 4, False))
    assert_bitwise(loss_p, loss, "grpo_loss with masked padding")
    assert_bitwise(grad_p[:b, :t], grad, "grpo_loss d logp with masked padding")


def _attention(device: str) -> None:
    """Bitwise prefill == chunked paged prefill == decode, alone and batched (``rl-engine check``)."""
    from rl_engine.ops.attention import attention, paged_attention, write_kv_cache

    g = torch.Generator(device="cpu").manual_seed(0)
    op = KernelRegistry.get_op("attention", device=device)
    dtypes = [torch.float32]
    if device != "cpu" or op.provider.name == "native":
        dtypes.append(torch.bfloat16)
    for dtype in dtypes:
        lens, hq, hkv, d, bs = [70, 5], 4, 2, 64, 16
        t = sum(lens)
        q, k, v = (
            torch.randn(t, h, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv)
        )
        cu = torch.tensor([0, lens[0], t], dtype=torch.int32, device=device)
        full = attention(q, k, v, cu, backend=op.provider.name)
        alone = attention(
            q[: lens[0]], k[: lens[0]], v[: lens[0]], cu[:2], backend=op.provider.name
        )
        assert_bitwise(alone, full[: lens[0]], f"attention {dtype}: sequence alone vs batched")
        # the first sequence through a paged cache: chunks of 33, then decode steps
        n = lens[0]
        kc = torch.zeros(8, bs, hkv, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        blocks = torch.tensor([[5, 2, 7, 0, 1]], dtype=torch.int32, device=device)
        slots = (blocks[0].long()[torch.arange(n, device=device) // bs] * bs) + torch.arange(
            n, device=device
        ) % bs
        write_kv_cache(k[:n], v[:n], kc, vc, slots, backend=op.provider.name)
        outs = []
        for c0, c1 in [(0, 33), (33, 66)] + [(i, i + 1) for i in range(66, n)]:
            qsl = torch.tensor([0, c1 - c0], dtype=torch.int32, device=device)
            sl = torch.tensor([c1], dtype=torch.int32, device=device)
            outs.append(
                paged_attention(q[c0:c1], kc, vc, blocks, sl, qsl, backend=op.provider.name)
            )
        assert_bitwise(torch.cat(outs), full[:n], f"attention {dtype}: paged chunks vs prefill")


def _moe_router(device: str) -> None:
    """Bitwise row invariance of weights, ids and dlogits; the tie rule (``rl-engine check``)."""
    from rl_engine.ops.moe_router import moe_topk

    g = torch.Generator(device="cpu").manual_seed(0)
    for scoring, renorm in (("softmax", True), ("softmax", False), ("topk_softmax", False)):
        x = torch.randn(45, 16, generator=g).to(device=device, dtype=torch.bfloat16)

        def fwd(t, scoring=scoring, renorm=renorm):
            w, ids = moe_topk(t, 4, scoring=scoring, renormalize=renorm)
            return torch.cat([w, ids.float()], dim=1)

        check_row_invariance(fwd, x, counts=(1, 17, 33), what=f"moe_topk {scoring}")
    tie = torch.zeros(1, 8, device=device)
    assert_bitwise(moe_topk(tie, 3)[1], torch.tensor([[0, 1, 2]], device=device), "tie rule")


def _experts_inputs(device: str, inter: int) -> tuple[torch.Tensor, ...]:
    """``(x [9, 32], ids [9, 2], w13 [4, 2 * inter, 32], w2 [4, 32, inter])`` bf16, seeded."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(9, 32, generator=g).to(device=device, dtype=torch.bfloat16)
    w13 = 0.2 * torch.randn(4, 2 * inter, 32, generator=g)
    w2 = 0.2 * torch.randn(4, 32, inter, generator=g)
    ids = torch.randint(0, 4, (9, 2), generator=g).to(device)
    w13, w2 = (w.to(device=device, dtype=torch.bfloat16) for w in (w13, w2))
    return x, ids, w13, w2


def _moe_experts(device: str) -> None:
    """Every output row == its expert MLP alone, bitwise (``rl-engine check``)."""
    from rl_engine.ops.det_gemm import det_gemm
    from rl_engine.ops.moe_experts import moe_experts
    from rl_engine.ops.silu_and_mul import silu_and_mul

    x, ids, w13, w2 = _experts_inputs(device, inter=24)
    y = moe_experts(x, ids, w13, w2)
    t, s = 5, 1
    e = int(ids[t, s])
    alone = det_gemm(silu_and_mul(det_gemm(x[t : t + 1], w13[e].t())), w2[e].t())
    assert_bitwise(y[t, s : s + 1], alone, "moe_experts row vs its expert alone")


def _moe_experts_tp(device: str) -> None:
    """The grouped experts: TP 2 / 4 shards of I == the whole, bitwise (``rl-engine check``)."""
    from rl_engine.ops.det_gemm.tp import combine, finish
    from rl_engine.ops.moe_experts import moe_experts, moe_experts_subtree

    x, ids, w13, w2 = _experts_inputs(device, inter=32)
    full = moe_experts(x, ids, w13, w2, groups=8)
    gate, up = w13.chunk(2, dim=1)
    for tp in (2, 4):
        c = 32 // tp
        subs = [
            moe_experts_subtree(
                x, ids, torch.cat([gate[:, r * c : (r + 1) * c], up[:, r * c : (r + 1) * c]], 1),
                w2[:, :, r * c : (r + 1) * c].contiguous(), 8 // tp,
            )
            for r in range(tp)
        ]  # fmt: skip
        assert_bitwise(finish(combine(subs), None, x.dtype), full, f"moe_experts_tp TP {tp}")


def _moe_combine(device: str) -> None:
    """Bitwise row invariance with a gated shared expert (``rl-engine check``)."""
    from rl_engine.ops.moe_combine import moe_combine

    g = torch.Generator(device="cpu").manual_seed(0)
    t, k, h = 37, 4, 24
    y = torch.randn(t, k * h + h + 1, generator=g).to(device=device, dtype=torch.bfloat16)
    w = torch.rand(t, k, generator=g).to(device)

    def fwd(rows):
        idx = rows[:, 0].long()
        yy = y[idx]
        return moe_combine(
            yy[:, : k * h].reshape(-1, k, h), w[idx],
            shared=yy[:, k * h : k * h + h], shared_gate=yy[:, -1:],
        )  # fmt: skip

    check_row_invariance(fwd, torch.arange(t, dtype=torch.float32)[:, None].to(device),
                         counts=(1, 17, 33), what="moe_combine")  # fmt: skip


def _grouped_poly_norm(device: str) -> None:
    """Each row == fused_mul_poly_norm with its expert's weights, bitwise (``rl-engine check``)."""
    from rl_engine.ops.grouped_poly_norm import grouped_poly_norm
    from rl_engine.ops.poly_norm import fused_mul_poly_norm

    g = torch.Generator(device="cpu").manual_seed(0)
    gate = torch.randn(11, 40, generator=g).to(device=device, dtype=torch.bfloat16)
    up = torch.randn(11, 40, generator=g).to(device=device, dtype=torch.bfloat16)
    w = torch.rand(3, 3, generator=g).to(device)
    b = torch.rand(3, 1, generator=g).to(device)
    ids = torch.tensor([0, 0, 1, 2, 2, 2, 1, 0, 1, 2, 0], device=device)
    out = grouped_poly_norm(gate, up, w, b, ids)
    prov = resolve_provider("grouped_poly_norm", device, None)
    backend = "native" if prov == "native" else prov  # the same family's poly_norm
    alone = fused_mul_poly_norm(gate[3:4], up[3:4], w[2], b[2], backend=backend)
    assert_bitwise(out[3:4], alone, "grouped_poly_norm row vs fused_mul_poly_norm")


SELF_TESTS: dict[str, Callable[[str], None]] = {
    "det_gemm": _det_gemm,
    "det_gemm_tp": _det_gemm_tp,
    "rms_norm": _rms_norm,
    "poly_norm": _poly_norm,
    "silu_and_mul": _silu_and_mul,
    "rope": _rope,
    "logp": _logp,
    "entropy": _entropy,
    "linear_logp": _linear_logp,
    "ratio_kl": _ratio_kl,
    "grpo_loss": _grpo_loss,
    "attention": _attention,
    "moe_router": _moe_router,
    "moe_experts": _moe_experts,
    "moe_experts_tp": _moe_experts_tp,
    "moe_combine": _moe_combine,
    "grouped_poly_norm": _grouped_poly_norm,
}
"""Op type -> its self-test ``fn(device)`` (raises on a failed check)."""


def self_test(op_type: str, device: str) -> None:
    """Run the self-test of ``op_type`` on ``device`` (``"cpu"`` or ``"cuda"``); raises
    ``KeyError`` for an op without one and whatever the check raises when it fails."""
    SELF_TESTS[op_type](device)
