"""Drift metrics between rollout and trainer log-probs of the same sampled tokens."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# |Δlogp| above this counts as a "visible" mismatch (beyond fp32 noise of a log-prob near 0).
DELTA_THRESHOLD = 1e-6


def compare(
    rollout: list[list[float]], trainer: list[list[float]], *, worst: int = 5
) -> dict[str, Any]:
    """Compare per-sequence log-prob lists (same shapes) and return the report's metrics.

    The KL estimates are of KL(rollout || trainer) from the rollout's own samples, with
    ``r = logp_trainer - logp_rollout``: k1 = mean(-r), k3 = mean(exp(r) - 1 - r).
    The importance ratio is ``exp(r)`` (trainer / rollout probability of the sampled token).
    """
    if len(rollout) != len(trainer):
        raise ValueError(f"{len(rollout)} rollout sequences vs {len(trainer)} trainer sequences")
    seqs = []
    for i, (a, b) in enumerate(zip(rollout, trainer)):
        if len(a) != len(b):
            raise ValueError(f"sequence {i}: {len(a)} rollout log-probs vs {len(b)} trainer")
        seqs.append((np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)))
    if not seqs or sum(len(a) for a, _ in seqs) == 0:
        raise ValueError("no tokens to compare")
    roll = np.concatenate([a for a, _ in seqs])
    train = np.concatenate([b for _, b in seqs])
    delta = np.abs(roll.astype(np.float64) - train.astype(np.float64))
    equal = roll.view(np.uint32) == train.view(np.uint32)
    equal |= roll == train  # +0.0 / -0.0
    r = train.astype(np.float64) - roll.astype(np.float64)
    ratio = np.exp(r)
    per_seq = []
    for i, (a, b) in enumerate(seqs):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        per_seq.append(
            {
                "sequence": i,
                "tokens": int(len(a)),
                "bitwise_equal_fraction": float(np.mean(a == b)) if len(a) else 1.0,
                "max_abs_delta": float(d.max()) if len(d) else 0.0,
            }
        )
    per_seq.sort(key=lambda s: (-s["max_abs_delta"], s["sequence"]))
    max_len = max(len(a) for a, _ in seqs)
    by_pos = []
    for pos in range(max_len):
        vals = [a[pos] != b[pos] for a, b in seqs if len(a) > pos]
        by_pos.append(float(np.mean(vals)))
    return {
        "tokens": int(len(roll)),
        "sequences": len(seqs),
        "bitwise_equal_fraction": float(np.mean(equal)),
        "delta_gt_1e-6_fraction": float(np.mean(delta > DELTA_THRESHOLD)),
        "max_abs_delta": float(delta.max()),
        "mean_abs_delta": float(delta.mean()),
        "kl_k1": float(np.mean(-r)),
        "kl_k3": float(np.mean(np.expm1(r) - r)),
        "ratio_min": float(ratio.min()),
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "worst_sequences": per_seq[:worst],
        "mismatch_rate_by_position": by_pos,
        "_abs_delta": delta.tolist(),
    }


def provenance_check(
    rollout: list[dict[str, Any]], trainer: list[dict[str, Any]]
) -> dict[str, Any]:
    """Check that every op both sides resolved ran the same numerics family.

    Returns ``{"ok": bool, "mismatches": [...], "rollout_only": [...], "trainer_only": [...]}``.
    """

    def families(rep: list[dict[str, Any]]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for r in rep:
            out.setdefault(r["op"], set()).add(r["numerics"])
        return out

    fr, ft = families(rollout), families(trainer)
    mismatches = []
    for op in sorted(set(fr) & set(ft)):
        if fr[op] != ft[op]:
            mismatches.append({"op": op, "rollout": sorted(fr[op]), "trainer": sorted(ft[op])})
    non_invariant = sorted(
        {r["op"] for r in list(rollout) + list(trainer) if not r.get("invariant", True)}
    )
    return {
        "ok": not mismatches and not non_invariant,
        "mismatches": mismatches,
        "non_invariant_ops": non_invariant,
        "rollout_only": sorted(set(fr) - set(ft)),
        "trainer_only": sorted(set(ft) - set(fr)),
    }


def fmt_delta(x: float) -> str:
    return "0" if x == 0 else (f"{x:.2e}" if math.isfinite(x) else str(x))
