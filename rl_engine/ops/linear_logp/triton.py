"""``triton`` provider of ``linear_logp``: Triton LM-head GEMM + the shared Triton vocabulary
reduction, chunk by chunk, never holding [T, V] logits.

Numerics (family ``linear_logp/triton-v1024[det_gemm/triton+logp/triton-v1024]``):

* **Forward.** Tokens in chunks of ``TOKEN_CHUNK = 512`` rows. For each chunk, the logits
  ``det_gemm(hidden[rows], weight.t())`` in ``hidden.dtype`` through the Triton ``det_gemm``
  provider (row and column invariant: they equal the matching rows of the full product), then
  the vocabulary reduction of :mod:`rl_engine.ops.logp.triton` on them (row invariant). Hence,
  bitwise and whatever the chunk size::

      linear_logp(h, W, t, T) == logp(det_gemm(h, W.t()), t, T)      # both Triton families
      entropy part            == entropy(det_gemm(h, W.t()), T)

  The chunk's logits are the only large temporary: 512 x V in ``hidden.dtype`` (bf16,
  V = 151936: 156 MB, 3.1% of the fp32 [8192, V] logits).
* **Backward.** Blocks of ``BWD_TOKEN_CHUNK`` (8192) tokens x ``VOCAB_SLICE`` vocabulary columns
  (the hidden size rounded down to a multiple of 2048: 2048 for H = 2048, 4096 for H = 4096),
  vocabulary slices outer, token blocks inner, each in order. For each block: the
  logits are recomputed with the same ``det_gemm`` (row and column invariant, so the forward's
  bits), ``dlogits`` are formed **in place** by the shared backward kernel (``logp``'s and
  ``entropy``'s formulas, from the forward's ``lse`` / ``entropy``) and rounded to
  ``hidden.dtype`` (fp32 for fp32 inputs), then

  - ``dweight[slice]``: ``det_gemm_wgrad(dlogits, hidden[rows])`` continuing the fp32 sum of the
    earlier token blocks (``accumulate``), one rounding to ``weight.dtype`` (in the kernel when
    one block covers T);
  - ``dhidden[rows]``: ``det_gemm_wgrad(dlogits.t(), weight[slice], chunk=DH_CHUNK)``
    (``dlogits @ W``, the vocabulary in chunks of ``DH_CHUNK`` = 2048 columns) continuing the
    fp32 sum of the earlier slices, one rounding to ``hidden.dtype``.

  The token blocks are multiples of ``WGRAD_CHUNK`` (4096) of :mod:`rl_engine.ops.det_gemm`, the
  vocabulary slices multiples of ``DH_CHUNK``, and each product continues the running sum chunk
  by chunk, so the partials and their order are those of one product over everything: given
  the same ``dlogits`` [T, V], bitwise and for every T and V (and any such block sizes)::

      dweight == det_gemm_wgrad(dlogits, hidden).to(weight.dtype)
      dhidden == det_gemm_wgrad(dlogits.t(), weight, chunk=DH_CHUNK).to(hidden.dtype)

  dhidden is row invariant (row t depends on row t only); dweight is deterministic and
  invariant to zero-padding rows (zero rows add exact zeros).
  Peak extra memory of the backward: one [8192, VOCAB_SLICE] block in ``hidden.dtype`` (no
  more elements than dhidden) and fp32 [T, H] for dhidden, plus an fp32 [VOCAB_SLICE, H]
  dweight slice when T > 8192; bf16, T = 8192, H = 2048: 96 MB. None of it is [T, V].
  (Version 1: [8192, 16384] blocks and separate fp32 partials, 530 MB there; in the trainer
  benchmark that put rl_engine's peak at 1.05x the Liger stack's.)

Not promised: the backward equals the unfused composition's backward bitwise (dhidden here
accumulates in fp32 across vocabulary chunks); identity with the ``native`` family, across GPU
models or Triton versions. On the CPU the kernels run in the Triton interpreter
(``TRITON_INTERPRET=1``): a test vehicle whose bits are not the GPU's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rl_engine.ops import _triton
from rl_engine.ops._common import signature_of
from rl_engine.ops.det_gemm import config as _gemm_config
from rl_engine.ops.det_gemm import triton as _gemm
from rl_engine.ops.linear_logp import reference
from rl_engine.ops.logp import triton as _vocab
from rl_engine.ops.logp.reference import check_token_range

__all__ = [
    "BWD_TOKEN_CHUNK",
    "DH_CHUNK",
    "PROVIDER",
    "TOKEN_CHUNK",
    "VOCAB_SLICE",
    "linear_logp",
    "linear_logp_backward",
    "linear_logp_forward",
]

# Forward token chunk: no effect on the bits (row-invariant GEMM and reduction); memory only.
TOKEN_CHUNK = 512
# dhidden's vocabulary reduction: fp32 partials over DH_CHUNK columns each (a fresh accumulator),
# added in vocabulary order (numerics: ``det_gemm_wgrad(dlogits.t(), W, chunk=DH_CHUNK)``).
# dweight's token reduction is det_gemm_wgrad's own (WGRAD_CHUNK tokens).
DH_CHUNK = _gemm_config.WGRAD_CHUNK // 2
# Backward blocks: a launch choice, not numerics. Any multiples of the two chunks give the same
# bits: each weight-gradient product continues the fp32 sum of the earlier blocks (``accumulate``),
# so the partials are the chunks of one product over all tokens (dweight) or over the whole
# vocabulary (dhidden). Memory: one [BWD_TOKEN_CHUNK, VOCAB_SLICE] block in hidden.dtype.
# VOCAB_SLICE None: the largest multiple of DH_CHUNK not above the hidden size (one chunk at
# least), so that a block holds no more elements than the [T, H] dhidden the backward returns
# (whose rounding, next to the fp32 sum, is the backward's last and largest moment anyway).
BWD_TOKEN_CHUNK = 2 * _gemm_config.WGRAD_CHUNK
VOCAB_SLICE: int | None = None


def _vocab_slice(hidden_size: int) -> int:
    if VOCAB_SLICE is not None:
        return VOCAB_SLICE
    return max(DH_CHUNK, hidden_size // DH_CHUNK * DH_CHUNK)


NUMERICS = f"linear_logp/{_vocab.NUMERICS}[{_gemm.PROVIDER.numerics}+logp/{_vocab.NUMERICS}]"


def _logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``det_gemm(h, w.t())`` through the Triton det_gemm provider, in ``h.dtype`` (the
    wide-product launch config for 16-bit inputs; a launch choice only, the same bits)."""
    cfg = _gemm_config.LM_HEAD if h.dtype != torch.float32 else None
    return _gemm.det_gemm_with_config(h, w.t(), None, cfg)


