"""The paper's training mixture (App. B.1, Table 5) and stratified samples of it.

Real data: each training dataset's public train split is the pool; `mixture_split` draws the
configured validation and train counts from it without overlap, deterministically from the seed.
A pool smaller than both is refused before any stage runs (`data.check`); here it would keep its
validation share first and train on the rest. The baselines' training samples (IK, SeaKR, CCSK
fit on at most `baselines.max_train_questions`) are stratified over the datasets with
`stratified_sample`, so no single dataset fills the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def _rng(seed: int, name: str) -> np.random.Generator:
    # Seeded per dataset by its name, so adding a dataset does not reshuffle the others.
    return np.random.default_rng([int(seed), *name.encode()])


def mixture_split(examples: Sequence[T], n_train: int, n_validation: int, seed: int,
                  name: str) -> tuple[list[T], list[T]]:
    """(train, validation) drawn from one dataset's pool; each keeps the pool's order."""
    order = _rng(seed, name).permutation(len(examples))
    val = np.sort(order[:n_validation])
    train = np.sort(order[n_validation:n_validation + n_train])
    return [examples[i] for i in train], [examples[i] for i in val]


def stratified_sample(items: Sequence[tuple[str, T]], n: int, seed: int) -> list[tuple[str, T]]:
    """At most `n` (dataset, example) items with each dataset's share proportional to its size
    (largest remainders), drawn at random within a dataset; the input order is kept."""
    if n >= len(items):
        return list(items)
    names = list(dict.fromkeys(name for name, _ in items))
    idx = {name: [i for i, (m, _) in enumerate(items) if m == name] for name in names}
    exact = np.array([n * len(idx[m]) / len(items) for m in names])
    quota = np.floor(exact).astype(int)
    for j in np.argsort(-(exact - quota), kind="stable")[: n - quota.sum()]:
        quota[j] += 1
    keep = sorted(i for m, q in zip(names, quota) for i in _rng(seed, m).permutation(idx[m])[:q])
    return [items[i] for i in keep]
