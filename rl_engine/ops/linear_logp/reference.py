"""PyTorch reference of ``linear_logp`` (the ``native`` provider): the spec of the op.

``linear_logp(hidden, weight, tokens, T)`` is, bitwise, ``logp(det_gemm(hidden, weight.t()),
tokens, T)`` (and its entropy ``entropy(det_gemm(hidden, weight.t()), T)``) without ever holding
the [tokens, vocab] logits:

* Tokens are processed in chunks of ``TOKEN_CHUNK`` rows and the vocabulary in chunks of
  ``VOCAB_CHUNK`` columns (a multiple of ``VOCAB_TILE``). For each chunk pair the logits
  ``det_gemm(hidden[rows], weight[cols].t())`` (in ``hidden.dtype``) are computed with the
  resolved ``det_gemm`` provider, which is row and column invariant, so they equal the matching
  block of the full product; they are fed to the shared
  :class:`~rl_engine.ops.logp.reference.VocabLogSumExp` in vocabulary order, i.e. the same tiles
  in the same order as ``logp``. Forward results therefore do not depend on the chunk sizes.
* Backward recomputes each logits block and forms ``dz`` tile by tile (the formulas of
  :func:`~rl_engine.ops.logp.reference.dz_tile`), ``dlogits = dz / T`` in fp32, then

  - ``dhidden[rows] = sum over vocab chunks (in order) of det_gemm(dlogits, weight[cols].float())``
    in fp32, rounded once to ``hidden.dtype``: row invariant.
  - ``dweight[cols] = sum over token chunks (in order) of det_gemm_wgrad(dlogits, hidden[rows])``
    in fp32 (inside a chunk: rows in groups of 16, see ``det_gemm``), rounded once to
    ``weight.dtype``: deterministic, fixed order, invariant to appended zero rows.

Peak extra memory: O(TOKEN_CHUNK x VOCAB_CHUNK) for the logits block (plus the GEMM's own work
tile) and, in the backward, an fp32 [V, H] accumulator for ``dweight``.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops._common import (
    check_float,
    check_same_device,
    check_same_dtype,
    check_tensors,
)
from rl_engine.ops.logp.reference import (
    VOCAB_TILE,
    VocabLogSumExp,
    check_temperature,
    check_token_range,
    check_tokens,
    dz_tile,
    scale,
    temperature_tensor,
)

__all__ = [
    "TOKEN_CHUNK",
    "VOCAB_CHUNK",
    "linear_logp",
    "linear_logp_backward",
    "linear_logp_forward",
]

# Work tiles. The forward result does not depend on them. The backward's dhidden depends on
# VOCAB_CHUNK (partial sums over vocabulary chunks) and dweight on TOKEN_CHUNK (partial sums
# over token chunks): both are fixed numbers, never derived from the token count.
TOKEN_CHUNK = 256
VOCAB_CHUNK = 4 * VOCAB_TILE


def _check(hidden: Any, weight: Any, tokens: Any, temperature: Any, return_entropy: Any) -> None:
    check_tensors(2, hidden=hidden, weight=weight)
    check_float("hidden", hidden)
    check_tokens(tokens, hidden.shape[0])
    check_same_device(hidden=hidden, weight=weight, tokens=tokens)
    check_same_dtype(hidden=hidden, weight=weight)
    check_temperature(temperature)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy must be a bool, got {type(return_entropy).__name__}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"linear_logp: hidden [T, H] = {list(hidden.shape)} and weight [V, H] = "
            f"{list(weight.shape)} disagree on H"
        )
    if weight.shape[0] == 0:
        raise ValueError("linear_logp: weight has an empty vocabulary dimension (shape [0, H])")


def _chunks() -> tuple[int, int]:
    if VOCAB_CHUNK % VOCAB_TILE or VOCAB_CHUNK <= 0 or TOKEN_CHUNK <= 0:
        raise ValueError(
            f"VOCAB_CHUNK ({VOCAB_CHUNK}) must be a positive multiple of VOCAB_TILE "
            f"({VOCAB_TILE}) and TOKEN_CHUNK ({TOKEN_CHUNK}) positive"
        )
    return TOKEN_CHUNK, VOCAB_CHUNK


def _gemm_provider(device: torch.device) -> str:
    from rl_engine.registry import resolve_provider

    return resolve_provider("det_gemm", device.type)


def _logits(h: torch.Tensor, w: torch.Tensor, gemm: str) -> torch.Tensor:
    """``det_gemm(h, w.t())`` through the resolved det_gemm provider, in ``h.dtype``."""
    import rl_engine.ops.det_gemm  # noqa: F401  (registers rl_engine::det_gemm)

    return torch.ops.rl_engine.det_gemm(h, w.t(), None, gemm)


def _blocks_setup(
    hidden: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[tuple[int, int], torch.Tensor, str, torch.Tensor]:
    """What the forward and the backward pass over the (token chunk, vocabulary chunk) blocks
    start from: ``(TOKEN_CHUNK, VOCAB_CHUNK)``, the temperature as a tensor on ``hidden``'s
    device, the resolved ``det_gemm`` provider and the tokens as int64."""
    dev = hidden.device
    return _chunks(), temperature_tensor(temperature, dev), _gemm_provider(dev), tokens.long()


def linear_logp_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, lse)`` fp32 [T]; ``entropy`` is empty [0] unless ``return_entropy``.
    The arguments are trusted: checked once at the public entry (the op's ``_run``, or
    :func:`linear_logp`)."""
    check_token_range(tokens, weight.shape[0])
    (tc, vc), temp, gemm, tok = _blocks_setup(hidden, tokens, temperature)
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    out_logp = torch.empty(n, dtype=torch.float32, device=dev)
    out_lse = torch.empty(n, dtype=torch.float32, device=dev)
    out_ent = torch.empty(n if return_entropy else 0, dtype=torch.float32, device=dev)
    for r0 in range(0, n, tc):
        h = hidden[r0 : r0 + tc]
        tk = tok[r0 : r0 + tc]
        state = VocabLogSumExp(h.shape[0], dev, with_entropy=return_entropy)
        target = torch.zeros(h.shape[0], dtype=torch.float32, device=dev)
        for c0 in range(0, vocab, vc):
            logits = _logits(h, weight[c0 : c0 + vc], gemm)
            state.add(logits, temp)
            width = logits.shape[1]
            inside = (tk >= c0) & (tk < c0 + width)
            idx = (tk - c0).clamp(0, width - 1)
            target = torch.where(inside, scale(logits.gather(1, idx[:, None])[:, 0], temp), target)
            del logits
        if return_entropy:
            lse, ent = state.lse_and_entropy()
            out_ent[r0 : r0 + tc] = ent
        else:
            lse = state.lse()
        out_lse[r0 : r0 + tc] = lse
        out_logp[r0 : r0 + tc] = target - lse
    return out_logp, out_ent, out_lse


