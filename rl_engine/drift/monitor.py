"""``DriftMonitor``: rollout-vs-trainer log-prob drift metrics for a training loop's logger.

::

    from rl_engine.audit import DriftMonitor

    monitor = DriftMonitor(prefix="drift/")
    metrics = monitor(rollout_logp, trainer_logp, loss_mask)  # {name: float}, one host sync
    logger.log(metrics, step=step)

Sign convention. The sampled tokens come from the rollout engine (q, ``rollout_logp``); the
trainer (p, ``trainer_logp``) scores the same tokens. Per token::

    r = logp_trainer - logp_rollout          (the log importance ratio; d = r)
    w = exp(r) = pi_trainer / pi_rollout     (the PPO / GRPO importance ratio)

and KL(rollout || trainer) is estimated from the rollout's own samples: ``k1 = mean(-r)``,
``k2 = mean(r**2 / 2)``, ``k3 = mean(exp(r) - 1 - r)`` (Schulman's estimators; k1 is unbiased and
can be negative on a batch, k2 and k3 are >= 0 token by token). This is the convention of
:mod:`rl_engine.drift.metrics` and of :func:`rl_engine.ops.ratio_kl` (``logp`` = trainer,
``old_logp`` = rollout), which computes the per-token ``r``, ``w``, ``k2`` and ``k3`` here.

Every metric is over the masked tokens (``mask`` true / 1) and token-weighted unless its
description says "over sequences"; see :data:`METRIC_DOCS` for each name's definition and
:data:`METRIC_NAMES` for the names verl, SkyRL, slime and NeMo-RL log for the same quantity.
Nothing is clamped: the importance-ratio statistics are of the raw ``exp(r)``, and a metric
whose value overflows float64 (e.g. ``chi2_seq`` of a sequence with ``sum(r) > 355``) reads
``inf``.

What is promised (tested in ``tests/audit/test_drift_monitor.py``):

* **One host sync per call**: everything is computed on the inputs' device and packed into one
  float64 tensor, copied to the host once (``.cpu().tolist()``); no ``.item()``. The input
  errors that need the data (empty mask, mask values other than 0 / 1, non-finite log-probs at
  masked tokens) are counted on the device, travel in that same tensor, and are raised after it.
* **Deterministic**: every sum is :func:`~rl_engine.ops._common.tree_sum` (a fixed pairwise
  order, first over the tokens of each row, then over the rows), every max / min is exact, and
  ``exp`` is :func:`rl_engine.ops._math.exp64` (a fixed sequence of IEEE operations): the same
  inputs on the same device and ``ratio_kl`` provider give bitwise the same metrics.
* **Per-sequence quantities are batch invariant**: :meth:`DriftMonitor.per_sequence` (each row's
  token count, sums of ``|r|``, ``r`` and k3, max ``|r|``, bitwise-equal count, chi-square term)
  is bitwise the same whether the row is computed alone or in any batch, and whatever the
  masked-out positions hold.
* **Padding invariant**: appending fully masked rows at the end of the batch, or masked columns
  at the end of the rows (right padding), leaves every metric bitwise unchanged (the sums only
  gain exact zeros at their ends, which a ``tree_sum`` absorbs exactly); and a single row's
  metrics are bitwise the same alone or inside a batch whose other rows are masked out.

Not promised: the batch-level metrics are reductions over the whole batch, so they are of course
not a function of one row, and permuting the rows may change their last bits (the summation
order changes). Per-device equality (CPU vs GPU) is not promised either.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from rl_engine.ops import _math
from rl_engine.ops._common import tree_sum
from rl_engine.ops.ratio_kl import ratio_kl

__all__ = ["DEFAULT_BINS", "METRIC_DOCS", "METRIC_NAMES", "DriftMonitor"]

#: Default bin edges of both the position and the sequence-length bins:
#: ``[0, 128)``, ``[128, 512)``, ``[512, 2048)``, ``[2048, inf)``.
DEFAULT_BINS: tuple[int, ...] = (0, 128, 512, 2048)

LN2 = math.log(2.0)
# ratio_kl clamps the log-ratio to [-C, C] with a finite C; the largest float32 makes the clamp
# a no-op for every finite float32 difference.
_NO_CLAMP = float(torch.finfo(torch.float32).max)
_LOGP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Each batch-level metric and its definition (r = logp_trainer - logp_rollout, masked tokens).
METRIC_DOCS: dict[str, str] = {
    "tokens": "number of masked (loss) tokens",
    "sequences": "number of rows with at least one masked token",
    "abs_diff_mean": "mean |r|",
    "abs_diff_std": "standard deviation of |r| (population, ddof = 0)",
    "abs_diff_max": "max |r|",
    "abs_diff_seq_mean": "mean over sequences of each sequence's mean |r|",
    "abs_diff_gt_ln2_frac": "fraction of tokens with |r| > ln 2 (probabilities differ by > 2x)",
    "exp_abs_diff_mean": "mean exp(|r|) (>= 1; 1 = no drift)",
    "bitwise_equal_frac": "fraction of tokens with logp_rollout == logp_trainer exactly",
    "kl_k1": "k1 estimate of KL(rollout || trainer): mean(-r)",
    "kl_k2": "k2 estimate of KL(rollout || trainer): mean(r^2 / 2)",
    "kl_k3": "k3 estimate of KL(rollout || trainer): mean(exp(r) - 1 - r)",
    "chi2_token": "token-level chi-square: mean((exp(r) - 1)^2)",
    "chi2_seq": (
        "sequence-level chi-square: mean over sequences of (exp(S) - 1)^2, "
        "S = sum of r over the sequence's masked tokens"
    ),
    "ppl_rollout": "rollout perplexity exp(-mean logp_rollout)",
    "ppl_trainer": "trainer perplexity exp(-mean logp_trainer)",
    "ppl_ratio": "ppl_trainer / ppl_rollout = exp(mean logp_rollout - mean logp_trainer)",
    "is_ratio_mean": "mean importance ratio exp(r) = pi_trainer / pi_rollout, before any clamping",
    "is_ratio_std": "standard deviation of exp(r) (population, ddof = 0), before any clamping",
    "is_ratio_min": "min exp(r), before any clamping",
    "is_ratio_max": "max exp(r), before any clamping",
}

#: For each batch-level metric, the key verl / SkyRL / slime / NeMo-RL log for the same (or the
#: closest) quantity, as it appears in their loggers (prefix included). Only metrics with a
#: counterpart have entries; docs/audit.md says where the definitions differ (e.g. verl's IS
#: statistics are after truncation, slime averages per sequence first, NeMo-RL's gen_kl_error is
#: k3 under its ``reference_policy_kl_type: k3``).
METRIC_NAMES: dict[str, dict[str, str]] = {
    "tokens": {},
    "sequences": {},
    "abs_diff_mean": {"skyrl": "policy/rollout_train_logprobs_abs_diff_mean"},
    "abs_diff_std": {"skyrl": "policy/rollout_train_logprobs_abs_diff_std"},
    "abs_diff_max": {"skyrl": "policy/rollout_train_logprobs_abs_diff_max"},
    "abs_diff_seq_mean": {"slime": "train/train_rollout_logprob_abs_diff"},
    "abs_diff_gt_ln2_frac": {},
    "exp_abs_diff_mean": {"nemo_rl": "train/token_mult_prob_error"},
    "bitwise_equal_frac": {},
    "kl_k1": {"verl": "rollout_corr/kl"},
    "kl_k2": {},
    "kl_k3": {"verl": "rollout_corr/k3_kl", "nemo_rl": "train/gen_kl_error"},
    "chi2_token": {"verl": "rollout_corr/chi2_token"},
    "chi2_seq": {"verl": "rollout_corr/chi2_seq"},
    "ppl_rollout": {"verl": "rollout_corr/rollout_ppl"},
    "ppl_trainer": {"verl": "rollout_corr/training_ppl"},
    "ppl_ratio": {"verl": "rollout_corr/ppl_ratio"},
    "is_ratio_mean": {
        "verl": "rollout_corr/rollout_is_mean",
        "nemo_rl": "train/sampling_importance_ratio",
    },
    "is_ratio_std": {"verl": "rollout_corr/rollout_is_std"},
    "is_ratio_min": {"verl": "rollout_corr/rollout_is_min"},
    "is_ratio_max": {"verl": "rollout_corr/rollout_is_max"},
}

_BIN_METRICS = ("tokens", "abs_diff_mean", "kl_k3", "bitwise_equal_frac")
_SEQ_BIN_METRICS = ("sequences", *_BIN_METRICS)


def _check_bins(name: str, edges: Sequence[int] | None) -> tuple[int, ...]:
    if edges is None:
        return ()
    edges = tuple(edges)
    if not edges:
        return ()
    for e in edges:
        if isinstance(e, bool) or not isinstance(e, int):
            raise TypeError(f"DriftMonitor: {name} must be ints, got {edges!r}")
    if edges[0] != 0:
        raise ValueError(f"DriftMonitor: {name} must start at 0, got {edges!r}")
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"DriftMonitor: {name} must be strictly increasing, got {edges!r}")
    return edges


def _bin_names(kind: str, edges: tuple[int, ...]) -> list[tuple[str, int, float]]:
    his: list[float] = [*edges[1:], math.inf]
    return [
        (f"{kind}_{lo}_{'inf' if hi == math.inf else int(hi)}", lo, hi)
        for lo, hi in zip(edges, his)
    ]


def _check_inputs(
    rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor | None
) -> None:
    for name, t in (("rollout_logp", rollout_logp), ("trainer_logp", trainer_logp)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"DriftMonitor: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"DriftMonitor: {name} must be [B, T], got shape {tuple(t.shape)}")
        if t.dtype not in _LOGP_DTYPES:
            raise TypeError(
                f"DriftMonitor: {name} has dtype {t.dtype}; expected one of "
                f"{[str(d) for d in _LOGP_DTYPES]} (fp32 is what vLLM returns)"
            )
    if rollout_logp.shape != trainer_logp.shape:
        raise ValueError(
            f"DriftMonitor: rollout_logp has shape {tuple(rollout_logp.shape)}, "
            f"trainer_logp {tuple(trainer_logp.shape)}"
        )
    if rollout_logp.dtype != trainer_logp.dtype:
        raise TypeError(
            f"DriftMonitor: rollout_logp is {rollout_logp.dtype} but trainer_logp is "
            f"{trainer_logp.dtype}; bitwise equality needs one dtype (cast both, e.g. .float())"
        )
    devices = {"rollout_logp": rollout_logp.device, "trainer_logp": trainer_logp.device}
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"DriftMonitor: mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.shape != rollout_logp.shape:
            raise ValueError(
                f"DriftMonitor: mask has shape {tuple(mask.shape)}, "
                f"log-probs {tuple(rollout_logp.shape)}"
            )
        if mask.dtype.is_complex:
            raise TypeError(f"DriftMonitor: mask must be bool or 0 / 1 numbers, got {mask.dtype}")
        devices["mask"] = mask.device
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"DriftMonitor: all inputs must be on one device, got {desc}")
    if rollout_logp.numel() == 0:
        raise ValueError(f"DriftMonitor: no tokens to compare (shape {tuple(rollout_logp.shape)})")


class DriftMonitor:
    """Drift metrics between rollout and trainer log-probs of the same sampled tokens.

    Args:
        position_bins: bin edges on the token's position (its column index ``t`` in the [B, T]
            tensors, i.e. its offset in the response when the tensors are response-aligned):
            ``(0, 128, 512)`` gives ``pos_0_128``, ``pos_128_512``, ``pos_512_inf``. Must start at
            0 and increase; ``None`` or ``()`` turns the position bins off.
        seqlen_bins: bin edges on the sequence's length, its number of masked tokens
            (``seqlen_0_128``, ...); rows without masked tokens are in no bin.
        prefix: prepended to every name (e.g. ``"drift/"``).
        backend: ``ratio_kl`` provider to pin (None = the registry's choice).

    Calling the monitor returns ``{name: float}`` with the names of :attr:`names`, in that
    order: the batch-level metrics of :data:`METRIC_DOCS`, then for each position bin
    ``pos_<lo>_<hi>/{tokens, abs_diff_mean, kl_k3, bitwise_equal_frac}``, then for each
    sequence-length bin ``seqlen_<lo>_<hi>/{sequences, tokens, abs_diff_mean, kl_k3,
    bitwise_equal_frac}``. A bin without tokens reads ``tokens = 0`` and NaN means.
    See the module docstring for the sign convention and what is promised.
    """

    def __init__(
        self,
        *,
        position_bins: Sequence[int] | None = DEFAULT_BINS,
        seqlen_bins: Sequence[int] | None = DEFAULT_BINS,
        prefix: str = "",
        backend: str | None = None,
    ) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"DriftMonitor: prefix must be a str, got {type(prefix).__name__}")
        self.position_bins = _check_bins("position_bins", position_bins)
        self.seqlen_bins = _check_bins("seqlen_bins", seqlen_bins)
        self.prefix = prefix
        self.backend = backend
        self._pos = _bin_names("pos", self.position_bins) if self.position_bins else []
        self._seq = _bin_names("seqlen", self.seqlen_bins) if self.seqlen_bins else []
        raw = list(METRIC_DOCS)
        raw += [f"{b}/{m}" for b, _, _ in self._pos for m in _BIN_METRICS]
        raw += [f"{b}/{m}" for b, _, _ in self._seq for m in _SEQ_BIN_METRICS]
        #: The metric names, in the order of the returned dict (prefix included).
        self.names: tuple[str, ...] = tuple(prefix + n for n in raw)

    def __repr__(self) -> str:
        return (
            f"DriftMonitor(position_bins={self.position_bins}, seqlen_bins={self.seqlen_bins}, "
            f"prefix={self.prefix!r}, backend={self.backend!r})"
        )

    # ------------------------------------------------------------------ numerics families

    def check_families(
        self,
        rollout_provenance: list[dict[str, Any]],
        trainer_provenance: list[dict[str, Any]],
        *,
        strict: bool = False,
    ) -> list[str]:
        """Whether the two sides run the same numerics families: a bitwise-equal fraction
        below 1 has a cause these name. Call it once, after both sides ran a forward.

        Args:
            rollout_provenance: the rollout's registry report, or
                :func:`rl_engine.adapters.vllm.provenance` of the ``LLM`` (one dict per worker).
            trainer_provenance: the trainer's ``KernelRegistry.report()`` (every TP rank runs
                the same families; one rank's report is enough).
            strict: raise ``RuntimeError`` on a mismatch instead of warning.
        Returns:
            One line per problem (empty: the families match), from
            :func:`rl_engine.drift.metrics.provenance_check`; e.g. a rollout at TP 1 on plain
            ``det_gemm`` and a trainer at TP 2 on the grouped ``det_gemm_tp`` reduction, with
            the fix (``RL_ENGINE_TP_GROUPS=8`` on both sides). Each line is also warned
            (``RuntimeWarning``).
        """
        from rl_engine.drift.metrics import provenance_check

        problems = provenance_check(rollout_provenance, trainer_provenance)["problems"]
        if problems:
            msg = "DriftMonitor: rollout and trainer numerics differ:\n  " + "\n  ".join(problems)
            if strict:
                raise RuntimeError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return problems

    # ------------------------------------------------------------------ per token / per row

    def _tokens(
        self,
        rollout_logp: torch.Tensor,
        trainer_logp: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """Per-token float64 quantities ([B, T], exact 0 at masked-out tokens) and checks."""
        _check_inputs(rollout_logp, trainer_logp, mask)
        roll = rollout_logp.detach()
        train = trainer_logp.detach()
        if mask is None:
            m = torch.ones(roll.shape, dtype=torch.bool, device=roll.device)
            bad_mask = torch.zeros((), dtype=torch.int64, device=roll.device)
        elif mask.dtype == torch.bool:
            m = mask.detach()
            bad_mask = torch.zeros((), dtype=torch.int64, device=roll.device)
        else:
            mk = mask.detach()
            bad_mask = ((mk != 0) & (mk != 1)).sum()
            m = mk != 0
        # ratio_kl: logp = trainer (p), old_logp = rollout (q); r = trainer - rollout (fp32),
        # exactly 0 at masked-out tokens whatever they hold (NaN / inf padding included).
        out = ratio_kl(train, roll, m, log_ratio_clamp=_NO_CLAMP, backend=self.backend)
        zero = torch.zeros((), dtype=torch.float64, device=roll.device)
        r = out.log_ratio.double()
        a = r.abs()
        em1 = _math.exp64(r) - 1.0  # exp(r) - 1 in float64; exactly 0 where r == 0
        nonfinite = (~(torch.isfinite(roll) & torch.isfinite(train)) & m).sum()
        return {
            "m": m,
            "n": m.double(),
            "abs": a,
            "r": r,
            "k2": out.k2.double(),
            "k3": out.k3.double(),
            "chi2": em1 * em1,
            "ratio": torch.where(m, out.ratio.double(), zero),
            "ratio_raw": out.ratio.double(),
            "gt": ((a > LN2) & m).double(),
            "eq": ((roll == train) & m).double(),
            "exp_abs": torch.where(m, _math.exp64(a), zero),
            "lp_roll": torch.where(m, roll.double(), zero),
            "lp_train": torch.where(m, train.double(), zero),
            "bad_mask": bad_mask,
            "nonfinite": nonfinite,
        }

    @staticmethod
    def _row_max_abs(tok: dict[str, torch.Tensor]) -> torch.Tensor:
        neg = torch.full((), -math.inf, dtype=torch.float64, device=tok["abs"].device)
        return torch.where(tok["m"], tok["abs"], neg).amax(dim=-1)

    def per_sequence(
        self,
        rollout_logp: torch.Tensor,
        trainer_logp: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-row quantities, [B] float64 tensors on the inputs' device (no host sync).

        ``tokens`` (masked tokens), ``abs_diff_sum``, ``abs_diff_max`` (0 for a row without
        tokens), ``log_ratio_sum`` (S = sum of r), ``kl_k3_sum``, ``bitwise_equal`` (count) and
        ``chi2_seq`` ((exp(S) - 1)^2, 0 for a row without tokens). Each row's values are bitwise
        independent of the other rows, of B and of right padding (module docstring). Input
        shapes, dtypes and devices are checked; the data is not (non-finite inputs at masked
        tokens give NaN / inf here, where ``__call__`` raises).
        """
        with torch.no_grad():
            tok = self._tokens(rollout_logp, trainer_logp, mask)
            n = tree_sum(tok["n"], dim=-1)
            s = tree_sum(tok["r"], dim=-1)
            has = n > 0
            zero = torch.zeros((), dtype=torch.float64, device=n.device)
            em1 = _math.exp64(s) - 1.0
            return {
                "tokens": n,
                "abs_diff_sum": tree_sum(tok["abs"], dim=-1),
                "abs_diff_max": torch.where(has, self._row_max_abs(tok), zero),
                "log_ratio_sum": s,
                "kl_k3_sum": tree_sum(tok["k3"], dim=-1),
                "bitwise_equal": tree_sum(tok["eq"], dim=-1),
                "chi2_seq": torch.where(has, em1 * em1, zero),
            }

    # ------------------------------------------------------------------ batch metrics

    def __call__(
        self,
        rollout_logp: torch.Tensor,
        trainer_logp: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Metrics of one batch: ``{name: float}`` (names of :attr:`names`), one host sync.

        Args:
            rollout_logp: [B, T] log-probs of the sampled tokens from the rollout engine
                (fp32; bf16 / fp16 accepted when ``trainer_logp`` has the same dtype).
            trainer_logp: [B, T] log-probs of the same tokens from the trainer.
            mask: [B, T] bool or 0 / 1 numbers: the loss-masked tokens to compare; None = all.

        Raises:
            TypeError: a non-tensor, a dtype that is not fp32 / bf16 / fp16, or two dtypes.
            ValueError: shapes that are not one [B, T] shape, inputs on different devices, an
                empty batch or mask, mask values other than 0 / 1, or non-finite log-probs at
                masked tokens (the message gives the count; masked-out positions may hold
                anything).
        """
        with torch.no_grad():
            packed = self._compute(rollout_logp, trainer_logp, mask)
            values = packed.cpu().tolist()  # the one host sync
        bad_mask, nonfinite, *values = values
        if bad_mask:
            raise ValueError(
                f"DriftMonitor: mask must hold only 0 / 1 (or be bool); {int(bad_mask)} values are "
                "something else"
            )
        tokens = values[0]
        if tokens == 0:
            raise ValueError("DriftMonitor: the mask selects no tokens; nothing to compare")
        if nonfinite:
            raise ValueError(
                f"DriftMonitor: {int(nonfinite)} of {int(tokens)} masked tokens have a non-finite "
                "log-prob (NaN / inf) in rollout_logp or trainer_logp; mask them out or fix the "
                "producer (masked-out positions may hold anything)"
            )
        return dict(zip(self.names, values))

    def _compute(
        self,
        rollout_logp: torch.Tensor,
        trainer_logp: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Everything on the device, packed as ``[bad_mask, nonfinite, *metrics]`` (float64)."""
        tok = self._tokens(rollout_logp, trainer_logp, mask)
        m = tok["m"]
        dev = m.device
        zero = torch.zeros((), dtype=torch.float64, device=dev)

        def rows(x: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B], fixed order per row
            return tree_sum(x, dim=-1)

        def total(x: torch.Tensor) -> torch.Tensor:  # [B, T] -> scalar: rows, then over B
            return tree_sum(rows(x), dim=-1)

        n_row = rows(tok["n"])
        n = tree_sum(n_row, dim=-1)
        has = n_row > 0
        n_seq = tree_sum(has.double(), dim=-1)

        abs_row = rows(tok["abs"])
        r_row = rows(tok["r"])
        k3_row = rows(tok["k3"])
        eq_row = rows(tok["eq"])
        abs_mean = tree_sum(abs_row, dim=-1) / n
        abs_dev = torch.where(m, tok["abs"] - abs_mean, zero)
        abs_std = torch.sqrt(total(abs_dev * abs_dev) / n)
        abs_max = self._row_max_abs(tok).amax()
        abs_seq = tree_sum(torch.where(has, abs_row / n_row.clamp_min(1.0), zero), dim=-1) / n_seq

        ratio_mean = total(tok["ratio"]) / n
        ratio_dev = torch.where(m, tok["ratio"] - ratio_mean, zero)
        ratio_std = torch.sqrt(total(ratio_dev * ratio_dev) / n)
        inf = torch.full((), math.inf, dtype=torch.float64, device=dev)
        ratio_min = torch.where(m, tok["ratio_raw"], inf).amin()
        ratio_max = torch.where(m, tok["ratio_raw"], -inf).amax()

        em1_seq = _math.exp64(r_row) - 1.0
        chi2_seq = tree_sum(torch.where(has, em1_seq * em1_seq, zero), dim=-1) / n_seq
        mean_roll = total(tok["lp_roll"]) / n
        mean_train = total(tok["lp_train"]) / n

        metrics = {
            "tokens": n,
            "sequences": n_seq,
            "abs_diff_mean": abs_mean,
            "abs_diff_std": abs_std,
            "abs_diff_max": abs_max,
            "abs_diff_seq_mean": abs_seq,
            "abs_diff_gt_ln2_frac": total(tok["gt"]) / n,
            "exp_abs_diff_mean": total(tok["exp_abs"]) / n,
            "bitwise_equal_frac": tree_sum(eq_row, dim=-1) / n,
            "kl_k1": -tree_sum(r_row, dim=-1) / n,
            "kl_k2": total(tok["k2"]) / n,
            "kl_k3": tree_sum(k3_row, dim=-1) / n,
            "chi2_token": total(tok["chi2"]) / n,
            "chi2_seq": chi2_seq,
            "ppl_rollout": _math.exp64(-mean_roll),
            "ppl_trainer": _math.exp64(-mean_train),
            "ppl_ratio": _math.exp64(mean_roll - mean_train),
            "is_ratio_mean": ratio_mean,
            "is_ratio_std": ratio_std,
            "is_ratio_min": ratio_min,
            "is_ratio_max": ratio_max,
        }
        out = [tok["bad_mask"].double(), tok["nonfinite"].double()]
        out += [metrics[k] for k in METRIC_DOCS]

        # position bins: column sums (over B, fixed order), then over the bin's columns
        t = m.shape[1]
        if self._pos:
            cols = torch.stack(
                [tree_sum(tok[k], dim=0) for k in ("n", "abs", "k3", "eq")]
            )  # [4, T]
            for _, lo, hi in self._pos:
                if lo >= t:
                    s = torch.zeros(4, dtype=torch.float64, device=dev)
                else:
                    end = t if hi == math.inf else min(int(hi), t)
                    s = tree_sum(cols[:, lo:end], dim=-1)
                out += [s[0], s[1] / s[0], s[2] / s[0], s[3] / s[0]]

        # sequence-length bins: the rows' sums, weighted by the row's bin membership
        if self._seq:
            row_stats = torch.stack([n_row, abs_row, k3_row, eq_row])  # [4, B]
            for _, lo, hi in self._seq:
                inb = has & (n_row >= lo)
                if hi != math.inf:
                    inb = inb & (n_row < hi)
                w = inb.double()
                s = tree_sum(row_stats * w, dim=-1)
                out += [tree_sum(w, dim=-1), s[0], s[1] / s[0], s[2] / s[0], s[3] / s[0]]
        return torch.stack(out)
