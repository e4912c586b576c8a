"""GPU: the trainer adapters on CUDA, where the registry resolves the Triton providers.

* The CPU trainer tests (tests/adapters/test_hf.py, test_megatron.py) again on CUDA: log-probs of
  the HF and the Megatron adapter bitwise equal across micro-batch sizes {1, 2, 5}, packed vs
  right- vs left-padded, Megatron == HF, the stock HF model differing, deterministic gradients,
  every op of the forward resolved to ``triton``. Tiny checkpoints (llama fp32, qwen2 bf16 tied,
  qwen3 bf16); Megatron runs on a one-process NCCL group (no CPU shim).
* Trainer log-probs == an HF ``generate()`` rollout with a KV cache. The rollout runs the patched
  Hugging Face model through ``generate`` (varlen prefill, then ``paged_attention`` decode steps
  against the KV cache); the trainer side is the teacher-forced ``token_logprobs`` of the HF
  adapter and of the Megatron adapter (when megatron-core is importable) on the generated
  sequences.

Skips without CUDA; the Megatron tests skip without megatron-core.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

transformers = pytest.importorskip("transformers")

import trainer_cases as tc  # noqa: E402

from rl_engine import KernelRegistry, ops  # noqa: E402
from rl_engine.adapters import hf as ha  # noqa: E402
from rl_engine.testing.invariance import assert_bitwise  # noqa: E402
from rl_engine.testing.tiny_models import make_tiny_model  # noqa: E402

PROMPT, NEW = 12, 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu") / "qwen3",
        "qwen3",
        "bfloat16",
        **tc.tiny_shape(hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=4096),
    )


@pytest.fixture(scope="module")
def model(ckpt):
    return tc.load_hf(ckpt, "bfloat16", device="cuda")


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_generate_vs_teacher_forced(model, batch):
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, 4096, (batch, PROMPT), generator=g).cuda()
    mask = torch.ones_like(prompts)
    seq, roll = tc.greedy_rollout(model, prompts, mask, NEW, 0.8)
    full = torch.ones_like(seq)
    with torch.no_grad():
        tf = ha.token_logprobs(model, seq, 0.8, attention_mask=full)
    assert_bitwise(tf[:, PROMPT - 1 :], roll, f"generate vs teacher forcing (batch {batch})")
    providers = {r["op"]: r["provider"] for r in KernelRegistry.report()}
    assert providers.get("attention") == "triton", providers
    assert providers.get("det_gemm") == "triton", providers


def test_generate_left_padded(model):
    g = torch.Generator().manual_seed(11)
    prompts = torch.randint(3, 4096, (4, PROMPT), generator=g).cuda()
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    mask[3, :7] = 0
    prompts = prompts * mask
    seq, roll = tc.greedy_rollout(model, prompts, mask, NEW, 1.0)
    full = torch.cat([mask, torch.ones_like(seq[:, PROMPT:])], 1)
    with torch.no_grad():
        tf = ha.token_logprobs(model, seq, 1.0, attention_mask=full)
    assert_bitwise(tf[:, PROMPT - 1 :], roll, "generate (left padded) vs teacher forcing")


def test_megatron_matches_rollout(model, ckpt, megatron):
    meg = megatron.from_pretrained(ckpt, device="cuda")
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, 4096, (5, PROMPT), generator=g).cuda()
    seq, roll = tc.greedy_rollout(model, prompts, torch.ones_like(prompts), NEW, 0.8)
    with torch.no_grad():
        lp = megatron.token_logprobs(meg, seq, 0.8)
    assert_bitwise(lp[:, PROMPT - 1 :], roll, "megatron trainer vs HF generate rollout")


# ------------------------------------------------------------------------------------------------
# The CPU trainer tests (test_hf.py, test_megatron.py) on CUDA with the Triton providers.

# (arch, dtype, tied), as test_megatron.CASES: every architecture, both dtypes, tied and untied.
CASES = [
    ("llama", "float32", False),
    ("qwen2", "bfloat16", True),
    ("qwen3", "bfloat16", True),
]
# the ops of a trainer forward; on CUDA each must resolve to the Triton provider by default
TRAINER_OPS = ("det_gemm", "rms_norm", "rope", "silu_and_mul", "attention", "linear_logp")
TEMP = 0.7


def _assert_triton(op_types=TRAINER_OPS):
    """Every default (non-pinned) CUDA resolution of ``op_types`` in this test chose ``triton``."""
    got: dict[str, set[str]] = {}
    for r in KernelRegistry.report():
        if r["device"] == "cuda" and not r["explicit"]:
            got.setdefault(r["op"], set()).add(r["provider"])
    for op in op_types:
        assert got.get(op) == {"triton"}, f"{op}: providers {got.get(op)}; report {got}"


@pytest.fixture(scope="module")
def megatron():
    """``rl_engine.adapters.megatron`` with a one-process NCCL group and Megatron's model-parallel
    state (TP = PP = 1) on the GPU; no CPU shim. Skips without megatron-core."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from rl_engine.adapters import megatron as ma

    if not dist.is_initialized():
        # one process: an in-process store, so no TCP port is needed (none can be raced for)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    return ma