def linear_logp_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    need_dhidden: bool,
    need_dweight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dhidden, dweight)`` in the inputs' dtypes (empty [0] where not needed).

    ``grad_logp`` / ``grad_entropy`` are the upstream gradients [T] (``None``: zero);
    ``entropy`` is the forward's entropy (used only with ``grad_entropy``).
    """
    (tc, vc), temp, gemm, tok = _blocks_setup(hidden, tokens, temperature)
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    dh = torch.zeros(hidden.shape if need_dhidden else 0, dtype=torch.float32, device=dev)
    dw = torch.zeros(weight.shape if need_dweight else 0, dtype=torch.float32, device=dev)
    if (grad_logp is None and grad_entropy is None) or not (need_dhidden or need_dweight):
        return dh.to(hidden.dtype), dw.to(weight.dtype)
    for r0 in range(0, n, tc):
        h = hidden[r0 : r0 + tc]
        sl = slice(r0, r0 + tc)
        gl = grad_logp[sl].float() if grad_logp is not None else None
        ge = grad_entropy[sl].float() if grad_entropy is not None else None
        ent = entropy[sl] if grad_entropy is not None else None
        for c0 in range(0, vocab, vc):
            w = weight[c0 : c0 + vc]
            logits = _logits(h, w, gemm)
            dlogits = torch.empty(logits.shape, dtype=torch.float32, device=dev)
            for t0 in range(0, logits.shape[1], VOCAB_TILE):
                z = scale(logits[:, t0 : t0 + VOCAB_TILE], temp)
                dz = dz_tile(
                    z,
                    lse[sl],
                    col0=c0 + t0,
                    tokens=tok[sl],
                    grad_logp=gl,
                    entropy=ent,
                    grad_entropy=ge,
                )
                dlogits[:, t0 : t0 + VOCAB_TILE] = dz / temp
            del logits
            if need_dhidden:
                dh[sl] += torch.ops.rl_engine.det_gemm(dlogits, w.float(), None, gemm)
            if need_dweight:
                dw[c0 : c0 + vc] += torch.ops.rl_engine.det_gemm_wgrad(dlogits, h.float(), gemm)
    return dh.to(hidden.dtype), dw.to(weight.dtype)


def linear_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token log-probabilities of an LM head without materialising the logits.

    Equivalent, bitwise, to ``logp(det_gemm(hidden, weight.t()), tokens, temperature)`` (and
    ``entropy(det_gemm(hidden, weight.t()), temperature)``), the logits being in
    ``hidden.dtype``; see the module docstring for the chunking.

    Args:
        hidden: [T, H] float32 / bfloat16 / float16 (the final hidden states).
        weight: [V, H] same dtype (the LM head as stored, ``nn.Linear`` layout).
        tokens: [T] int64 / int32 ids in ``[0, V)``.
        temperature: Python float > 0.
        return_entropy: also return the entropy of ``softmax(logits / temperature)``.

    Returns:
        ``logp`` fp32 [T], or ``(logp, entropy)`` when ``return_entropy``.
    """
    _check(hidden, weight, tokens, temperature, return_entropy)
    lp, ent, _ = linear_logp_forward(hidden, weight, tokens, temperature, return_entropy)
    return (lp, ent) if return_entropy else lp
