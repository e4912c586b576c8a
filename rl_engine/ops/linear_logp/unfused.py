"""``unfused`` provider of ``linear_logp``: the LM head's logits through the *resolved*
``det_gemm``, then the Triton log-softmax on them, one token chunk at a time. Opt-in.

Numerics (family ``linear_logp/unfused-v1024[logp/triton-v1024]``): for each chunk of
:data:`TOKEN_CHUNK` rows, ``logits = det_gemm(hidden[rows], weight.t())`` (in ``hidden.dtype``,
whatever provider ``det_gemm`` resolves to), then ``logp`` / entropy / log-sum-exp of those rows
by the Triton ``logp`` kernels (family ``logp/triton-v1024``). Both ops are row invariant, so::

    linear_logp[unfused](h, W, t, T) == logp[triton](det_gemm(h, W.t()), t, T)     # bitwise

for any T, which is what a vLLM rollout computes on its logits with the plugin. That is why it
exists: the fused ``triton`` provider computes its logits with the Triton det_gemm and refuses an
opt-in det_gemm family (``RL_ENGINE_BACKEND_DET_GEMM=cuda``), and the ``native`` one adds the
native log-softmax (other bits than the rollout's Triton ``logp``, and an fp32 weight gradient the
cuda det_gemm does not take). With the cuda family: pin ``RL_ENGINE_BACKEND_LINEAR_LOGP=unfused``
in the trainers and keep the rollout's ``logp`` on Triton.

Backward, per token chunk in order: the logits again, ``dlogits`` by the Triton ``logp``
backward in ``hidden.dtype`` (what autograd through ``logp(det_gemm(...))`` computes), then
``dhidden[rows] = det_gemm(dlogits, weight)`` (row invariant: equal to that autograd) and the
weight gradient ``det_gemm_wgrad(hidden[rows], dlogits)`` summed over the chunks in order in fp32,
rounded once (for T <= TOKEN_CHUNK equal to that autograd; above, the fixed chunking adds the
chunk partials: deterministic, invariant to appended zero rows).

Memory: the [TOKEN_CHUNK, V] logits of one chunk (and its dlogits in the backward), e.g. 311 MB
each at 1,024 tokens x a 151,936 vocabulary in bf16; the fused providers hold none.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import FLOAT_DTYPES, signature_of
from rl_engine.ops.linear_logp import reference
from rl_engine.ops.linear_logp import triton as _fused
from rl_engine.ops.logp import triton as _vocab
from rl_engine.registry import Provider

__all__ = ["NUMERICS", "PROVIDER", "TOKEN_CHUNK", "linear_logp"]

# Rows of logits held at once (memory only: every output row is the same for any chunking but
# the weight gradient's, whose chunk partials it adds; fixed, never derived from T).
TOKEN_CHUNK = 1024
NUMERICS = f"linear_logp/unfused-v{_vocab.VOCAB_TILE}[logp/{_vocab.NUMERICS}]"


# the resolved det_gemm provider and its logits in hidden.dtype, as the reference computes them
_gemm = reference._gemm_provider
_logits = reference._logits


@signature_of(reference.linear_logp_forward)
def linear_logp_forward(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, lse)`` fp32 [T] (``entropy`` empty [0] unless ``return_entropy``);
    the arguments of :func:`rl_engine.ops.linear_logp.reference.linear_logp_forward`."""
    hidden, weight, tokens, temperature, return_entropy = args
    _vocab.check_device(hidden, "linear_logp")
    reference.check_token_range(tokens, weight.shape[0])
    gemm = _gemm(hidden.device)
    return _fused.chunked_forward(
        hidden, weight, tokens, temperature, return_entropy,
        lambda h, w: _logits(h, w, gemm), TOKEN_CHUNK,
    )  # fmt: skip


@signature_of(reference.linear_logp_backward)
def linear_logp_backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dhidden, dweight)`` in the inputs' dtypes (empty [0] where not needed); the
    arguments of :func:`rl_engine.ops.linear_logp.reference.linear_logp_backward`."""
    hidden, weight, tokens, temperature, lse, entropy, grad_logp, grad_entropy = args[:8]
    need_dhidden, need_dweight = args[8:]
    _vocab.check_device(hidden, "linear_logp")
    n, dev = hidden.shape[0], hidden.device
    no_grad = grad_logp is None and grad_entropy is None
    if no_grad or n == 0 or not (need_dhidden or need_dweight):
        dh = torch.zeros(hidden.shape if need_dhidden else 0, dtype=hidden.dtype, device=dev)
        dw = torch.zeros(weight.shape if need_dweight else 0, dtype=weight.dtype, device=dev)
        return dh, dw
    gemm = _gemm(dev)
    tok = tokens.long().contiguous()
    lse = lse.float().contiguous()
    gl = grad_logp.float().contiguous() if grad_logp is not None else None
    ge = grad_entropy.float().contiguous() if grad_entropy is not None else None
    ent = entropy.float().contiguous() if grad_entropy is not None else None
    dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=dev) if need_dhidden else None
    dw_t = None  # fp32 [H, V]: the operand order of det_gemm's own gradient of b = weight.t()
    for r0 in range(0, n, TOKEN_CHUNK):
        sl = slice(r0, r0 + TOKEN_CHUNK)
        h = hidden[sl]
        dlogits = _vocab.vocab_backward(
            _logits(h, weight, gemm), temperature, lse[sl],
            tokens=tok[sl] if gl is not None else None,
            grad_logp=gl[sl] if gl is not None else None,
            entropy=ent[sl] if ent is not None else None,
            grad_entropy=ge[sl] if ge is not None else None,
        )  # fmt: skip
        if dh is not None:
            dh[sl] = torch.ops.rl_engine.det_gemm(dlogits, weight, None, gemm)
        if need_dweight:
            part = torch.ops.rl_engine.det_gemm_wgrad(h, dlogits, gemm)
            dw_t = part if dw_t is None else dw_t + part
        del dlogits
    dw = dw_t.t().to(weight.dtype).contiguous() if dw_t is not None else weight.new_empty(0)
    return (dh if dh is not None else hidden.new_empty(0)), dw


@signature_of(reference.linear_logp)
def linear_logp(*args: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LM-head token log-probabilities: the resolved det_gemm's logits, the Triton log-softmax
    (module docstring). Arguments and returns of
    :func:`rl_engine.ops.linear_logp.reference.linear_logp`."""
    reference._check(*args)
    lp, ent, _ = linear_logp_forward(*args)
    return (lp, ent) if args[4] else lp


PROVIDER = Provider(
    op="linear_logp",
    name="unfused",
    devices=("cuda", "cpu"),
    dtypes=FLOAT_DTYPES,
    invariant=True,
    numerics=NUMERICS,
    fn=linear_logp,
    version="1",
    available=_triton.available,  # the Triton logp kernels (CPU: the interpreter)
    extras={"forward": linear_logp_forward, "backward": linear_logp_backward},
    opt_in=True,
)