@signature_of(reference.linear_logp_forward)
def linear_logp_forward(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, lse)`` fp32 [T]; ``entropy`` is empty [0] unless ``return_entropy``.

    Takes the arguments of :func:`rl_engine.ops.linear_logp.reference.linear_logp_forward`,
    trusted (checked at the public entry).
    """
    hidden, weight, tokens, temperature, return_entropy = args
    _vocab.check_device(hidden, "linear_logp")
    check_token_range(tokens, weight.shape[0])
    if TOKEN_CHUNK <= 0:
        raise ValueError(f"linear_logp[triton]: TOKEN_CHUNK ({TOKEN_CHUNK}) must be positive")
    return chunked_forward(
        hidden, weight, tokens, temperature, return_entropy, _logits, TOKEN_CHUNK
    )


def chunked_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, lse)`` over chunks of ``chunk`` tokens: per chunk the logits
    ``logits_of(hidden[rows], weight)``, then the Triton vocabulary reduction of
    :mod:`rl_engine.ops.logp.triton` into that chunk's slices of the outputs (row by row, so
    the chunk is a memory choice). Shared with the ``unfused`` provider (other logits)."""
    n = hidden.shape[0]
    dev = hidden.device
    f32 = torch.float32
    out_lp = torch.empty(n, dtype=f32, device=dev)
    out_lse = torch.empty(n, dtype=f32, device=dev)
    out_ent = torch.empty(n if return_entropy else 0, dtype=f32, device=dev)
    tok = tokens.long().contiguous()
    for r0 in range(0, n, chunk):
        sl = slice(r0, r0 + chunk)
        logits = logits_of(hidden[sl], weight)
        _vocab.vocab_forward(
            logits,
            tok[sl],
            temperature,
            with_entropy=return_entropy,
            out_logp=out_lp[sl],
            out_ent=out_ent[sl] if return_entropy else None,
            out_lse=out_lse[sl],
        )
        del logits
    return out_lp, out_ent, out_lse


