"""``stock`` provider of ``linear_logp``: materialised logits ``hidden @ weight.t()`` (torch.mm)
followed by the stock ``logp`` / ``entropy``.

Not batch invariant and holds the full [T, V] logits (and, in the backward, [T, V] gradients).
Registered so that the audit mode can measure the "before" picture; strict mode refuses it.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.ops._common import signature_of
from rl_engine.ops.entropy import stock as entropy_stock
from rl_engine.ops.linear_logp import reference
from rl_engine.ops.linear_logp.reference import _check
from rl_engine.ops.logp import stock as logp_stock
from rl_engine.ops.logp.reference import check_token_range


@signature_of(reference.linear_logp_forward)
def linear_logp_forward(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, lse)`` fp32 [T] (``entropy`` empty unless ``return_entropy``); the
    arguments of :func:`rl_engine.ops.linear_logp.reference.linear_logp_forward`, trusted
    (checked at the public entry)."""
    hidden, weight, tokens, temperature, return_entropy = args
    check_token_range(tokens, weight.shape[0])
    logits = torch.mm(hidden, weight.t())
    lp, lse = logp_stock.logp_forward(logits, tokens, temperature)
    if return_entropy:
        ent = entropy_stock.entropy_forward(logits, temperature)[0]
    else:
        ent = lp.new_empty(0)
    return lp, ent, lse


@signature_of(reference.linear_logp_backward)
def linear_logp_backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dhidden, dweight)`` through materialised fp32 logits gradients and torch.mm; the
    arguments of :func:`rl_engine.ops.linear_logp.reference.linear_logp_backward`."""
    hidden, weight, tokens, temperature, lse, entropy, grad_logp, grad_entropy = args[:8]
    need_dhidden, need_dweight = args[8:]
    logits = torch.mm(hidden, weight.t())
    d = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    if grad_logp is not None:
        d += logp_stock.logp_backward(logits.float(), tokens, temperature, lse, grad_logp)
    if grad_entropy is not None:
        d += entropy_stock.entropy_backward(logits.float(), temperature, lse, entropy, grad_entropy)
    dh = (d @ weight.float()).to(hidden.dtype) if need_dhidden else hidden.new_empty(0)
    dw = (d.t() @ hidden.float()).to(weight.dtype) if need_dweight else weight.new_empty(0)
    return dh, dw


@signature_of(reference.linear_logp)
def linear_logp(*args: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Stock ``log_softmax(hidden @ weight.t() / temperature)[tokens]`` (fp32 [T]); the
    arguments of :func:`rl_engine.ops.linear_logp.reference.linear_logp`."""
    _check(*args)
    lp, ent, _ = linear_logp_forward(*args)
    return_entropy = args[4]
    return (lp, ent) if return_entropy else lp
