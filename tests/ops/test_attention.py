"""attention: numerics vs float64 (forward and grads), deterministic backward, opcheck, errors.

The bitwise path equalities (prefill == chunked == decode == any batch) live in
``tests/invariance/test_attention_paths.py``. Providers come from the registry: on the CPU the
``triton`` cases run only under ``TRITON_INTERPRET=1`` (fp32 / fp16); on a CUDA machine the
``cuda`` cases (marked ``gpu``) run too.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine import BackendUnavailableError, KernelRegistry, config
from rl_engine.ops import attention, paged_attention, write_kv_cache
from rl_engine.testing.invariance import assert_bitwise
from rl_engine.testing.tolerances import assert_close, tolerance
from tests.ops.attention_cases import HAS_CUDA, provider_cases, skip_unless_runnable

# many small elementwise ops: one intra-op thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _dtypes(provider: str, device: str) -> list[torch.dtype]:
    if device == "cuda":
        return [torch.bfloat16, torch.float16, torch.float32]
    if provider.startswith("triton"):  # the interpreter's bf16 tl.dot is wrong: fp32 / fp16 there
        return [torch.float32, torch.float16]
    return [torch.float32, torch.bfloat16]


@pytest.fixture(params=provider_cases(_dtypes))
def case(request):
    device, backend, dtype = request.param
    skip_unless_runnable(device, backend)  # registered but not runnable here
    return device, backend, dtype


@pytest.fixture
def triton_on_cpu():
    """Skip unless the triton provider runs on the CPU here (the interpreter)."""
    skip_unless_runnable("cpu", "triton", BackendUnavailableError)


def _rand(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _inputs(lens, hq, hkv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (_rand((t, h, d), dtype, device, g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu.to(device)


def ref64(q, k, v, cu, scale=None, causal=True):
    """float64 attention of packed sequences (differentiable); the numerics oracle."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    outs = []
    offs = cu.tolist()
    for s0, s1 in zip(offs, offs[1:]):
        qq = q[s0:s1].double().transpose(0, 1)
        kk = k[s0:s1].double().repeat_interleave(g, 1).transpose(0, 1)
        vv = v[s0:s1].double().repeat_interleave(g, 1).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) * scale
        if causal:
            n = s1 - s0
            upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            s = s.masked_fill(upper, -math.inf)
        outs.append((s.softmax(-1) @ vv).transpose(0, 1))
    return torch.cat(outs) if outs else q.double() * 0


# (lens, Hq, Hkv, D): MHA, GQA, MQA, head dims 64 / 128 / 80 (padded in Triton) / 32
SHAPES = [
    ([17, 1, 33], 4, 2, 64),
    ([70], 2, 2, 128),
    ([5, 31], 4, 1, 80),
    ([65, 2], 3, 1, 32),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s[0]}-h{s[1]}x{s[2]}-d{s[3]}")
def test_forward_vs_float64(case, shape):
    device, backend, dtype = case
    lens, hq, hkv, d = shape
    q, k, v, cu = _inputs(lens, hq, hkv, d, dtype, device)
    out = attention(q, k, v, cu, backend=backend)
    assert out.dtype == dtype and out.shape == q.shape
    rtol, atol = tolerance(dtype)
    assert_close(out, ref64(q, k, v, cu), rtol=rtol, atol=atol, what=f"attention {shape}")


@pytest.mark.parametrize("causal", [True, False])
def test_scale_and_causal_vs_float64(case, causal):
    device, backend, dtype = case
    q, k, v, cu = _inputs([9, 40], 4, 2, 32, dtype, device, seed=3)
    out = attention(q, k, v, cu, scale=0.3, causal=causal, backend=backend)
    rtol, atol = tolerance(dtype)
    ref = ref64(q, k, v, cu, scale=0.3, causal=causal)
    assert_close(out, ref, rtol=rtol, atol=atol, what=f"attention scale=0.3 causal={causal}")


def _grads(q, k, v, cu, dout, backend, causal=True):
    qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = attention(qq, kk, vv, cu, causal=causal, backend=backend)
    out.backward(dout)
    return out.detach(), qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"L{s[0]}-h{s[1]}x{s[2]}-d{s[3]}")
