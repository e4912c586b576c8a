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


#: The op whose family names the grouped TP-invariant reduction (:mod:`rl_engine.ops.det_gemm.tp`).
TP_OP = "det_gemm_tp"
#: What to do when the two sides run different reductions of the TP-sharded GEMMs.
TP_FIX = (
    "set RL_ENGINE_TP_GROUPS=8 on both sides (every rollout and trainer process): the grouped "
    "reduction at every degree, TP 1 included"
)


def records(provenance: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Registry records (``KernelRegistry.report()`` rows) from a registry report, or from a list
    of per-process provenance dicts that hold one under ``"registry"`` (what
    :func:`rl_engine.adapters.vllm.provenance` returns, one per vLLM worker)."""
    out: list[dict[str, Any]] = []
    for r in provenance:
        out.extend(r["registry"] if "registry" in r else [r])
    return out


def tp_reduction(provenance: list[dict[str, Any]]) -> list[str]:
    """The numerics families of the GEMMs that tensor parallelism shards (row-parallel forward:
    attention output, MLP down projection; column-parallel input gradient) in a process's
    provenance: the ``det_gemm_tp/g<G>[...]`` families when the grouped TP-invariant reduction
    ran (TP > 1, or ``RL_ENGINE_TP_GROUPS=8``), else the plain ``det_gemm`` families (TP 1 with
    the variable unset or 0), else ``[]`` (no GEMM recorded: nothing to say)."""
    fams: dict[str, set[str]] = {}
    for r in records(provenance):
        fams.setdefault(r["op"], set()).add(r["numerics"])
    return sorted(fams.get(TP_OP) or fams.get("det_gemm") or ())


#: What to do when the two sides compute token log-probs with different log-softmax families.
LOGP_FIX = (
    "give both sides one log-softmax family (RL_ENGINE_BACKEND_LOGP / "
    "RL_ENGINE_BACKEND_LINEAR_LOGP); with RL_ENGINE_BACKEND_DET_GEMM=cuda, pin "
    "RL_ENGINE_BACKEND_LINEAR_LOGP=unfused in the trainers (the Triton log-softmax of a "
    "rollout's logp)"
)


def logp_families(provenance: list[dict[str, Any]]) -> list[str]:
    """The log-softmax families a process computed token log-probs with: its ``logp`` families
    and, for ``linear_logp`` (the LM head fused with the log-softmax), the ``logp`` family inside
    it: named in brackets by the fused providers (``linear_logp/triton-v1024[det_gemm/...+
    logp/triton-v1024]``), else the same provider's (``linear_logp/native-v1024`` is
    ``logp/native-v1024`` over the resolved det_gemm). A rollout that runs ``logp`` on its logits
    and a trainer that runs ``linear_logp`` agree only where these are equal."""
    out: set[str] = set()
    for r in records(provenance):
        fam = r["numerics"]
        if r["op"] == "logp":
            out.add(fam)
        elif r["op"] == "linear_logp":
            inner = fam.partition("[")[2].rstrip("]").split("+")
            fused = [f for f in inner if f.startswith("logp/")]
            out.update(fused or ["logp/" + fam.split("/", 1)[1].split("[", 1)[0]])
    return sorted(out)


def _reduction_text(fams: list[str]) -> str:
    if any(f.startswith(TP_OP + "/") for f in fams):
        return (
            f"the grouped TP-invariant reduction ({', '.join(fams)}; TP > 1, or "
            "RL_ENGINE_TP_GROUPS=8)"
        )
    return f"plain det_gemm ({', '.join(fams)}; TP 1 with RL_ENGINE_TP_GROUPS unset or 0)"


def provenance_check(
    rollout: list[dict[str, Any]],
    trainer: list[dict[str, Any]],
    *,
    names: tuple[str, str] = ("rollout", "trainer"),
) -> dict[str, Any]:
    """Check that every op both sides resolved ran the same numerics family.

    ``rollout`` / ``trainer``: registry reports, or per-process provenance dicts (see
    :func:`records`). Besides the ops both sides resolved, the reduction of the TP-sharded GEMMs
    is compared (:func:`tp_reduction`): one side on plain ``det_gemm`` (it resolved no
    ``det_gemm_tp``) and the other on the grouped ``det_gemm_tp`` is a mismatch of op
    ``det_gemm_tp`` whose ``message`` says which side runs which reduction and the fix.
    ``names`` label the two sides in messages (e.g. ``("TP 1 trainer", "TP 2 trainer")``).
    Where one side resolved ``logp`` and the other ``linear_logp`` (a rollout's log-softmax of
    its logits, a trainer's fused LM head), their log-softmax families (:func:`logp_families`)
    are compared too: a mismatch of op ``logp``.

    Returns ``{"ok": bool, "mismatches": [{"op", "rollout", "trainer", "message"}, ...],
    "non_invariant_ops": [...], "rollout_only": [...], "trainer_only": [...], "problems":
    [str, ...]}`` (``problems``: one readable line per mismatch and non-invariant op).
    """
    rollout, trainer = records(rollout), records(trainer)

    def families(rep: list[dict[str, Any]]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for r in rep:
            out.setdefault(r["op"], set()).add(r["numerics"])
        return out

    a, b = names
    fr, ft = families(rollout), families(trainer)
    mismatches = []
    for op in sorted(set(fr) & set(ft)):
        if fr[op] != ft[op]:
            mismatches.append(
                {
                    "op": op,
                    "rollout": sorted(fr[op]),
                    "trainer": sorted(ft[op]),
                    "message": f"op {op}: {a} ran numerics {sorted(fr[op])}, {b} ran "
                    f"{sorted(ft[op])}",
                }
            )
    rr, rt = tp_reduction(rollout), tp_reduction(trainer)
    if rr and rt and (TP_OP in fr) != (TP_OP in ft):  # one side grouped, the other plain
        mismatches.append(
            {
                "op": TP_OP,
                "rollout": rr,
                "trainer": rt,
                "message": "row-parallel GEMMs (attention output, MLP down projection) and "
                f"column-parallel input gradients: {a} runs {_reduction_text(rr)}, {b} runs "
                f"{_reduction_text(rt)}, so their log-probs differ; fix: {TP_FIX}",
            }
        )
    # the token log-probs: ``logp`` on one side and ``linear_logp`` on the other is not a
    # same-op pair above; their log-softmax families must still agree
    lr, lt = logp_families(rollout), logp_families(trainer)
    cross = any((op in fr) != (op in ft) for op in ("logp", "linear_logp"))
    if cross and lr and lt and lr != lt:
        mismatches.append(
            {
                "op": "logp",
                "rollout": lr,
                "trainer": lt,
                "message": f"token log-probs: {a} computes them with log-softmax {lr}, {b} "
                f"with {lt} (logp vs linear_logp), so they differ; fix: {LOGP_FIX}",
            }
        )
    non_invariant = sorted(
        {r["op"] for r in list(rollout) + list(trainer) if not r.get("invariant", True)}
    )
    problems = [m["message"] for m in mismatches]
    problems += [f"op {op}: a non-invariant provider was used" for op in non_invariant]
    return {
        "ok": not mismatches and not non_invariant,
        "mismatches": mismatches,
        "non_invariant_ops": non_invariant,
        "rollout_only": sorted(set(fr) - set(ft)),
        "trainer_only": sorted(set(ft) - set(fr)),
        "problems": problems,
    }


def fmt_delta(x: float) -> str:
    return "0" if x == 0 else (f"{x:.2e}" if math.isfinite(x) else str(x))
