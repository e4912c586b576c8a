"""PyTorch reference of ``logp`` (the ``native`` provider) and the shared vocabulary reduction.

This module is the spec of the three vocabulary ops (``logp``, ``entropy``, ``linear_logp``):
they all reduce over the vocabulary with :class:`VocabLogSumExp`, so a fused ``linear_logp``
that computes logits chunk by chunk gives bitwise the result of ``logp`` on the full logits.

Numerics (family ``logp/native-v1024``), per row, in fp32:

* ``z = logits.float() / temperature`` (an IEEE division by the fp32 temperature).
* The vocabulary is cut into tiles of ``VOCAB_TILE`` columns starting at column 0 (the last
  tile may be shorter). Tiles are visited in vocabulary order with the online rescaling::

      m_new = max(m, amax(z_tile))                 # exact
      e     = exp(z_tile - m_new)                  # _math.exp, one fp32 rounding
      a     = exp(m - m_new)
      s     = s * a + tree_sum(e)                  # fixed pairwise order inside the tile
      u     = (u + (m - m_new) * s_old) * a + tree_sum(e * (z_tile - m_new))   # entropy only

  starting from ``m = -inf, s = 0, u = 0``.
* ``lse = m + log(s)``, ``logp = z[token] - lse``, ``entropy = log(s) - u / s``.

Only elementwise operations, ``amax`` (exact) and :func:`~rl_engine.ops._common.tree_sum` are
used, so a row's result depends on that row alone: row invariant by construction.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rl_engine.ops import _math
from rl_engine.ops._common import (
    check_float,
    check_same_device,
    check_tensor,
    tree_sum,
)

__all__ = [
    "VOCAB_TILE",
    "VocabLogSumExp",
    "logp",
    "logp_backward",
    "logp_forward",
]

VOCAB_TILE = 1024  # vocabulary tile of the online log-sum-exp (fixed: part of the numerics)
TOKEN_DTYPES = (torch.int64, torch.int32)


# ---------------------------------------------------------------------------- checks
def check_temperature(temperature: Any) -> None:
    """Raise unless ``temperature`` is a finite Python number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a Python float, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")


def as_temperature(temperature: Any) -> Any:
    """A public entry's temperature as a Python float: a 0-d (or one-element) floating tensor is
    read once on the host (for a GPU tensor that is one synchronisation); anything else is
    returned as is and checked by :func:`check_temperature`."""
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1 or not temperature.dtype.is_floating_point:
            raise TypeError(
                "temperature must be a Python float or a one-element floating tensor, got a "
                f"{temperature.dtype} tensor of shape {tuple(temperature.shape)}"
            )
        return float(temperature.reshape(()).item())
    return temperature


def flatten_rows(logits: Any, tokens: Any = None) -> tuple[Any, Any, tuple[int, ...] | None]:
    """``[..., V]`` logits (and ``[...]`` tokens) as ``[T, V]`` / ``[T]`` rows, plus the leading
    shape to restore (``None`` when already 2-D); a view where the strides allow it."""
    if not isinstance(logits, torch.Tensor) or logits.dim() <= 2:
        return logits, tokens, None
    lead = tuple(logits.shape[:-1])
    if tokens is not None:
        if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != lead:
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)
            raise ValueError(f"tokens must have the logits' leading shape {lead}, got {got}")
        tokens = tokens.reshape(-1)
    return logits.reshape(-1, logits.shape[-1]), tokens, lead


def check_tokens(tokens: Any, rows: int) -> None:
    """Raise unless ``tokens`` is an int32/int64 [rows] tensor."""
    check_tensor("tokens", tokens, dims=1)
    if tokens.dtype not in TOKEN_DTYPES:
        raise TypeError(f"tokens: dtype {tokens.dtype} is not supported; expected int64 or int32")
    if tokens.shape[0] != rows:
        raise ValueError(f"tokens has {tokens.shape[0]} elements, expected one per row ({rows})")


def check_token_range(tokens: torch.Tensor, vocab: int) -> None:
    """Raise ``ValueError`` when a token id is outside ``[0, vocab)``.

    On the CPU the check is exact and immediate. On an accelerator a host-side check would
    synchronise the stream, so a device-side ``torch._assert_async`` is queued instead: an
    out-of-range id then fails the stream (a device assert) rather than giving a silent result.
    """
    if tokens.numel() == 0:
        return
    if tokens.device.type != "cpu":
        ok = ((tokens >= 0) & (tokens < vocab)).all()
        torch._assert_async(ok, f"rl_engine: token ids must lie in [0, {vocab})")
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}), got values in [{lo}, {hi}]")


