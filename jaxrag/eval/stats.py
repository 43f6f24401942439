"""Uncertainty of the reported numbers: percentile bootstrap over test questions.

The paper's average is the mean over datasets of each dataset's mean, so resampling is stratified:
each draw resamples every dataset's questions with replacement, at its own size. Methods are
evaluated on the same questions, so a difference is bootstrapped *paired* (the same draw for both
methods), which is much tighter than two separate intervals: question difficulty cancels. scipy's
`bootstrap` has no strata, hence this small numpy version (tested against it on one dataset).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrag.errors import JaxragError
from jaxrag.models.tokens import WIKI


class StratifiedBootstrap:
    """Fixed draws (one per sample and dataset) shared by every statistic, so paired
    differences use the same resampled questions for both methods."""

    def __init__(self, datasets: Sequence[str], samples: int = 1000, seed: int = 0):
        names = np.asarray(datasets)
        rng = np.random.default_rng(seed)
        self.groups = {name: np.flatnonzero(names == name) for name in dict.fromkeys(names.tolist())}
        # draws[name]: [samples, n_name] question indices (into the full arrays) per resample
        self.draws = {name: idx[rng.integers(0, len(idx), (samples, len(idx)))]
                      for name, idx in self.groups.items()}
        self.samples = samples

    def average(self, values: np.ndarray) -> np.ndarray:
        """[n] per-question values -> [samples] mean over datasets of each dataset's mean."""
        values = np.asarray(values, np.float64)
        return np.mean([values[d].mean(axis=1) for d in self.draws.values()], axis=0)

    def auroc(self, labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """[samples] mean over datasets of each resample's AUROC (`auroc` of the drawn questions);
        a dataset whose resample lacks a class is left out of that draw's mean. A resample is a
        count per question, so its Mann-Whitney U is counts_pos . wins . counts_neg, with wins 1
        (0.5 on ties) per (positive, negative) pair: exact in float64, one matrix product for all
        draws where a Python loop over them took ~50 s of a tiny run's eval."""
        labels, scores = np.asarray(labels, bool), np.asarray(scores, np.float64)
        out = np.full((len(self.draws), self.samples), np.nan)
        for j, (idx, d) in enumerate(zip(self.groups.values(), self.draws.values())):
            counts = np.zeros((self.samples, len(idx)))
            np.add.at(counts, (np.arange(self.samples)[:, None], np.searchsorted(idx, d)), 1.0)
            y, s = labels[idx], scores[idx]
            wins = (s[y][:, None] > s[~y]) + 0.5 * (s[y][:, None] == s[~y])
            pos, neg = counts[:, y], counts[:, ~y]
            pairs = pos.sum(1) * neg.sum(1)
            u = np.einsum("sp,sp->s", pos @ wins, neg) if wins.size else np.zeros(self.samples)
            out[j] = np.where(pairs > 0, u / np.maximum(pairs, 1), np.nan)
        return np.nanmean(out, axis=0) if np.isfinite(out).any() else np.full(self.samples, np.nan)


def interval(draws: np.ndarray, level: float = 0.95) -> list[float]:
    """Percentile interval [lo, hi] of bootstrap draws (NaN draws dropped)."""
    draws = np.asarray(draws, np.float64)
    draws = draws[np.isfinite(draws)]
    if not len(draws):
        return [float("nan"), float("nan")]
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def paired_difference(boot: StratifiedBootstrap, a: np.ndarray, b: np.ndarray) -> dict:
    """Average of a minus average of b, with the paired 95% interval and whether it excludes 0."""
    diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    point = float(np.mean([diff[idx].mean() for idx in boot.groups.values()]))
    ci = interval(boot.average(diff))
    return {"diff": point, "ci95": ci, "significant": bool(ci[0] > 0 or ci[1] < 0)}


def auroc(labels: np.ndarray, scores: np.ndarray) -> float:
    """AUROC as the Mann-Whitney U of the positives' scores over the negatives' (ties count
    half; equals sklearn's roc_auc_score), NaN with one class. Fast enough for 1,000 draws."""
    # lazy: scipy: only this statistic needs it
    from scipy.stats import mannwhitneyu

    labels = np.asarray(labels, bool)
    pos, neg = np.asarray(scores)[labels], np.asarray(scores)[~labels]
    if not len(pos) or not len(neg):
        return float("nan")
    return float(mannwhitneyu(pos, neg, method="asymptotic", use_continuity=False).statistic / (len(pos) * len(neg)))


def paired_auroc_difference(boot: StratifiedBootstrap, paths_a, d_a, paths_b, d_b) -> dict:
    """Table 2's average AUROC of method a minus method b on one set of labels ("retrieval
    strictly better than the other path"), with a paired 95% interval. Both methods must rank the
    same labels (e.g. SR-RAG and its w/o kNN ablation, one model's paths): AUROCs over different
    positives are not one quantity, so that is an error."""
    def labels_of(paths):
        return np.asarray(paths.correct[WIKI] > paths.correct[paths.other])

    if not np.array_equal(labels_of(paths_a), labels_of(paths_b)):
        raise JaxragError("paired_auroc_difference: the two methods' AUROCs rank different labels (their "
                          "paths differ); compare AUROCs only over one set of labels")

    def draws(paths, d):
        labels = labels_of(paths)
        per_set = np.array([auroc(labels[idx], d.score[idx]) for idx in boot.groups.values()])
        point = np.nan if np.isnan(per_set).all() else np.nanmean(per_set)  # no set with both classes
        return point, boot.auroc(labels, d.score)

    (pa, da), (pb, db) = draws(paths_a, d_a), draws(paths_b, d_b)
    ci = interval(da - db)
    return {"diff": float(pa - pb), "ci95": ci, "significant": bool(ci[0] > 0 or ci[1] < 0)}
