"""The construct stage's report (`stats.json`): paper Table 5 (% Self per dataset), Figure 3
(preference flips between no-context and verbalization labels), and every problem counted."""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from pathlib import Path

from jaxrag.data.construct_genread import EMPTY_REDRAWS, ROUND1, read_jsonl
from jaxrag.models.tokens import SELF, WIKI

_COUNTS = ("truncated_verbalizations", "empty_verbalizations", "demos_dropped", "empty_passages", "short_retrieval",
           "no_wiki", "skipped_no_answer", "too_long", "no_context")


def figure3_flip(record: dict) -> bool:
    """Figure 3's reversal: the preference between the best retrieved passage c_e+ and the
    parametric side differs when that side is no context (prior selective retrieval) rather than
    the best verbalization c_i+. Ties go to Wiki, as in `label_source`."""
    best = {s: max((c["loglik"] for c in record["contexts"] if c["source"] == s), default=-math.inf)
            for s in (SELF, WIKI)}
    return (best[WIKI] >= record["no_context_loglik"]) != (best[WIKI] >= best[SELF])


def construct_stats(out_dir: str | os.PathLike, skipped: dict[str, int], questions: dict[str, int],
                    params=None, too_long: dict[str, int] | None = None) -> dict:
    """Per dataset and over all: questions, % labelled Self (Table 5), % Figure-3 flips, % where
    the no-context ("w/o kv. label") label differs, % Selective-RAG Wiki labels, mean p(a|q),
    p(a|q,c_i+), p(a|q,c_e+) (Figure 3's bars) and the problems counted. questions: per dataset,
    the questions construction ran on (those with an answer); one without a record is counted.
    too_long: per dataset, questions dropped for exceeding the training length (`drop_too_long`)."""
    acc: dict[str, Counter] = {name: Counter(skipped_no_answer=k) for name, k in skipped.items()}
    for name, k in (too_long or {}).items():
        acc.setdefault(name, Counter())["too_long"] = k
    for path in sorted(Path(out_dir).glob("shard-*.jsonl")):
        for r in read_jsonl(path):
            a = acc.setdefault(r["dataset"], Counter())
            lls = {s: [c["loglik"] for c in r["contexts"] if c["source"] == s] for s in (SELF, WIKI)}
            pr = r["problems"]
            a.update(n=1, self=r["label"] == SELF, flip=figure3_flip(r), no_kv_differs=r["no_kv_label"] != r["label"],
                     selective_wiki=r["selective_label"] == WIKI, verbalizations=len(lls[SELF]),
                     truncated_verbalizations=pr["truncated"], empty_verbalizations=pr["empty_verbalizations"],
                     demos_dropped=pr["demos_dropped"], empty_passages=pr["empty_passages"],
                     short_retrieval=pr["missing_passages"] > 0, no_wiki=not lls[WIKI], with_wiki=bool(lls[WIKI]),
                     with_self=bool(lls[SELF]), p_no_context=math.exp(r["no_context_loglik"]),
                     p_best_self=math.exp(max(lls[SELF])) if lls[SELF] else 0.0,
                     p_best_wiki=math.exp(max(lls[WIKI])) if lls[WIKI] else 0.0)

    def summary(a: Counter) -> dict:
        def pct(key):
            return round(100.0 * a[key] / a["n"], 2) if a["n"] else None

        def mean(key, n="n"):
            return a[key] / a[n] if a[n] else None

        return {"n": a["n"], "self_pct": pct("self"), "flip_pct": pct("flip"),
                "no_kv_label_differs_pct": pct("no_kv_differs"), "selective_wiki_pct": pct("selective_wiki"),
                "mean_p": {"no_context": mean("p_no_context"), "best_self": mean("p_best_self", "with_self"),
                           "best_wiki": mean("p_best_wiki", "with_wiki")},
                "verbalizations": a["verbalizations"], **{k: int(a[k]) for k in _COUNTS}}

    for name, total in questions.items():  # every question with an answer, recorded or not
        a = acc.setdefault(name, Counter())
        a["no_context"] = total - a["n"]  # every verbalization empty and no passage: no record
    round1 = [r for p in sorted(Path(out_dir).glob(f"{ROUND1}/shard-*.jsonl")) for r in read_jsonl(p)]
    out = {"datasets": {name: summary(a) for name, a in sorted(acc.items())},
           "all": summary(sum(acc.values(), Counter())), "params": dataclasses.asdict(params) if params else None}
    out["all"]["round1_truncated"] = sum(r["truncated"] for r in round1)
    out["all"]["round1_empty"] = sum(not r["document"] for r in round1)
    return out


def stats_markdown(stats: dict) -> str:
    """stats.json as a markdown table for the run's report."""
    def cell(v):
        return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    head = ("| dataset | n | % Self (Table 5) | % flip (Fig. 3) | % no-kv label differs | % Selective Wiki "
            "| truncated / kept verb. | empty verb. | short / no retrieval | skipped (no answer / too long / no context) |")
    rows = [head, "|" + "---|" * 10]
    for name, e in [*stats["datasets"].items(), ("all", stats["all"])]:
        rows.append(f"| {name} | {e['n']} | {cell(e['self_pct'])} | {cell(e['flip_pct'])} | "
                    f"{cell(e['no_kv_label_differs_pct'])} | {cell(e['selective_wiki_pct'])} | "
                    f"{e['truncated_verbalizations']} / {e['verbalizations']} | {e['empty_verbalizations']} | "
                    f"{e['short_retrieval']} / {e['no_wiki']} | "
                    f"{e['skipped_no_answer']} / {e.get('too_long', 0)} / {e.get('no_context', 0)} |")
    rows.append("\nAn empty GenRead document is drawn again with sampling (at most "
                f"{EMPTY_REDRAWS} times); one still empty is no context (never c_i+ or c_i-) and is counted "
                "under *empty verb.* A question left with fewer than n verbalizations is labelled from those it "
                "has: the Self side sums p(a | q, c_i) over fewer documents (so it leans to Wiki), c_i+ / c_i- "
                "are its best / worst kept ones, and the no-kv label still compares with n no-context terms.")
    return "\n".join(rows) + "\n"
