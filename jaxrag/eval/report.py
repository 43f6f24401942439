"""The eval stage's human-readable output: `report.md` laid out like the paper's tables (its plots
and the files: `jaxrag.eval.plots`).

Input is the results dict of `results.json` (docs/method.md, shared formats). Tables follow the paper: Table 1 (ACC
and % RAG per dataset, then the average and latency per item), Table 2 (source-selection accuracy
and AUROC), Table 3 (SR-RAG against its ablations), the construct stage's Table 5-style
statistics, and the run's config.

Rendering is pure (dict -> str) so it can be tested and re-run on an old `results.json`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Display order and names of Table 1 (paper §4.2), then the ablations (Table 3) and other seeds.
METHODS: dict[str, str] = {
    "no_ft_always_rag": "Untuned, always RAG",
    "no_ft_genread": "Untuned, GenRead",
    "selective_always_rag": "Selective RAG fine-tuned, always RAG",
    "selective_rag": "Selective RAG",
    "srrag_always_rag": "SR-RAG fine-tuned, always RAG",
    "srrag": "SR-RAG",
    "srrag_no_knn": "SR-RAG w/o kNN",
    "srrag_no_kv_label": "SR-RAG w/o kv label",
    "srrag_no_dpo": "SR-RAG w/o DPO",
    "ik": "IK classifier",
    "seakr": "SeaKR",
    "ccsk": "CCSK",
}
ABLATIONS = ("srrag_no_knn", "srrag_no_kv_label", "srrag_no_dpo")
# The paper's Table 1 averages (ACC, % RAG) over its four sets, printed beside ours on real data.
PAPER_TABLE1 = {
    "llama": {"no_ft_always_rag": (0.543, 1.0), "no_ft_genread": (0.496, 0.0), "selective_always_rag": (0.596, 1.0),
              "selective_rag": (0.597, 0.86), "srrag_always_rag": (0.634, 1.0), "srrag": (0.644, 0.64)},
    "phi3": {"no_ft_always_rag": (0.614, 1.0), "no_ft_genread": (0.545, 0.0), "selective_always_rag": (0.682, 1.0),
             "selective_rag": (0.682, 0.92), "srrag_always_rag": (0.684, 1.0), "srrag": (0.696, 0.55)},
    "qwen2": {"no_ft_always_rag": (0.648, 1.0), "no_ft_genread": (0.628, 0.0), "selective_always_rag": (0.659, 1.0),
              "selective_rag": (0.655, 0.85), "srrag_always_rag": (0.663, 1.0), "srrag": (0.686, 0.67)},
}
MISSING = "–"


# ---------------------------------------------------------------------------------------------
# Number formats (paper: ACC 0.644, % RAG 64%; latency in seconds to 3 significant digits)
# ---------------------------------------------------------------------------------------------

def number(v: Any) -> float | None:
    """None for absent, null or NaN (json.dump writes NaN for an empty split's mean)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def fmt_acc(v: Any) -> str:
    return MISSING if (x := number(v)) is None else f"{x:.3f}"


def fmt_pct(v: Any) -> str:
    return MISSING if (x := number(v)) is None else f"{100 * x:.0f}%"


def fmt_latency(v: Any) -> str:
    # Fixed-point with 3 significant digits ("0.0123", "1.50", "123"): `:.3g` would drop trailing
    # zeros and switch to exponents past 999 s.
    if (x := number(v)) is None:
        return MISSING
    if x == 0 or math.isinf(x):
        return f"{x:.2f}"
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def fmt_delta(v: Any, pct: bool = False) -> str:
    if (x := number(v)) is None:
        return MISSING
    return f"{100 * x:+.0f} pp" if pct else f"{x:+.3f}"


def fmt_ci(v: Any) -> str:
    """" [lo, hi]" after a value, or nothing when absent."""
    if not isinstance(v, (list, tuple)) or len(v) != 2 or any(number(x) is None for x in v):
        return ""
    return f" [{v[0]:.3f}, {v[1]:.3f}]"


def method_order(keys) -> list[str]:
    """Known methods in display order, then any unknown key (a new policy) so nothing is hidden."""
    keys = set(keys)
    return [m for m in METHODS if m in keys] + sorted(keys - set(METHODS))


def display_name(method: str) -> str:
    return METHODS.get(method, method)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    sep = [":---"] + ["---:"] * (len(header) - 1)  # names left, numbers right, as in the paper
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, sep, *rows]) + "\n"


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def table1(results: dict) -> str:
    """Rows = methods, columns = ACC and % RAG per dataset, then average ACC, % RAG, latency."""
    datasets, average = results.get("datasets") or {}, results.get("average") or {}
    methods = method_order({m for d in datasets.values() for m in d} | set(average))
    if not methods:
        return ""
    header = ["Method"] + [f"{d} {c}" for d in datasets for c in ("ACC", "% RAG")]
    header += ["Average ACC", "Average % RAG", "Latency / item (s)"]
    rows = []
    for m in methods:
        row = [display_name(m)]
        for d in datasets.values():
            e = d.get(m) or {}
            row += [fmt_acc(e.get("acc")), fmt_pct(e.get("rag_frac"))]
        e = average.get(m) or {}
        rows.append(row + [fmt_acc(e.get("acc")) + fmt_ci(e.get("acc_ci95")), fmt_pct(e.get("rag_frac")),
                           fmt_latency(e.get("latency_s"))])
    return _table(header, rows)