tiny_ckpts = tc.case_ckpts_fixture(CASES, seed=3, folder="tiny")
hf_models = tc.hf_models_fixture("tiny_ckpts", device="cuda")


@pytest.fixture(scope="module")
def meg_models(megatron, tiny_ckpts):
    models = {c: megatron.from_pretrained(p, device="cuda") for c, p in tiny_ckpts.items()}
    for c, m in models.items():
        p = next(m.parameters())
        assert p.is_cuda and p.dtype == getattr(torch, c[1]), (c, p.device, p.dtype)
    return models


def _cuda_lp(token_logprobs, model, temperature=TEMP):
    """``fn(ids, mask)`` for ``tc.micro_batched``: CPU inputs -> CUDA log-probs."""

    def fn(ids, mask):
        with torch.no_grad():
            return token_logprobs(model, ids.cuda(), temperature, attention_mask=mask.cuda())

    return fn


def _check_layouts(token_logprobs, model):
    """Micro-batch sizes {1, 2} == 5, packed == padded, left == right padding (bitwise)."""
    seqs, ref, lp_packed, lp_left = tc.check_layouts(token_logprobs, model, TEMP, device="cuda")
    assert ref[0].is_cuda and ref[0].dtype == torch.float32
    assert torch.all(lp_left[1:, 0] == 0)  # masked positions are exact zeros
    assert int((lp_packed == 0).sum()) >= len(seqs) - 1
    return seqs, ref


@pytest.mark.parametrize("case", CASES, ids=tc.case_id)
def test_hf_micro_batch_and_layout_invariance_cuda(hf_models, case):
    """HF adapter on CUDA: bitwise equal across micro-batch sizes {1, 2, 5}, packed
    (cu_seqlens), packed via restarting position ids, right- and left-padded; Triton ops."""
    model = hf_models[case]
    seqs, ref = _check_layouts(ha.token_logprobs, model)
    tc.check_packed_via_position_ids(model, seqs, ref, TEMP, device="cuda")
    _assert_triton(TRAINER_OPS + ("logp",))


@pytest.mark.parametrize("case", CASES, ids=tc.case_id)
def test_megatron_micro_batch_and_layout_invariance_cuda(megatron, meg_models, case):
    """Megatron adapter on CUDA: bitwise equal across micro-batch sizes {1, 2, 5}, packed
    (cu_seqlens), right- and left-padded; every op resolved to Triton."""
    _check_layouts(megatron.token_logprobs, meg_models[case])
    _assert_triton()


@pytest.mark.parametrize("case", CASES, ids=tc.case_id)
def test_megatron_matches_hf_adapter_cuda(megatron, meg_models, hf_models, case):
    """Megatron adapter == HF adapter on CUDA, bitwise (same checkpoint), right-padded (one
    [T, B] batch in Megatron) and left-padded (unpadded into packed sequences)."""
    seqs = tc.sequences(1)
    for name, (ids, mask) in (("right", tc.right_padded(seqs)), ("left", tc.left_padded(seqs))):
        ids, mask = ids.cuda(), mask.cuda()
        with torch.no_grad():
            a = megatron.token_logprobs(meg_models[case], ids, 1.0, attention_mask=mask)
            b = ha.token_logprobs(hf_models[case], ids, 1.0, attention_mask=mask)
        assert_bitwise(a, b, f"megatron vs hf {tc.case_id(case)} ({name} padded)")
    _assert_triton()


