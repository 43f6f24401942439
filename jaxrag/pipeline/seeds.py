"""The paper's claims over world seeds: one recipe, several finished workdirs.

    python -m jaxrag.eval.seeds W [W ...] [--json OUT] [--allow-mixed-code]

Each W is a finished workdir or a `results.json` itself (the kept runs are in
`results/embedded/`, so its pooled tables can be recomputed without the workdirs).

The runs must be of one code as well as one config: each `results.json` names the commit every
stage ran at (`code`), and runs whose stages ran at different commits are refused unless
`--allow-mixed-code` is given (the table then says so). Runs made before results named their code
pool with a note that it is not recorded. A run whose base failed its reading gate is refused.

One pipeline's bootstrap intervals resample its test questions, not its training, and retraining
moves the numbers by more than those intervals. So a claim is judged over world seeds of one
config (the workdirs must differ in `seed` only): per seed the paired difference and its 95%
interval, how many seeds hold it beyond the noise, and the mean over seeds with a t-interval
over seeds (which carries the training noise as well); then every method's accuracy, % retrieval
and measured latency over seeds. Nothing here chooses anything: it reads finished `results.json`
files.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from jaxrag.errors import JaxragError, exit_code
from jaxrag.eval.report import code_name
from jaxrag.pipeline.config_check import flatten, under
from jaxrag.pipeline.provenance import is_neutral

# (label, results.json section, key): the paper's claims first, then the ablations.
CLAIMS = (
    ("SR-RAG - Selective RAG (accuracy)", "comparisons", "srrag - selective_rag"),
    ("SR-RAG - fine-tuned always RAG (accuracy)", "comparisons", "srrag - srrag_always_rag"),
    ("SR-RAG - w/o kNN (AUROC)", "source_selection_comparisons", "srrag - srrag_no_knn"),
    ("SR-RAG - w/o kNN (accuracy)", "comparisons", "srrag - srrag_no_knn"),
    ("SR-RAG - w/o kv label (accuracy)", "comparisons", "srrag - srrag_no_kv_label"),
    ("SR-RAG - w/o DPO (accuracy)", "comparisons", "srrag - srrag_no_dpo"),
)
# Fields that may differ between seeds of one recipe (the world follows `seed`; SeaKR's threshold
# is fitted on each run's training data); the rest must agree.
PER_SEED = ("seed", "world.seed", "data_counts", "n_validation", "n_test", "n_latency", "pipeline",
            "thresholds.seakr", "thresholds.seakr_fitted_on_training")


def recipe(config: dict) -> dict:
    """A run's config without the fields that may differ between seeds of one recipe, nor those
    that cannot change a result (`provenance.NEUTRAL`), flattened."""
    return {k: v for k, v in flatten(config).items()
            if not any(under(k, p) for p in PER_SEED) and not is_neutral(k)}


def load(workdirs: list[Path], allow_mixed_code: bool = False) -> dict[str, dict]:
    """results.json path -> its content, for workdirs or results.json files; refuses runs whose
    configs differ beyond the seed, runs of different code (unless `allow_mixed_code`) and runs
    whose base failed its reading gate."""
    results = {}
    for w in map(Path, workdirs):
        path = w if w.suffix == ".json" else w / "results.json"
        try:
            results[str(path)] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise JaxragError(f"{path}: cannot read a finished run's results ({e})") from None
    seeds = [r["config"]["seed"] for r in results.values()]
    if len(set(seeds)) < len(seeds):
        raise JaxragError(f"seeds {seeds}: each run must be a different world seed")

    first, *rest = results
    ref = recipe(results[first]["config"])
    for w in rest:
        got = recipe(results[w]["config"])
        diff = sorted(k for k in ref.keys() | got.keys() if ref.get(k) != got.get(k))
        if diff:
            raise JaxragError(f"{w}: config differs from {first} beyond the seed in "
                              f"{', '.join(diff[:5])}{' ...' if len(diff) > 5 else ''}; compare seeds of one recipe")
    for w, r in results.items():
        base = r.get("base") or {}
        if base.get("reading_gate_passed") is False:
            gate = (r["config"].get("world_probe") or {}).get("reading_gate")
            raise JaxragError(f"{w}: its base failed the reading gate (reads {base.get('fresh_reading')} of "
                              f"fresh-entity questions{'' if gate is None else f', gate {gate}'}); a run on a base "
                              "that cannot read passages is not a seed of the recipe")
    codes = {w: run_code(r) for w, r in results.items()}
    if len(set(codes.values())) > 1 and not allow_mixed_code:
        raise JaxragError("runs of different code: " + "; ".join(f"{w} at {c}" for w, c in codes.items())
                          + "; pool one commit's runs, or pass --allow-mixed-code")
    return results


def run_code(results: dict) -> str:
    """The commits a run's stages ran at, in stage order ("abc1234", "abc1234+dirty", or
    "abc1234, def5678" for a run whose stages ran across commits; "not recorded" for a run made
    before results.json named its code)."""
    code = results.get("code")
    if not code:
        return "not recorded"
    names = [code_name(c) for c in (*(code.get("stages") or {}).values(), code)]
    return ", ".join(dict.fromkeys(names))


def t_interval(values: list[float]) -> list[float] | None:
    """95% t-interval of the mean over seeds; None with fewer than two (null in JSON, not NaN)."""
    # lazy: scipy: only this statistic needs it
    from scipy import stats

    x = np.asarray(values, np.float64)
    if len(x) < 2:
        return None
    half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return [float(x.mean() - half), float(x.mean() + half)]


def summarize(results: dict[str, dict]) -> dict:
    """Per claim: each seed's diff and interval, seeds above / below the noise, mean and t-interval."""
    seeds = {w: r["config"]["seed"] for w, r in results.items()}
    claims = {}
    for label, section, key in CLAIMS:
        rows = [(seeds[w], r[section][key]) for w, r in results.items() if key in r.get(section, {})]
        if not rows:
            continue
        diffs = [c["diff"] for _, c in rows]
        claims[label] = {
            "per_seed": {str(s): {"diff": c["diff"], "ci95": c["ci95"]} for s, c in rows},
            "above_noise": sum(c["ci95"][0] > 0 for _, c in rows),
            "below_noise": sum(c["ci95"][1] < 0 for _, c in rows),
            "mean": float(np.mean(diffs)), "t95": t_interval(diffs), "seeds": len(rows)}
    srrag = {str(seeds[w]): r["average"]["srrag"] for w, r in results.items()}
    return {"seeds": [seeds[w] for w in results], "code": {str(seeds[w]): run_code(r) for w, r in results.items()},
            "claims": claims,
            "srrag_retrieval_at_most_80": sum(a["rag_frac"] <= 0.8 for a in srrag.values()),
            "srrag": {s: {"acc": a["acc"], "rag_frac": a["rag_frac"]} for s, a in srrag.items()},
            "methods": methods(results)}