# The path each method's source selection is judged against (the model's other source): every
# SR-RAG-model method chooses between retrieval and verbalization; Selective RAG's model has no
# <Self> source, so its labels are "retrieval vs no knowledge", another label set than SR-RAG's.
OTHER_PATH = {"selective_rag": "no knowledge"}
VERBALIZATION = "verbalization"


def table2(results: dict) -> str:
    """Source selection per dataset and averaged (paper Table 2): ACC counts a decision as right
    when it does not harm (keep the other path iff other >= ret., retrieve iff ret. >= other; ties
    right either way); AUROC ranks the method's score against "retrieval strictly better". The
    other path is the method's own (`OTHER_PATH`), so each label set gets its own table: Selective
    RAG's AUROC ranks other labels than SR-RAG's and is never shown in SR-RAG's column."""
    sel = {m: e for m, e in (results.get("source_selection") or {}).items() if e}
    if not sel:
        return ""
    names = list(dict.fromkeys(n for e in sel.values() for n in (e.get("per_dataset") or {})))
    by_labels: dict[str, list[str]] = {}
    for m in method_order(sel):
        by_labels.setdefault(OTHER_PATH.get(m, VERBALIZATION), []).append(m)
    out = []
    for key, title in (("acc_verb_ge_ret", "Accuracy ({other} ≥ retrieval)"),
                       ("auroc_ret_gt_verb", "AUROC (retrieval > {other})")):
        for other in sorted(by_labels, key=lambda o: o != VERBALIZATION):
            rows = [[display_name(m)] + [fmt_acc(((sel[m].get("per_dataset") or {}).get(n) or {}).get(key))
                                         for n in names] + [fmt_acc(sel[m].get(key))] for m in by_labels[other]]
            out.append(f"{title.format(other=other)}\n\n" + _table(["Method", *names, "Average"], rows))
    left = {m: e["auroc_left_out"] for m, e in sel.items() if e.get("auroc_left_out")}
    if left:
        out.append("AUROC averages leave out datasets where one class is absent: "
                   + "; ".join(f"{display_name(m)}: {', '.join(v)}" for m, v in left.items()) + ".\n")
    return "\n".join(out)