@pytest.mark.parametrize("case", CASES, ids=tc.case_id)
def test_stock_hf_mismatches_cuda(hf_models, tiny_ckpts, case):
    """The "before" picture on CUDA: the stock (unpatched) transformers model's log-probs
    (``logp`` on its logits) differ across micro-batch sizes or from the patched model's."""
    stock = tc.load_hf(tiny_ckpts[case], case[1], patch=False, device="cuda")

    def stock_fn(ids, mask):
        with torch.no_grad():
            ids = ids.cuda()
            logits = stock(ids, attention_mask=mask.cuda()).logits[:, :-1]
            b, t1, v = logits.shape
            return ops.logp(logits.reshape(b * t1, v), ids[:, 1:].reshape(-1), TEMP).view(b, t1)

    seqs = tc.sequences()
    patched = tc.micro_batched(_cuda_lp(ha.token_logprobs, hf_models[case]), seqs, 5)
    by_mbs = {mbs: tc.micro_batched(stock_fn, seqs, mbs) for mbs in (1, 2, 5)}
    within = sum(tc.count_mismatches(by_mbs[m], by_mbs[5]) for m in (1, 2))
    vs_patched = tc.count_mismatches(by_mbs[5], patched)
    assert within + vs_patched > 0, "stock transformers happened to equal the patched model"


def _grads_twice(model, lp_fn, ids, mask):
    """Two identical forward + backward passes: (log-probs, {name: grad}) of each."""
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        lp = lp_fn(model, ids, TEMP, attention_mask=mask)
        (-lp.sum()).backward()
        runs.append(
            (
                lp.detach(),
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    return runs


def _check_backward_deterministic(model, lp_fn, probe: str, then=None):
    """``model`` in training mode, two identical forward + backward passes of ``lp_fn`` on
    right-padded sequences: log-probs and every parameter's gradient bitwise equal run to run,
    the gradient of ``probe`` not zero. ``then(ids, mask, lp)`` runs after, still in training
    mode; the model is left in eval mode without gradients."""
    seqs = tc.sequences()[1:4]
    ids, mask = (x.cuda() for x in tc.right_padded(seqs))
    model.train()
    try:
        (lp0, g0), (lp1, g1) = _grads_twice(model, lp_fn, ids, mask)
        assert_bitwise(lp0, lp1, "log-probs run-to-run")
        assert set(g0) == {n for n, _ in model.named_parameters()}
        for n in g0:
            assert_bitwise(g0[n], g1[n], f"grad {n} run-to-run")
        assert g0[probe].abs().sum() > 0
        if then is not None:
            then(ids, mask, lp0)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


@pytest.mark.parametrize("case", CASES[:2], ids=tc.case_id)
def test_hf_backward_deterministic_cuda(hf_models, case):
    """HF adapter on CUDA: gradients (and log-probs) bitwise equal run to run."""
    _check_backward_deterministic(
        hf_models[case], ha.token_logprobs, "model.layers.0.self_attn.q_proj.weight"
    )
    _assert_triton()


@pytest.mark.parametrize("case", CASES[:2], ids=tc.case_id)
def test_megatron_backward_deterministic_cuda(megatron, meg_models, case):
    """Megatron adapter on CUDA: gradients bitwise equal run to run; the forward ignores extra
    right padding (see test_megatron.test_backward_deterministic for why only that)."""
    model = meg_models[case]

    def extra_right_padding(ids, mask, lp0):
        pad = torch.zeros(ids.shape[0], 3, dtype=ids.dtype, device=ids.device)
        with torch.no_grad():
            lp_pad = megatron.token_logprobs(
                model, torch.cat([ids, pad], 1), TEMP, attention_mask=torch.cat([mask, pad], 1)
            )
        assert_bitwise(lp_pad[:, : ids.shape[1] - 1], lp0, "forward with extra right padding")

    _check_backward_deterministic(
        model,
        megatron.token_logprobs,
        "decoder.layers.0.self_attention.linear_qkv.weight",
        then=extra_right_padding,
    )
    _assert_triton()