def test_backward_vs_float64_and_run_to_run(case, shape):
    device, backend, dtype = case
    lens, hq, hkv, d = shape
    q, k, v, cu = _inputs(lens, hq, hkv, d, dtype, device, seed=1)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    out, dq, dk, dv = _grads(q, k, v, cu, dout, backend)
    out2, dq2, dk2, dv2 = _grads(q, k, v, cu, dout, backend)
    for a, b, n in [(out, out2, "out"), (dq, dq2, "dq"), (dk, dk2, "dk"), (dv, dv2, "dv")]:
        assert_bitwise(a, b, f"{n} run-to-run")
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref64(q64, k64, v64, cu).backward(dout.double())
    rtol, atol = tolerance(dtype, grad=True)
    for a, b, n in [(dq, q64.grad, "dq"), (dk, k64.grad, "dk"), (dv, v64.grad, "dv")]:
        assert a.dtype == dtype
        assert_close(a, b, rtol=rtol, atol=atol, what=f"{n} {shape}")


def test_backward_non_causal_vs_float64(case):
    device, backend, dtype = case
    q, k, v, cu = _inputs([20, 7], 2, 1, 32, dtype, device, seed=4)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    _, dq, dk, dv = _grads(q, k, v, cu, dout, backend, causal=False)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref64(q64, k64, v64, cu, causal=False).backward(dout.double())
    rtol, atol = tolerance(dtype, grad=True)
    for a, b, n in [(dq, q64.grad, "dq"), (dk, k64.grad, "dk"), (dv, v64.grad, "dv")]:
        assert_close(a, b, rtol=rtol, atol=atol, what=f"{n} non-causal")


def test_grads_invariant_to_batch(case):
    """dQ (row invariant) and dK / dV of a sequence: the same alone, packed, or with padding."""
    device, backend, dtype = case
    hq, hkv, d = 4, 2, 32
    qa, ka, va, cua = _inputs([67], hq, hkv, d, dtype, device, seed=6)
    qb, kb, vb, _ = _inputs([1, 30], hq, hkv, d, dtype, device, seed=7)
    g = torch.Generator().manual_seed(8)
    da = _rand(qa.shape, dtype, device, g)
    db = _rand(qb.shape, dtype, device, g)
    alone = _grads(qa, ka, va, cua, da, backend)
    # B before A, then A, then a zero padding sequence
    pad = torch.zeros(7, hq, d, dtype=dtype, device=device)
    padkv = torch.zeros(7, hkv, d, dtype=dtype, device=device)
    q = torch.cat([qb, qa, pad])
    k = torch.cat([kb, ka, padkv])
    v = torch.cat([vb, va, padkv])
    dout = torch.cat([db, da, pad])
    cu = torch.tensor([0, 1, 31, 98, 105], dtype=torch.int32, device=device)
    packed = _grads(q, k, v, cu, dout, backend)
    for a, b, n in zip(alone, packed, ("out", "dq", "dk", "dv")):
        assert_bitwise(b[31:98], a, f"{n}: sequence alone vs packed")


def test_empty_and_zero_length_sequences(case):
    device, backend, dtype = case
    q, k, v, _ = _inputs([0], 2, 1, 32, dtype, device)
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    assert attention(q, k, v, cu, backend=backend).shape == (0, 2, 32)
    q, k, v, cu = _inputs([5, 0, 9], 2, 1, 32, dtype, device)
    out = attention(q, k, v, cu, backend=backend)
    cu2 = torch.tensor([0, 5, 14], dtype=torch.int32, device=device)
    assert_bitwise(out, attention(q, k, v, cu2, backend=backend), "empty sequence in the batch")


def test_strided_inputs(case):
    device, backend, dtype = case
    q, k, v, cu = _inputs([12, 21], 4, 2, 32, dtype, device, seed=9)
    qkv = torch.cat([q, k, v], dim=1)  # one fused projection, as engines produce it
    qs, ks, vs = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    assert not qs.is_contiguous()
    out = attention(qs, ks, vs, cu, backend=backend)
    assert_bitwise(out, attention(q, k, v, cu, backend=backend), "strided vs contiguous")