def comparisons_table(results: dict) -> str:
    """The paper's claims as paired differences with 95% bootstrap intervals."""
    rows = []
    for section, what in (("comparisons", "average ACC"), ("source_selection_comparisons", "average AUROC")):
        for key, e in (results.get(section) or {}).items():
            a, b = key.split(" - ")
            verdict = "yes" if e.get("significant") else "no (inside the noise)"
            rows.append([f"{display_name(a)} − {display_name(b)}", what, fmt_delta(e.get("diff")),
                         fmt_ci(e.get("ci95")).strip(), verdict])
    return _table(["Difference", "of", "Δ", "95% CI (paired bootstrap)", "excludes 0"], rows) if rows else ""


def latency_table(results: dict) -> str:
    """Latency measured in real routed batches (App. B.2), every method on the same questions in
    the same batches, with each phase's mean per item and how often the routed run reproduced the
    harness's decisions and answers."""
    lat = results.get("latency") or {}
    which = (results.get("config") or {}).get("latency_questions")
    rows = [[display_name(m), fmt_latency(e.get("latency_s"))] + [fmt_latency((e.get("phases") or {}).get(p))
                                                           for p in ("T_d", "T_v", "T_r", "T_g")]
            + [fmt_pct(e.get("rag_frac")), fmt_pct(e.get("decisions_equal_harness")),
               fmt_pct(e.get("answers_equal_harness")), str(e.get("n", MISSING))]
            for m, e in ((m, lat[m]) for m in method_order(lat))]
    header = ["Method", "Latency / item (s)", "T_d", "T_v", "T_r", "T_g", "% RAG", "same decision", "same answer", "n"]
    if not rows:
        return ""
    return (f"Every method timed the same way: {which}.\n\n" if which else "") + _table(header, rows)


def training_table(results: dict) -> str:
    """Each fine-tuned model's training stages as run (`config.training`): Selective RAG gets
    the same second stage as SR-RAG (data, steps, lr, schedule) on its own stage-1 loss."""
    training = (results.get("config") or {}).get("training") or {}
    rows = [[display_name(m), st.get("name", MISSING), st.get("objective", MISSING), str(st.get("epochs", MISSING)),
             str(st.get("steps") if st.get("steps") is not None else MISSING), f"{st.get('lr', float('nan')):.3g}"]
            for m in method_order(training) for st in (training[m] or {}).get("stages", [])]
    if not rows:
        return ""
    note = ("Selective RAG gets the same second stage as SR-RAG (stage 2's data, epochs, learning rate and "
            "schedule) on its own objective, the stage-1 loss, as the paper's w/o DPO keeps it, so SR-RAG − "
            "Selective RAG does not count extra answer training.\n\n")
    return note + _table(["Model", "stage", "objective", "epochs", "steps", "lr"], rows)


def chosen_on_validation(results: dict) -> str:
    """Selective RAG at SR-RAG's % retrieval, its threshold chosen on the validation split."""
    e = results.get("selective_rag_at_srrag_retrieval") or {}
    if number(e.get("acc")) is None:
        return ""
    return (f"Selective RAG at SR-RAG's % retrieval (threshold {e['threshold']:.4g} chosen on the validation split, "
            f"where SR-RAG retrieves {fmt_pct(e.get('srrag_rag_frac_validation'))} and Selective RAG "
            f"{fmt_pct(e.get('rag_frac_validation'))}): test ACC {fmt_acc(e['acc'])} at {fmt_pct(e.get('rag_frac'))} "
            "retrieval.\n")


def kind_table(results: dict) -> str:
    """The embedded world: ACC (% RAG) per dataset and question kind, with each method's two
    paths' own accuracies (retrieval / the other path), so a gain can be traced to its questions."""
    kinds = results.get("by_kind") or {}
    rows = [[display_name(m), key, str(e["n"]), f"{fmt_acc(e['acc'])} ({fmt_pct(e['rag_frac'])})",
             fmt_acc(e["acc_retrieval"]), fmt_acc(e["acc_other"])]
            for m in method_order(kinds) for key, e in kinds[m].items()]
    header = ["Method", "dataset/kind", "n", "ACC (% RAG)", "retrieval path", "other path"]
    return _table(header, rows) if rows else ""