def _check(logits: Any, tokens: Any, temperature: Any) -> None:
    check_tensor("logits", logits, dims=2)
    check_float("logits", logits)
    check_tokens(tokens, logits.shape[0])
    check_same_device(logits=logits, tokens=tokens)
    check_temperature(temperature)
    if logits.shape[1] == 0:
        raise ValueError("logits has an empty vocabulary dimension (shape [T, 0])")


# ---------------------------------------------------------------------------- shared numerics
def temperature_tensor(temperature: float, device: torch.device) -> torch.Tensor:
    """The temperature as a 0-dim fp32 tensor on ``device``.

    Dividing by a tensor on the same device is a true IEEE division everywhere (CUDA turns a
    division by a *host* scalar into a multiplication by its reciprocal).
    """
    return torch.full((), temperature, dtype=torch.float32, device=device)


def scale(logits: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """``logits.float() / temperature`` (elementwise)."""
    return logits.float() / temp


class VocabLogSumExp:
    """Running log-sum-exp (and entropy sum) of rows of scaled logits, tile by tile.

    Feed consecutive column blocks of the scaled logits to :meth:`add` in vocabulary order;
    each block must start at a multiple of :data:`VOCAB_TILE` in the full vocabulary (so every
    caller sees the same tiles). Every state update is elementwise per row.

    Args:
        rows: number of rows T.
        device: device of the state.
        with_entropy: also keep ``u = sum exp(z - m) * (z - m)`` for the entropy.
    """

    def __init__(self, rows: int, device: torch.device, *, with_entropy: bool) -> None:
        self.m = torch.full((rows,), -math.inf, dtype=torch.float32, device=device)
        self.s = torch.zeros(rows, dtype=torch.float32, device=device)
        self.u = torch.zeros(rows, dtype=torch.float32, device=device) if with_entropy else None

    def _add_tile(self, z: torch.Tensor) -> None:
        m_new = torch.maximum(self.m, z.amax(dim=1))
        # rows that have seen only -inf so far: shift by 0 so that no -inf - -inf appears
        m_ref = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        shifted = z - m_ref[:, None]
        e = _math.exp(shifted)
        alpha = _math.exp(self.m - m_ref)
        if self.u is not None:
            eu = torch.where(e > 0, e * shifted, torch.zeros_like(e))  # 0 * -inf -> 0
            u_old = torch.where(
                self.s > 0, self.u + (self.m - m_ref) * self.s, torch.zeros_like(self.u)
            )
            self.u = u_old * alpha + tree_sum(eu, dim=1)
        self.s = self.s * alpha + tree_sum(e, dim=1)
        self.m = m_new

    def add(self, logits: torch.Tensor, temp: torch.Tensor) -> None:
        """Add the columns of ``logits`` [rows, n] (any float dtype; scaled here) tile by tile."""
        for c0 in range(0, logits.shape[1], VOCAB_TILE):
            self._add_tile(scale(logits[:, c0 : c0 + VOCAB_TILE], temp))

    def lse(self) -> torch.Tensor:
        """Log-sum-exp of the scaled logits seen so far, fp32 [rows]."""
        return self.m + _math.log(self.s)

    def lse_and_entropy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lse, entropy)`` fp32 [rows] (requires ``with_entropy=True``)."""
        assert self.u is not None, "VocabLogSumExp(with_entropy=False) keeps no entropy sum"
        log_s = _math.log(self.s)
        return self.m + log_s, log_s - self.u / self.s


def probs(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities ``exp(z - lse)`` of a tile of scaled logits (elementwise)."""
    return _math.exp(z - lse[:, None])