def test_write_kv_cache_exact(case):
    device, backend, dtype = case
    g = torch.Generator().manual_seed(10)
    k = _rand((6, 2, 32), dtype, device, g)
    v = _rand((6, 2, 32), dtype, device, g)
    kc = torch.full((4, 16, 2, 32), 7.0, dtype=dtype, device=device)
    vc = kc.clone()
    slots = torch.tensor([17, -1, 0, 63, 5, -1], dtype=torch.int64, device=device)
    write_kv_cache(k, v, kc, vc, slots, backend=backend)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert_bitwise(kc[s // 16, s % 16], k[i], f"k slot {s}")
            assert_bitwise(vc[s // 16, s % 16], v[i], f"v slot {s}")
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(64) if s not in written]
    assert bool((kc.reshape(64, 2, 32)[untouched] == 7.0).all()), "other slots were modified"


# the CPU cases only: on a GPU the refusal is a device-side assert (RL_ENGINE_DEVICE_CHECKS=1),
# which poisons the CUDA context of the test process
@pytest.mark.parametrize(
    "case", [c for c in provider_cases(_dtypes) if c.values[0][0] == "cpu"], indirect=True
)
def test_write_kv_cache_slot_out_of_range_is_refused(case):
    """Slot 99 of a 64-slot cache: refused by every provider on the CPU (on a GPU by a
    device-side assert with RL_ENGINE_DEVICE_CHECKS=1); the cache is never written outside."""
    device, backend, dtype = case
    k = torch.ones(2, 2, 32, dtype=dtype)
    kc = torch.zeros(4, 16, 2, 32, dtype=dtype)
    vc = kc.clone()
    for bad in ([3, 99], [3, -2]):
        with pytest.raises(ValueError, match="slots must be -1"):
            write_kv_cache(k, k, kc, vc, torch.tensor(bad), backend=backend)
    assert not kc.any() and not vc.any()


def _ten_token_cache(case, seed):
    """One sequence of 10 tokens (2 query heads, 1 KV head, D = 32) and its keys / values
    written to a cache of two blocks of 16: ``(q, k, v, cu, k_cache, v_cache, block_table,
    seq_lens)``."""
    device, backend, dtype = case
    q, k, v, cu = _inputs([10], 2, 1, 32, dtype, device, seed=seed)
    kc = torch.zeros(2, 16, 1, 32, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    write_kv_cache(k, v, kc, vc, torch.arange(10, device=device), backend=backend)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    sl = torch.tensor([10], dtype=torch.int32, device=device)
    return q, k, v, cu, kc, vc, bt, sl


def test_paged_attention_into_out(case):
    """``out=``: the sequences' rows written in place with the returned tensor's bits; padding
    rows after query_start_loc[-1] untouched; a mismatched ``out`` refused."""
    device, backend, dtype = case
    q, _, _, _, kc, vc, bt, sl = _ten_token_cache(case, seed=12)
    qp = torch.cat([q[7:], torch.randn(2, 2, 32).to(device, dtype)])  # 3 tokens + 2 padding
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    want = paged_attention(qp, kc, vc, bt, sl, qsl, backend=backend)
    out = torch.full_like(qp, 7.0)
    got = paged_attention(qp, kc, vc, bt, sl, qsl, backend=backend, out=out)
    assert got is out
    assert_bitwise(out[:3], want[:3], "out= rows vs returned rows")
    assert bool((out[3:] == 7.0).all()), "padding rows were written"
    wide = torch.full((5, 2 * 32 + 8), 7.0, dtype=dtype, device=device)  # strided rows
    view = wide[:, : 2 * 32].view(5, 2, 32)
    paged_attention(qp, kc, vc, bt, sl, qsl, backend=backend, out=view)
    assert_bitwise(view[:3], want[:3], "out= into a row-strided view")
    with pytest.raises(ValueError, match="out must match q"):
        paged_attention(qp, kc, vc, bt, sl, qsl, backend=backend, out=out[:4])


def test_paged_padding_tokens_are_zero(case):
    """Tokens after query_start_loc[-1] (CUDA-graph padding) are ignored and left zero."""
    device, backend, dtype = case
    q, k, v, cu, kc, vc, bt, sl = _ten_token_cache(case, seed=11)
    qp = torch.cat([q[9:], torch.randn(3, 2, 32).to(device, dtype)])
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    out = paged_attention(qp, kc, vc, bt, sl, qsl, backend=backend)
    assert_bitwise(out[:1], attention(q, k, v, cu, backend=backend)[9:], "decode row")
    assert bool((out[1:] == 0).all())


def test_compile_matches_eager(case):
    device, backend, dtype = case
    # the lambda's code object is the same in every case: without a reset its guard cache grows
    # per (backend, dtype) and the ninth case in a process hits dynamo's recompile limit
    torch._dynamo.reset()
    q, k, v, cu = _inputs([9, 4], 2, 1, 32, dtype, device, seed=12)
    backend = str(backend)  # plain str: torch 2.11's dynamo (conftest.Backend)
    f = torch.compile(
        lambda a, b, c: attention(a, b, c, cu, backend=backend), fullgraph=True, backend="eager"
    )
    assert_bitwise(f(q, k, v), attention(q, k, v, cu, backend=backend), "compile vs eager")


@pytest.mark.parametrize("provider", ["native", "triton"])
def test_opcheck(provider):
    """torch.library.opcheck of every attention custom op; the Triton provider on the GPU (or
    in the interpreter on the CPU)."""
    dev = "cuda" if provider == "triton" and HAS_CUDA else "cpu"
    if provider == "triton":
        skip_unless_runnable(dev, "triton", BackendUnavailableError)

    def on(t):
        return t.to(dev)

    g = torch.Generator().manual_seed(13)
    q, k, v = (on(torch.randn(9, h, 16, generator=g)) for h in (2, 1, 1))
    cu = on(torch.tensor([0, 4, 9], dtype=torch.int32))
    ops = torch.ops.rl_engine
    torch.library.opcheck(ops.attention.default, (q, k, v, cu, 0.25, True, provider))
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    torch.library.opcheck(ops.attention.default, (qg, kg, vg, cu, 0.25, True, provider))
    out, lse = ops.attention.default(q, k, v, cu, 0.25, True, provider)
    dout = on(torch.randn(q.shape, generator=g))
    torch.library.opcheck(
        ops.attention_bwd.default, (dout, q, k, v, out, lse, cu, 0.25, True, provider)
    )
    kc = on(torch.randn(3, 16, 1, 16, generator=g))
    vc = on(torch.randn(3, 16, 1, 16, generator=g))
    bt = on(torch.tensor([[2, 0], [1, 0]], dtype=torch.int32))
    sl = on(torch.tensor([20, 3], dtype=torch.int32))
    qsl = on(torch.tensor([0, 2, 3], dtype=torch.int32))
    torch.library.opcheck(ops.paged_attention.default, (q[:3], kc, vc, bt, sl, qsl, 0.25, provider))
    out = torch.zeros_like(q[:3])
    torch.library.opcheck(
        ops.paged_attention_out.default, (q[:3], kc, vc, bt, sl, qsl, 0.25, out, provider)
    )
    slots = on(torch.tensor([3, -1, 40, 17], dtype=torch.int64))
    torch.library.opcheck(ops.write_kv_cache.default, (k[:4], v[:4], kc, vc, slots, provider))


def test_paged_attention_has_no_backward():
    q = torch.randn(1, 2, 16, requires_grad=True)
    kc = torch.randn(1, 16, 1, 16)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    out = paged_attention(
        q,
        kc,
        kc.clone(),
        bt,
        torch.tensor([5], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        backend="native",
    )
    with pytest.raises(NotImplementedError, match="no backward"):
        out.sum().backward()


# ----------------------------------------------------------------------------- errors
def _ok():
    q, k, v, cu = _inputs([3, 4], 4, 2, 16, torch.float32, "cpu")
    return q, k, v, cu


def _attn_args(**over):
    q, k, v, cu = _ok()
    args = dict(q=q, k=k, v=v, cu_seqlens=cu)
    args.update(over)
    return args


_Q, _K, _V, _CU = _ok()


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(q=_Q.double(), k=_K.double(), v=_V.double()), TypeError, "not supported"),
        (dict(k=_K.bfloat16()), TypeError, "one dtype"),
        (dict(k=_K.to("meta")), ValueError, "device"),
        (dict(v=_V[:, :1]), ValueError, "differ in shape"),
        (dict(k=_K[:, :1].expand(7, 3, 16), v=_V[:, :1].expand(7, 3, 16)), ValueError, "multiple"),
        (dict(k=_K[..., :8], v=_V[..., :8]), ValueError, "head_dim"),
        (dict(k=_K[:5], v=_V[:5]), ValueError, "tokens"),
        (dict(cu_seqlens=_CU.float()), TypeError, "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32)), ValueError, "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), ValueError, "decreas"),
        (dict(q=_Q[0]), ValueError, "dims"),
        (dict(q=[[1.0]]), TypeError, "Tensor"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(scale="0.1"), TypeError, "scale"),
        (dict(causal=1), TypeError, "causal"),
        (
            dict(q=torch.randn(7, 1, 600), k=torch.randn(7, 1, 600), v=torch.randn(7, 1, 600)),
            ValueError,
            "head_dim 600",
        ),
    ],
)
def test_attention_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        attention(**_attn_args(**over), backend="native")


def test_int64_cu_seqlens_are_taken():
    args = _attn_args()
    want = attention(**args, backend="native")
    args["cu_seqlens"] = args["cu_seqlens"].long()
    assert_bitwise(attention(**args, backend="native"), want, "int64 cu_seqlens")


def _paged_args(**over):
    g = torch.Generator().manual_seed(14)
    args = dict(
        q=torch.randn(3, 4, 16, generator=g),
        k_cache=torch.randn(4, 16, 2, 16, generator=g),
        v_cache=torch.randn(4, 16, 2, 16, generator=g),
        block_table=torch.tensor([[1, 3], [0, 2]], dtype=torch.int32),
        seq_lens=torch.tensor([20, 2], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(block_table=torch.tensor([[1, 3], [0, 2]])), TypeError, "block_table"),
        (
            dict(seq_lens=torch.tensor([20, 2], dtype=torch.int32, device="meta")),
            ValueError,
            "device",
        ),
        (dict(v_cache=torch.randn(4, 32, 2, 16)), ValueError, "differ in shape"),
        (dict(q=torch.randn(3, 4, 16).half()), TypeError, "one dtype"),
        (dict(block_table=torch.tensor([[1, 3]], dtype=torch.int32)), ValueError, "sequences"),
        (dict(seq_lens=torch.tensor([20, 1], dtype=torch.int32)), ValueError, "query tokens"),
        (dict(seq_lens=torch.tensor([40, 2], dtype=torch.int32)), ValueError, "blocks"),
        (
            dict(block_table=torch.tensor([[1, 9], [0, 2]], dtype=torch.int32)),
            ValueError,
            "block ids",
        ),
        (dict(query_start_loc=torch.tensor([0, 2, 1], dtype=torch.int32)), ValueError, "decreas"),
        (
            dict(k_cache=torch.randn(4, 16, 3, 16), v_cache=torch.randn(4, 16, 3, 16)),
            ValueError,
            "multiple",
        ),
    ],
)
def test_paged_attention_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        paged_attention(**_paged_args(**over), backend="native")


