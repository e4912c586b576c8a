"""PyTorch reference of ``moe_router`` (the ``native`` provider): a token's expert choice.

Numerics (family ``moe_router/native``). The router logits ``[T, E]`` arrive in the model dtype
(``det_gemm`` of the hidden rows with the gate weight: what vLLM's gate layer and the trainers'
router compute); every step below is per row, in fp32::

    l = logits.float()
    softmax(v) = e / tree_sum(e),  e = exp(v - max(v))      # exp: rl_engine.ops._math.exp
    scoring="softmax":       p = softmax(l)                   # over all E experts
                             ids = top_k(p);  w = p[ids]
                             renormalize: w = w / tree_sum(w)
    scoring="topk_softmax":  ids = top_k(l);  w = softmax(l[ids])   # over the k chosen (Mixtral)

``top_k`` is a stable descending sort: **equal scores put the lower expert id first** (the one
tie rule of every provider and engine). ``w`` is fp32 ``[T, k]`` in top-k slot order, ``ids``
int64 ``[T, k]``. Only per-row elementwise ops, ``max`` (exact), :func:`tree_sum` (fixed order)
and a stable sort: row invariant on any device.

Backward (``dlogits`` from ``dw``, per row, fp32, one rounding to the logits dtype)::

    softmax:       dp = scatter(dw)             (zeros but at ids)
                   renormalize: dp = scatter((dw - tree_sum(dw * w)) / tree_sum(p[ids]))
                   dl = p * (dp - tree_sum(dp * p))
    topk_softmax:  dl = scatter(w * (dw - tree_sum(dw * w)))
"""

from __future__ import annotations

import torch

from rl_engine.ops._common import check_float, check_tensor, tree_sum
from rl_engine.ops._math import exp

SCORINGS = ("softmax", "topk_softmax")


def _check(logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool) -> None:
    check_tensor("logits", logits, dims=2)
    check_float("logits", logits)
    if scoring not in SCORINGS:
        raise ValueError(f"moe_router: scoring {scoring!r} is not supported; expected {SCORINGS}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"moe_router: top_k must be an int, got {type(top_k).__name__}")
    n_experts = logits.shape[1]
    if not 1 <= top_k <= n_experts:
        raise ValueError(
            f"moe_router: top_k must be in [1, {n_experts}] (the experts), got {top_k}"
        )
    if scoring == "topk_softmax" and renormalize:
        raise ValueError(
            "moe_router: renormalize applies to scoring='softmax' only "
            "('topk_softmax' weights already sum to 1 over the k experts)"
        )


def softmax32(v: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim in the fixed order of the module docstring."""
    e = exp(v - v.amax(dim=-1, keepdim=True))
    return e / tree_sum(e, dim=-1).unsqueeze(-1)


def top_k_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest scores' column ids per row, largest first; ties: the lower id first."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


def moe_topk(
    logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token's k experts and their fp32 weights from its router logits.

    Equivalent (up to rounding, tie order fixed) to HF Qwen3-MoE / Qwen2-MoE's
    ``w, ids = torch.topk(softmax(logits.float()), k); w /= w.sum(-1) if norm_topk_prob`` and to
    Mixtral's ``ids = topk(logits, k); w = softmax(logits[ids].float())``.

    Args:
        logits: [T, E] float32 / bfloat16 / float16 router logits.
        top_k: experts per token, 1 <= top_k <= E.
        scoring: ``"softmax"`` (over all experts, then top-k) or ``"topk_softmax"``.
        renormalize: with ``"softmax"``, divide the k weights by their sum.

    Returns:
        ``(weights, ids)``: [T, top_k] float32 and [T, top_k] int64, slot order = rank order.
    """
    _check(logits, top_k, scoring, renormalize)
    lf = logits.float()
    if scoring == "softmax":
        p = softmax32(lf)
        ids = top_k_ids(p, top_k)
        w = p.gather(1, ids)
        if renormalize:
            w = w / tree_sum(w, dim=-1).unsqueeze(-1)
    else:
        ids = top_k_ids(lf, top_k)
        w = softmax32(lf.gather(1, ids))
    return w, ids


def moe_topk_backward(
    grad: torch.Tensor,
    logits: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    scoring: str,
    renormalize: bool,
) -> torch.Tensor:
    """``dlogits`` [T, E] in ``logits.dtype`` from ``grad`` = d loss / d weights [T, k]."""
    g = grad.float()
    lf = logits.float()
    if scoring == "softmax":
        p = softmax32(lf)
        if renormalize:
            total = tree_sum(p.gather(1, ids), dim=-1).unsqueeze(-1)
            g = (g - tree_sum(g * weights, dim=-1).unsqueeze(-1)) / total
        dp = torch.zeros_like(lf).scatter(1, ids, g)
        dl = p * (dp - tree_sum(dp * p, dim=-1).unsqueeze(-1))
    else:
        dsel = weights * (g - tree_sum(g * weights, dim=-1).unsqueeze(-1))
        dl = torch.zeros_like(lf).scatter(1, ids, dsel)
    return dl.to(logits.dtype)