def world_scope(results: dict) -> str:
    """What a run on the embedded world can and cannot show (docs/embedded-world.md)."""
    if not results.get("by_kind"):
        return ""
    return ("This run is on the embedded world, a generated world whose mechanisms (chain questions usable "
            "only after verbalizing, misleading passages, rules only its corpus states) are built so that "
            "verbalize-then-answer can help, by a generator that was revised after held-out results had left a "
            "claim unshown (results/embedded/HISTORY.md). The paper's qualitative pattern here checks the "
            "implementation, not the method. One run's intervals resample its test questions, not its "
            "training: compare recipes over world seeds written down before they run "
            "(`python -m jaxrag.eval.seeds`); the tiny recipe's confirmatory pool of six such seeds is "
            "results/embedded/world-v7-fair.\n")


def paper_table(results: dict) -> str:
    """Real models: the paper's Table 1 averages for the same family beside ours."""
    model = (results.get("config") or {}).get("model") or {}
    paper = PAPER_TABLE1.get(model.get("family")) if model.get("path") else None
    avg = results.get("average") or {}
    rows = [[display_name(m), fmt_acc(acc), fmt_pct(rag), fmt_acc((avg.get(m) or {}).get("acc")),
             fmt_pct((avg.get(m) or {}).get("rag_frac"))] for m, (acc, rag) in (paper or {}).items()]
    return _table(["Method", "paper ACC", "paper % RAG", "ours ACC", "ours % RAG"], rows) if rows else ""


def data_table(results: dict) -> str:
    counts = (results.get("config") or {}).get("data_counts") or {}
    rows = [[n, *(str(c.get(s, MISSING)) for s in ("train", "validation", "test"))] for n, c in counts.items()]
    return _table(["Dataset", "train", "validation", "test"], rows) if rows else ""


def code_name(code: dict | None) -> str:
    """One code record (`results.json`'s `code`, a workdir's `W/inputs/<stage>.json`) in a few
    characters: the short commit, "+dirty" when tracked files differed from it, else the installed
    version; "unknown" for a stage made before records named their code."""
    if not code:
        return "unknown"
    if code.get("commit"):
        return code["commit"][:10] + ("+dirty" if code.get("dirty") else "")
    return f"jaxrag {code.get('jaxrag') or '?'} (no git checkout)"


def code_text(results: dict) -> str:
    """The code the run ran: eval's commit and library versions, and each stage's commit when any
    differs from eval's (a workdir whose stages ran across commits)."""
    code = results.get("code")
    if not code:
        return "Code: not recorded (results.json made before runs named their code).\n"
    text = (f"Code: {code_name(code)}; jax {code.get('jax')}, flax {code.get('flax')}, "
            f"transformers {code.get('transformers')}.")
    stages = code.get("stages") or {}
    if any(code_name(c) != code_name(code) for c in stages.values()):
        text += " Stages ran across commits: " + ", ".join(f"{s} {code_name(c)}" for s, c in stages.items()) + "."
    return text + "\n"