def dz_tile(
    z: torch.Tensor,
    lse: torch.Tensor,
    *,
    col0: int,
    tokens: torch.Tensor | None = None,
    grad_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient wrt the *scaled* logits of one tile (columns ``col0 .. col0 + n``).

    ``d logp / dz_j = [j == token] - p_j`` and ``d entropy / dz_j = -p_j (z_j - lse + entropy)``,
    each weighted by its upstream gradient [rows]. Elementwise per row.
    """
    p = probs(z, lse)
    dz = torch.zeros_like(z)
    if grad_logp is not None:
        assert tokens is not None
        cols = torch.arange(col0, col0 + z.shape[1], device=z.device)
        hit = cols[None, :] == tokens[:, None]
        dz = torch.where(hit, 1.0 - p, -p) * grad_logp[:, None]
    if grad_entropy is not None:
        assert entropy is not None
        de = -p * ((z - lse[:, None]) + entropy[:, None]) * grad_entropy[:, None]
        de = torch.where(p > 0, de, torch.zeros_like(de))  # p = 0 at z = -inf: 0, not 0 * inf
        dz = dz + de if grad_logp is not None else de
    return dz


def dlogits(
    logits: torch.Tensor, temperature: float, lse: torch.Tensor, **terms: torch.Tensor
) -> torch.Tensor:
    """``dz / temperature`` [T, V] in ``logits.dtype`` (one rounding), tile by tile: the backward
    of ``logp`` and ``entropy``, ``dz`` being :func:`dz_tile` of each ``VOCAB_TILE`` columns with
    the upstream ``terms`` (``tokens`` and ``grad_logp``, or ``entropy`` and ``grad_entropy``)."""
    temp = temperature_tensor(temperature, logits.device)
    out = torch.empty_like(logits)
    for c0 in range(0, logits.shape[1], VOCAB_TILE):
        z = scale(logits[:, c0 : c0 + VOCAB_TILE], temp)
        dz = dz_tile(z, lse, col0=c0, **terms)
        out[:, c0 : c0 + VOCAB_TILE] = (dz / temp).to(logits.dtype)
    return out


# ---------------------------------------------------------------------------- logp
def logp_forward(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, lse)``, both fp32 [T]; see :func:`logp`. The arguments are trusted: checked
    once at the public entry (the op's ``_run``, or :func:`logp`)."""
    check_token_range(tokens, logits.shape[1])
    temp = temperature_tensor(temperature, logits.device)
    state = VocabLogSumExp(logits.shape[0], logits.device, with_entropy=False)
    state.add(logits, temp)
    lse = state.lse()
    target = scale(logits.gather(1, tokens.long()[:, None])[:, 0], temp)
    return target - lse, lse


def logp_backward(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    grad: torch.Tensor,
) -> torch.Tensor:
    """``d logp / d logits`` times ``grad`` [T]: ``grad * (onehot - softmax(z)) / temperature``.

    Returns [T, V] in ``logits.dtype`` (one rounding of the fp32 value).
    """
    return dlogits(logits, temperature, lse, tokens=tokens.long(), grad_logp=grad.float())


def check_row_temperatures(logits: torch.Tensor, temperatures: Any) -> None:
    """Raise unless ``temperatures`` is an fp32 [T] tensor on the logits' device (its values,
    which must be finite and > 0, stay on the device: checking them would synchronise)."""
    check_tensor("temperatures", temperatures, dims=1)
    if temperatures.dtype != torch.float32:
        raise TypeError(f"temperatures: dtype {temperatures.dtype}; expected float32")
    if temperatures.shape[0] != logits.shape[0]:
        raise ValueError(
            f"temperatures has {temperatures.shape[0]} elements, expected one per row "
            f"({logits.shape[0]})"
        )
    check_same_device(logits=logits, temperatures=temperatures)


def logp_at(
    logits: torch.Tensor, cols: torch.Tensor, temperatures: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """``logp`` of the token ids ``cols`` [T, k] given each row's ``lse`` (fp32 [T]) at the
    row's temperature: ``logits[t, c] / temperatures[t] - lse[t]``, fp32 [T, k] (the last step
    of :func:`logp_forward`, elementwise)."""
    z = scale(logits.gather(1, cols.long()), temperatures[:, None])
    return z - lse[:, None]


def sampled_forward(
    logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, lse, rank)`` of each row's token at the row's own temperature.

    Row ``t`` of ``logp`` / ``lse`` has the bits of ``logp_forward(logits[t:t+1], tokens[t:t+1],
    temperatures[t])`` (the same division, by a tensor, then the same tiles); ``rank`` (int64) is
    ``1 + #(z > z[token])`` over the row's scaled logits ``z``. No gradient.
    """
    _check(logits, tokens, 1.0)
    check_row_temperatures(logits, temperatures)
    temp = temperatures[:, None]
    state = VocabLogSumExp(logits.shape[0], logits.device, with_entropy=False)
    state.add(logits, temp)
    lse = state.lse()
    lp = logp_at(logits, tokens[:, None], temperatures, lse)[:, 0]
    zt = scale(logits.gather(1, tokens.long()[:, None]), temp)
    rank = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    for c0 in range(0, logits.shape[1], VOCAB_TILE):
        rank += (scale(logits[:, c0 : c0 + VOCAB_TILE], temp) > zt).sum(1)
    return lp, lse, rank + 1


def logp(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of ``tokens`` under ``softmax(logits / temperature)``.

    Equivalent to ``torch.log_softmax(logits.float() / temperature, -1).gather(1, tokens[:, None])
    [:, 0]``, computed with the tiled online log-sum-exp of the module docstring.

    Args:
        logits: [T, V] float32 / bfloat16 / float16, any strides.
        tokens: [T] int64 / int32 token ids in ``[0, V)``.
        temperature: Python float > 0.

    Returns:
        fp32 [T].
    """
    _check(logits, tokens, temperature)
    return logp_forward(logits, tokens, temperature)[0]