def _write_args(**over):
    args = dict(
        k=torch.randn(3, 2, 16),
        v=torch.randn(3, 2, 16),
        k_cache=torch.zeros(2, 16, 2, 16),
        v_cache=torch.zeros(2, 16, 2, 16),
        slot_mapping=torch.tensor([0, 5, -1]),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(k_cache=torch.zeros(2, 16, 2, 16).bfloat16()), TypeError, "one dtype"),
        (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), TypeError, "slot_mapping"),
        (dict(slot_mapping=torch.tensor([0, 32, 1])), ValueError, "slots"),
        (dict(slot_mapping=torch.tensor([0, 1])), ValueError, "slots for 3 tokens"),
        (dict(k=torch.randn(3, 1, 16), v=torch.randn(3, 1, 16)), ValueError, "heads, head_dim"),
        (dict(v_cache=torch.zeros(2, 16, 2, 16, device="meta")), ValueError, "device"),
    ],
)
def test_write_kv_cache_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        write_kv_cache(**_write_args(**over), backend="native")


def test_triton_unavailable_without_interpreter():
    if config.settings().triton_interpret:
        pytest.skip("TRITON_INTERPRET=1: the triton provider can run on the CPU here")
    q, k, v, cu = _ok()
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        attention(q, k, v, cu, backend="triton")