def methods(results: dict[str, dict]) -> dict:
    """Per method every run has: accuracy, % retrieval and measured latency (each run times every
    method in the same routed batches), each as the mean over seeds with a t-interval and the
    per-seed values; latency only where every run measured it."""
    runs = list(results.values())
    names = [m for m in runs[0]["average"] if all(m in r["average"] for r in runs)]
    out = {}
    for m in names:
        rows = [r["average"][m] for r in runs]
        out[m] = {}
        for field in ("acc", "rag_frac", "latency_s"):
            if all(field in a for a in rows):
                values = [float(a[field]) for a in rows]
                out[m][field] = {"per_seed": values, "mean": float(np.mean(values)), "t95": t_interval(values)}
    return out


def _signed(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def code_line(summary: dict) -> str:
    """One line: the code every run ran at, or each seed's when they differ (`--allow-mixed-code`)."""
    codes = summary["code"]
    if len(set(codes.values())) == 1:
        return f"code: {next(iter(codes.values()))} (every run)"
    return ("MIXED CODE (--allow-mixed-code): " + "; ".join(f"seed {s} at {c}" for s, c in codes.items())
            + "; differences may be the code's, not the seeds'")


def table(summary: dict) -> str:
    n = len(summary["seeds"])
    lines = [code_line(summary),
             f"{n} seeds: {', '.join(map(str, summary['seeds']))}; SR-RAG retrieves at most 80% on "
             f"{summary['srrag_retrieval_at_most_80']} of {n}",
             "| claim | " + " | ".join(f"seed {s}" for s in summary["seeds"])
             + " | above / below noise | mean over seeds [95% t] |",
             "|---|" + "---|" * (n + 2)]
    for label, c in summary["claims"].items():
        cells = [f"{_signed(v['diff'])} [{_signed(v['ci95'][0])}, {_signed(v['ci95'][1])}]" if v else "–"
                 for v in (c["per_seed"].get(str(s)) for s in summary["seeds"])]
        t95 = f"[{_signed(c['t95'][0])}, {_signed(c['t95'][1])}]" if c["t95"] else "(no interval from one seed)"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {c['above_noise']} / {c['below_noise']} of "
                     f"{c['seeds']} | {_signed(c['mean'])} {t95} |")
    if summary.get("methods"):
        lines += ["", "| method | accuracy, mean [95% t] | % retrieval, mean (seeds' range) | latency s, mean [95% t] |",
                  "|---|---|---|---|"]
        for m, f in summary["methods"].items():
            lines.append(f"| {m} | {_mean_t(f.get('acc'), '.3f')} | {_mean_range(f.get('rag_frac'))} | "
                         f"{_mean_t(f.get('latency_s'), '.4f')} |")
    return "\n".join(lines)


def _mean_t(field: dict | None, fmt: str) -> str:
    if field is None:
        return "–"
    t = f" [{field['t95'][0]:{fmt}}, {field['t95'][1]:{fmt}}]" if field["t95"] else ""
    return f"{field['mean']:{fmt}}{t}"


def _mean_range(field: dict | None) -> str:
    if field is None:
        return "–"
    return f"{field['mean']:.0%} ({min(field['per_seed']):.0%}-{max(field['per_seed']):.0%})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxrag.eval.seeds", description=__doc__.split("\n")[0])
    p.add_argument("workdirs", nargs="+", type=Path,
                   help="finished workdirs (or their results.json) of one config, one per world seed")
    p.add_argument("--json", type=Path, help="also write the summary here")
    p.add_argument("--allow-mixed-code", action="store_true",
                   help="pool runs whose stages ran at different commits (the table says so)")
    args = p.parse_args(argv)

    def run():
        summary = summarize(load(args.workdirs, args.allow_mixed_code))
        print(table(summary))
        if args.json:
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps(summary, indent=1) + "\n")
            tmp.replace(args.json)

    return exit_code(run)

