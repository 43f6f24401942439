"""Charging a routed batch's measured phase times to its items (paper App. B.2).

    T_total = T_d + T_v + T_g   (verbalize)        T_d + T_r + T_g   (retrieve)

A batch is timed phase by phase; an item's share of a phase is the phase's time over the rows
that used it: T_d (prefill, the policy, appending the chosen source token) and T_g (the answer)
over every row, T_v (Self rows' verbalization) over the Self rows, T_r (one batched retrieval)
over the retrieving rows. A phase that ran while no row used it (the verbalization step of a
batch without a Self row, which still appends nothing and returns) is charged to every row as
T_d, so the items' latencies always add up to the batch's measured time: no second is charged
to nobody.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxrag.models.tokens import NONE, SELF


def charge_phases(seconds: Mapping[str, float], sources: Sequence[str]) -> list[dict[str, float]]:
    """A batch's phase times {T_d, T_v, T_r, T_g} (absent = 0) and each row's source -> each
    row's {T_d, T_v | T_r (when it used one), T_g}. Sum over rows = sum of the phase times."""
    n = len(sources)
    if not n:
        raise ValueError("charge_phases: empty batch")
    users = {"T_v": [i for i, s in enumerate(sources) if s == SELF],
             "T_r": [i for i, s in enumerate(sources) if s not in (SELF, NONE)]}
    unused = sum(float(seconds.get(p, 0.0)) for p, rows in users.items() if not rows)
    out = [{"T_d": (float(seconds.get("T_d", 0.0)) + unused) / n} for _ in range(n)]
    for phase, rows in users.items():
        for i in rows:
            out[i][phase] = float(seconds.get(phase, 0.0)) / len(rows)
    for row in out:
        row["T_g"] = float(seconds.get("T_g", 0.0)) / n
    return out