def protocol_text(results: dict) -> str:
    config = results.get("config") or {}
    th = config.get("thresholds") or {}
    if not th:
        return ""
    shown = ", ".join(f"{k} {v:.4g}" for k, v in th.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    text = (f"Thresholds: **{th.get('protocol', '?')}** protocol ({shown}). Intervals: 95% percentile bootstrap "
            "over test questions, stratified by dataset; differences are paired.")
    if config.get("paper_version"):
        text += f" Paper: {config['paper_version']}."
    return text + "\n"


def table3(results: dict) -> str:
    """SR-RAG against its ablations on the average: ACC, % RAG and each one's change from SR-RAG
    (from the unrounded values, so a delta may differ by 0.001 from the shown cells' difference)."""
    average = results.get("average") or {}
    present = [m for m in ("srrag", *ABLATIONS) if m in average]
    if not any(m in average for m in ABLATIONS):
        return ""
    ref = average.get("srrag") or {}

    def delta(e: dict, key: str):
        a, b = number(e.get(key)), number(ref.get(key))
        return None if a is None or b is None else a - b

    rows = []
    for m in present:
        e = average[m] or {}
        is_ref = m == "srrag"
        rows.append([display_name(m), fmt_acc(e.get("acc")), "ref" if is_ref else fmt_delta(delta(e, "acc")),
                     fmt_pct(e.get("rag_frac")), "ref" if is_ref else fmt_delta(delta(e, "rag_frac"), pct=True)])
    return _table(["Method", "Average ACC", "Δ ACC", "Average % RAG", "Δ % RAG"], rows)


def construct_table(results: dict) -> str:
    """The construct stage's own markdown when it ships one; else % Self and flips per dataset."""
    con = results.get("construct") or {}
    if isinstance(con.get("table"), str) and con["table"].strip():
        return con["table"].rstrip("\n") + "\n"
    per = con.get("datasets") or {}
    cell = lambda v: MISSING if (x := number(v)) is None else f"{x:.1f}"
    rows = [[name, cell(e.get("self_pct")), cell(e.get("flip_pct"))] for name, e in per.items()]
    return _table(["Dataset", "% Self (Table 5)", "% flip (Fig. 3)"], rows) if rows else ""


def config_block(config: dict, width: int = 100) -> str:
    """Dotted `key = value` lines, long values cut, so the config stays a glance, not a page."""
    lines = []

    def walk(prefix: str, v: Any):
        if isinstance(v, dict) and v:
            for k, sub in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), sub)
            return
        text = json.dumps(v, default=str, ensure_ascii=False)
        lines.append(f"{prefix} = {text if len(text) <= width else text[:width - 1] + '…'}")

    for k, v in config.items():
        walk(str(k), v)
    return "```\n" + "\n".join(lines) + "\n```\n" if lines else ""


def render_report(results: dict, images: Sequence[str] = ()) -> str:
    """report.md as a string. `images`: paths relative to the report to embed (see write_report)."""
    avg = results.get("average") or {}
    out = ["# jaxrag evaluation report\n"]
    sr, ar = avg.get("srrag") or {}, avg.get("srrag_always_rag") or {}
    if number(sr.get("acc")) is not None and number(ar.get("acc")) is not None:
        out.append(f"SR-RAG: average ACC {fmt_acc(sr['acc'])} at {fmt_pct(sr.get('rag_frac'))} RAG, "
                   f"against {fmt_acc(ar['acc'])} for the same fine-tuned model always retrieving.\n")
    out.append(code_text(results))
    if text := protocol_text(results):
        out.append(text)
    sections = [
        ("Table 1: answer accuracy and % retrieval", table1(results)),
        ("The paper's claims: paired differences", comparisons_table(results)),
        ("Beside the paper's Table 1 (average over the four sets)", paper_table(results)),
        ("Table 2: source selection", table2(results)),
        ("Table 3: ablations (average over datasets)", table3(results)),
        ("Selective RAG at SR-RAG's % retrieval", chosen_on_validation(results)),
        ("Training stages as run", training_table(results)),
        ("Latency, measured in routed batches (App. B.2)", latency_table(results)),
        ("By question kind (embedded world)", kind_table(results)),
        ("What the embedded world can show", world_scope(results)),
        ("Data", data_table(results)),
        ("Training data construction", construct_table(results)),
    ]
    out += [f"## {title}\n\n{body}" for title, body in sections if body]
    if images:
        # The curves sweep each threshold on the test split itself: they show the trade-off, while
        # the tables' operating points use the configured thresholds.
        out.append("## Plots\n\nAccuracy against % retrieval: threshold sweeps on the test split itself (post hoc, "
                   "for illustration only). Figure 4 (latency-accuracy): SR-RAG routed for real on the test "
                   "questions at thresholds chosen on the validation split.\n\n"
                   + "\n\n".join(f"![{Path(p).stem}]({p})" for p in images) + "\n")
    if body := config_block(results.get("config") or {}):
        out.append(f"## Config\n\n{body}")
    return "\n".join(out)