@signature_of(reference.linear_logp_backward)
def linear_logp_backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dhidden, dweight)`` in the inputs' dtypes (empty [0] where not needed).

    Takes the arguments of :func:`rl_engine.ops.linear_logp.reference.linear_logp_backward`:
    ``grad_logp`` / ``grad_entropy`` are the upstream gradients [T] (``None``: zero);
    ``entropy`` is the forward's entropy (used only with ``grad_entropy``).
    """
    hidden, weight, tokens, temperature, lse, entropy, grad_logp, grad_entropy = args[:8]
    need_dhidden, need_dweight = args[8:]
    _vocab.check_device(hidden, "linear_logp")
    tok_block, vocab_slice, dh_chunk = BWD_TOKEN_CHUNK, _vocab_slice(hidden.shape[1]), DH_CHUNK
    if min(tok_block, vocab_slice) <= 0 or tok_block % _gemm.WGRAD_CHUNK or vocab_slice % dh_chunk:
        raise ValueError(
            f"linear_logp[triton]: BWD_TOKEN_CHUNK ({tok_block}) must be a positive multiple of "
            f"WGRAD_CHUNK ({_gemm.WGRAD_CHUNK}) and VOCAB_SLICE ({vocab_slice}) of DH_CHUNK "
            f"({dh_chunk})"
        )
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    f32 = torch.float32
    no_grad = grad_logp is None and grad_entropy is None
    if no_grad or n == 0 or not (need_dhidden or need_dweight):
        dh = torch.zeros(hidden.shape if need_dhidden else 0, dtype=hidden.dtype, device=dev)
        dw = torch.zeros(weight.shape if need_dweight else 0, dtype=weight.dtype, device=dev)
        return dh, dw
    tok = tokens.long().contiguous()
    lse = lse.float().contiguous()
    gl = grad_logp.float().contiguous() if grad_logp is not None else None
    ge = grad_entropy.float().contiguous() if grad_entropy is not None else None
    ent = entropy.float().contiguous() if grad_entropy is not None else None
    dh_acc = torch.empty(hidden.shape, dtype=f32, device=dev) if need_dhidden else None
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_dweight else None
    # dweight rows straight into dw (rounded once in the kernel) when one token block covers T
    # (or dw is fp32); else an fp32 slice the token blocks accumulate into, rounded at its end
    dw_direct = n <= tok_block or weight.dtype == f32
    for v0 in range(0, vocab, vocab_slice):  # vocabulary slices, in order
        w = weight[v0 : v0 + vocab_slice]
        dw_sum = None
        if dw is not None:
            dw_sum = dw[v0 : v0 + vocab_slice] if dw_direct else w.new_empty(w.shape, dtype=f32)
        for r0 in range(0, n, tok_block):  # token blocks, in order
            sl = slice(r0, r0 + tok_block)
            h = hidden[sl]
            block = _logits(h, w)  # [rows, slice] in hidden.dtype: the forward's bits
            _vocab.vocab_backward(
                block,
                temperature,
                lse[sl],
                tokens=tok[sl] if gl is not None else None,
                grad_logp=gl[sl] if gl is not None else None,
                entropy=ent[sl] if ent is not None else None,
                grad_entropy=ge[sl] if ge is not None else None,
                col0=v0,
                out=block,  # in place: block now holds dlogits
            )
            if dw_sum is not None:  # continues the token sum of the earlier blocks
                _gemm.det_gemm_wgrad(block, h, out=dw_sum, accumulate=r0 > 0)
            if dh_acc is not None:  # dlogits @ w, continuing the earlier slices' sum
                _gemm.det_gemm_wgrad(
                    block.t(), w, out=dh_acc[sl], accumulate=v0 > 0, chunk=dh_chunk
                )
            del block
        if dw is not None and not dw_direct:
            dw[v0 : v0 + vocab_slice] = dw_sum
        del dw_sum
    dh = dh_acc.to(hidden.dtype) if dh_acc is not None else hidden.new_empty(0)
    return dh, (dw if dw is not None else weight.new_empty(0))


@signature_of(reference.linear_logp)
def linear_logp(*args: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LM-head token log-probabilities in Triton without materialising the logits.

    Bitwise equal to ``logp(det_gemm(hidden, weight.t()), tokens, temperature)`` (and the
    entropy to ``entropy(det_gemm(hidden, weight.t()), temperature)``) with the ``triton``
    providers of those ops; see the module docstring.

    Args:
        hidden: [T, H] float32 / bfloat16 / float16.
        weight: [V, H] same dtype (the LM head as stored).
        tokens: [T] int64 / int32 ids in ``[0, V)``.
        temperature: Python float > 0.
        return_entropy: also return the entropy [T].

    Returns:
        ``logp`` fp32 [T], or ``(logp, entropy)`` when ``return_entropy``.
    """
    reference._check(*args)
    lp, ent, _ = linear_logp_forward(*args)
    return_entropy = args[4]
    return (lp, ent) if return_entropy else lp


def _available(device: str, *, triton_interpret: bool) -> str | None:
    return _triton.available(device, triton_interpret=triton_interpret) or _gemm.PROVIDER.why_not(
        device, triton_interpret=triton_interpret
    )


PROVIDER = _triton.triton_provider(
    numerics=NUMERICS,
    fn=linear_logp,
    # 2: dhidden over DH_CHUNK vocabulary chunks and dweight over WGRAD_CHUNK token chunks, for
    # any T and V (v1: fp32 partials of [8192, 16384] blocks; other bits for V > 2048 or
    # T > 8192); the blocks became a launch choice (memory)
    version="2",
    available=_available,
    extras={"forward": linear_logp_forward, "backward": linear_logp_backward},
)
