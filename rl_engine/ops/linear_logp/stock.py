"""``stock`` provider of ``linear_logp``: materialised logits ``hidden @ weight.t()`` (torch.mm)
followed by the stock ``logp`` / ``entropy``.

Not batch invariant and holds the full [T, V] logits (and, in the backward, [T, V] gradients).
Registered so that the audit mode can measure the "before" picture; strict mode refuses it.
"""

from __future__ import annotations

import torch

from rl_engine.ops.entropy import stock as entropy_stock
from rl_engine.ops.linear_logp.reference import _check
from rl_engine.ops.logp import stock as logp_stock
from rl_engine.ops.logp.reference import check_token_range


def linear_logp_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, lse)`` fp32 [T] (``entropy`` empty unless ``return_entropy``)."""
    _check(hidden, weight, tokens, temperature, return_entropy)
    check_token_range(tokens, weight.shape[0])
    logits = torch.mm(hidden, weight.t())
    lp, lse = logp_stock.logp_forward(logits, tokens, temperature)
    if return_entropy:
        ent = entropy_stock.entropy_forward(logits, temperature)[0]
    else:
        ent = lp.new_empty(0)
    return lp, ent, lse


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
    """``(dhidden, dweight)`` through materialised fp32 logits gradients and torch.mm."""
    logits = torch.mm(hidden, weight.t())
    d = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    if grad_logp is not None:
        d += logp_stock.logp_backward(logits.float(), tokens, temperature, lse, grad_logp)
    if grad_entropy is not None:
        d += entropy_stock.entropy_backward(logits.float(), temperature, lse, entropy, grad_entropy)
    dh = (d @ weight.float()).to(hidden.dtype) if need_dhidden else hidden.new_empty(0)
    dw = (d.t() @ hidden.float()).to(weight.dtype) if need_dweight else weight.new_empty(0)
    return dh, dw


def linear_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Stock ``log_softmax(hidden @ weight.t() / temperature)[tokens]`` (fp32 [T])."""
    lp, ent, _ = linear_logp_forward(hidden, weight, tokens, temperature, return_entropy)
    return (lp, ent) if return_entropy else lp