def test_triton_unsupported_head_dim():
    """The head-size check is the provider's, before any launch: on the GPU (or the
    interpreter)."""
    dev = "cuda" if HAS_CUDA else "cpu"
    skip_unless_runnable(dev, "triton", BackendUnavailableError)
    q, k, v, cu = _inputs([5], 2, 1, 40, torch.float32, dev)
    with pytest.raises(ValueError, match="head_dim 40 is not supported"):
        attention(q, k, v, cu, backend="triton")


def test_triton_interpreter_refuses_bf16(triton_on_cpu):
    q, k, v, cu = _inputs([5], 2, 1, 32, torch.bfloat16, "cpu")
    with pytest.raises(TypeError, match="bfloat16 is not supported in the Triton interpreter"):
        attention(q, k, v, cu, backend="triton")


def test_default_resolution():
    op = KernelRegistry.get_op("attention", device="cpu")
    assert op.provider.name == "native" and op.numerics == "attention/native-t64"
    if HAS_CUDA:
        assert KernelRegistry.get_op("attention", device="cuda").provider.name == "triton"


# ----------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama_shape_paths_and_numerics(dtype):
    """Llama-3-8B attention (32 q / 8 kv heads, D=128): Triton prefill == chunked == decode
    (pages of 16 and 32), numerics vs float64, deterministic backward."""
    device, hq, hkv, d = "cuda", 32, 8, 128
    lens = [1000, 77, 300]
    q, k, v, cu = _inputs(lens, hq, hkv, d, dtype, device, seed=20)
    full = attention(q, k, v, cu, backend="triton")
    rtol, atol = tolerance(dtype)
    assert_close(full, ref64(q, k, v, cu), rtol=rtol, atol=atol, what="triton llama fwd")
    n = lens[0]
    for bs in (16, 32):
        nblk = -(-n // bs)
        perm = torch.randperm(nblk + 3, generator=torch.Generator().manual_seed(bs))
        bt = perm[:nblk][None].to(device=device, dtype=torch.int32)
        kc = torch.zeros(nblk + 3, bs, hkv, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        pos = torch.arange(n, device=device)
        slots = bt[0].long()[pos // bs] * bs + pos % bs
        write_kv_cache(k[:n], v[:n], kc, vc, slots, backend="triton")
        outs = []
        bounds = [0, 7, 135, 600] + list(range(601, n + 1))
        for c0, c1 in zip(bounds, bounds[1:]):
            qsl = torch.tensor([0, c1 - c0], dtype=torch.int32, device=device)
            sl = torch.tensor([c1], dtype=torch.int32, device=device)
            outs.append(paged_attention(q[c0:c1], kc, vc, bt, sl, qsl, backend="triton"))
        assert_bitwise(torch.cat(outs), full[:n], f"triton page {bs}: chunked/decode vs prefill")
    dout = torch.randn(q.shape, device=device, dtype=dtype)
    g1 = _grads(q, k, v, cu, dout, "triton")
    g2 = _grads(q, k, v, cu, dout, "triton")
    for a, b, name in zip(g1, g2, ("out", "dq", "dk", "dv")):
        assert_bitwise(a, b, f"{name} run-to-run")


def test_strided_metadata_regression():
    """Metadata given as strided views (every other element of a longer tensor) must give the same
    bits as contiguous metadata on every provider that can run here."""
    torch.manual_seed(3)
    from rl_engine import KernelRegistry as _K

    # the providers that can run here (by their availability check, not by trying them: a
    # provider that should run and fails is a failure); the native one always can
    interp = config.settings().triton_interpret
    names = [
        p.name
        for p in _K.providers("attention", "cpu")
        if p.invariant and p.why_not("cpu", triton_interpret=interp) is None
    ]
    assert "native" in names, names
    q = torch.randn(11, 4, 16)
    k = torch.randn(11, 2, 16)
    v = torch.randn(11, 2, 16)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    cu_strided = torch.stack([cu, torch.full_like(cu, 99)], 1)[:, 0]
    assert cu_strided.stride(0) != 1
    for name in names:
        from rl_engine.ops import attention as _attn

        a = _attn(q, k, v, cu_strided, backend=name)
        b = _attn(q, k, v, cu, backend=name)
        assert torch.equal(a, b), f"attention with strided cu_seqlens ({name})"
