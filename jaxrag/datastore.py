"""`python -m jaxrag.datastore inspect|audit|add|remove|relabel`: audit and edit a policy datastore.

    inspect DIR [--source wiki] [--grep paris] [--limit 20] [--json]
    inspect DIR --neighbours QID [-k 30]     # why would a question like QID route where it does?
    audit DIR [-k 30] [--json]               # do neighbours share a preferred source? (leave-one-out)
    add DIR --from OTHER_DATASTORE_DIR | keys.npz [--replace]
    remove DIR QID [QID ...] [--ids-file FILE]
    relabel DIR QID [QID ...] --source self

An `.npz` to add holds `keys` [n, d], `sources` [n], `question_ids` [n] and `questions` [n].
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from jaxrag.errors import JaxragError, exit_code
from jaxrag.eval.metrics import auroc
from jaxrag.retrieval.datastore import DEFAULT_K, PolicyDatastore


def _print_summary(ds: PolicyDatastore) -> None:
    s = ds.summary()
    total = max(s["entries"], 1)
    sources = ", ".join(f"{name} {n} ({n / total:.1%})" for name, n in s["sources"].items())
    print(f"{s['path']}: {s['entries']} entries, model {s['model']}, {s['dim']}-dim keys, "
          f"{s['search']} search; sources: {sources}")


def _entry_line(e, extra: str = "") -> str:
    return f"{e.question_id}\t{e.source}\t{extra}{e.question}"


def inspect(args) -> None:
    ds = PolicyDatastore(args.datastore)
    if args.neighbours:
        return _inspect_neighbours(ds, args)
    rows = [e for e in ds.entries if (not args.source or e.source == args.source)
            and (not args.grep or args.grep.lower() in e.question.lower())]
    if args.source and args.source not in ds.sources:
        raise JaxragError(f"unknown source {args.source!r}; this datastore has {list(ds.sources)}")
    if args.json:
        for e in rows[: args.limit]:
            print(json.dumps(e._asdict(), ensure_ascii=False))
        return
    _print_summary(ds)
    print(f"{len(rows)} matching entries" + (f", first {args.limit}:" if len(rows) > args.limit else ":"))
    for e in rows[: args.limit]:
        print(_entry_line(e))


def _inspect_neighbours(ds: PolicyDatastore, args) -> None:
    row = ds.row_of(args.neighbours)
    found = ds.search(ds.keys([row]), args.k)
    dist = {s: float((found.labels[0] == i).mean()) for i, s in enumerate(ds.sources)}
    e = ds.entries[row]
    print(f"{e.question_id} [{e.source}] {e.question}")
    print("p_D: " + ", ".join(f"{s} {p:.2f}" for s, p in dist.items()) + f" over k={found.rows.shape[1]}")
    for r, score in zip(found.rows[0], found.scores[0]):
        print(_entry_line(ds.entries[r], f"{score:.3f}\t"))


def _group(question_id: str) -> str:
    """The dataset of a pipeline question id (`nq-train-00012` -> `nq`)."""
    return question_id.split("-")[0] if "-" in question_id else "(all)"


def audit_table(ds: PolicyDatastore, k: int) -> dict:
    """Leave-one-out p_D of every entry against its own label, per dataset and pooled: AUROC of
    p_D(positive source) and the share whose neighbours' majority is its own label. Within a
    dataset, an AUROC near 0.5 says the neighbours carry no more than that dataset's prior (which
    p_M learns in training as well); pooled, `prior_auroc` scores each entry by its dataset's
    leave-one-out share alone, for comparison."""
    positive = "wiki" if "wiki" in ds.sources else ds.sources[0]
    p_d = ds.leave_one_out(k)
    p = p_d[:, ds.sources.index(positive)]
    y = (ds.labels == ds.sources.index(positive)).astype(int)
    agree = p_d.argmax(1) == ds.labels
    groups = np.array([_group(e.question_id) for e in ds.entries])

    def roc(labels, scores):  # None (JSON null) where a dataset has one class only
        a = auroc(labels.tolist(), scores.tolist())
        return None if np.isnan(a) else a

    def row(m):
        return {"n": int(m.sum()), "share": float(y[m].mean()), "auroc": roc(y[m], p[m]),
                "agreement": float(agree[m].mean())}

    prior = np.array([(y[groups == g].sum() - y[i]) / max((groups == g).sum() - 1, 1) for i, g in enumerate(groups)])
    pooled = row(np.ones(len(y), bool)) | {"prior_auroc": roc(y, prior)}
    return {"k": min(k, len(ds) - 1), "positive": positive,
            "datasets": {g: row(groups == g) for g in sorted(set(groups))}, "all": pooled}


def audit(args) -> None:
    ds = PolicyDatastore(args.datastore)
    table = audit_table(ds, args.k)
    if args.json:
        print(json.dumps(table))
        return
    _print_summary(ds)
    pos = table["positive"]
    print(f"leave-one-out over k={table['k']} neighbours; AUROC of p_D({pos}) for label {pos}:")
    print(f"{'dataset':<16}{'n':>6}{f'% {pos}':>9}{'AUROC':>8}{'majority = own label':>22}")
    for name, r in [*table["datasets"].items(), ("all", table["all"])]:
        print(f"{name:<16}{r['n']:>6}{r['share']:>9.1%}{_auroc_cell(r['auroc']):>8}{r['agreement']:>22.1%}")
    print(f"pooled AUROC from each dataset's share alone: {_auroc_cell(table['all']['prior_auroc'])} "
          "(–: one class only)")


def _auroc_cell(a: float | None) -> str:
    return "–" if a is None else f"{a:.3f}"


def _load_additions(path: Path) -> tuple[np.ndarray, list, list, list]:
    if path.is_dir():
        other = PolicyDatastore(path)
        es = other.entries
        return other.keys(), [e.source for e in es], [e.question_id for e in es], [e.question for e in es]
    try:
        with np.load(path, allow_pickle=False) as z:
            return z["keys"], *(list(map(str, z[name])) for name in ("sources", "question_ids", "questions"))
    except (OSError, ValueError, KeyError) as e:
        raise JaxragError(f"{path}: need a datastore directory or an .npz with keys, sources, "
                          f"question_ids, questions ({e})") from e


def add(args) -> None:
    ds = PolicyDatastore(args.datastore)
    keys, sources, qids, questions = _load_additions(Path(args.source_path))
    before = len(ds)
    ds = ds.add(keys, sources, qids, questions, replace=args.replace)
    print(f"added {len(qids)} entries ({len(ds) - before} new)")
    _print_summary(ds)


def _ids(args) -> list[str]:
    ids = list(args.ids)
    if args.ids_file:
        ids += [line.strip() for line in Path(args.ids_file).read_text().splitlines() if line.strip()]
    if not ids:
        raise JaxragError("no question ids given")
    return ids


def remove(args) -> None:
    ids = _ids(args)
    ds = PolicyDatastore(args.datastore).remove(ids)
    print(f"removed {len(set(ids))} entries")
    _print_summary(ds)


def relabel(args) -> None:
    ds = PolicyDatastore(args.datastore)
    if args.source not in ds.sources:
        raise JaxragError(f"unknown source {args.source!r}; this datastore has {list(ds.sources)}")
    ids = _ids(args)
    ds = ds.relabel(ids, args.source)
    print(f"relabelled {len(set(ids))} entries as {args.source}")
    _print_summary(ds)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxrag.datastore", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="summary, entries, or the neighbours of one entry")
    i.add_argument("datastore")
    i.add_argument("--source", help="only entries labelled with this source")
    i.add_argument("--grep", help="only questions containing this text (case-insensitive)")
    i.add_argument("--limit", type=int, default=20)
    i.add_argument("--json", action="store_true", help="entries as JSON lines, no summary")
    i.add_argument("--neighbours", metavar="QID", help="show the k nearest entries of this entry")
    i.add_argument("-k", type=int, default=DEFAULT_K)
    i.set_defaults(func=inspect)
    u = sub.add_parser("audit", help="leave-one-out: does each entry's neighbourhood predict its label?")
    u.add_argument("datastore")
    u.add_argument("-k", type=int, default=DEFAULT_K)
    u.add_argument("--json", action="store_true", help="the table as one JSON object")
    u.set_defaults(func=audit)
    a = sub.add_parser("add", help="add entries from another datastore or an .npz")
    a.add_argument("datastore")
    a.add_argument("--from", dest="source_path", required=True)
    a.add_argument("--replace", action="store_true", help="replace entries whose question id exists")
    a.set_defaults(func=add)
    for name, func, helptext in (("remove", remove, "remove entries by question id"),
                                 ("relabel", relabel, "set the source label of entries")):
        r = sub.add_parser(name, help=helptext)
        r.add_argument("datastore")
        r.add_argument("ids", nargs="*", metavar="QID")
        r.add_argument("--ids-file", help="file with one question id per line")
        if name == "relabel":
            r.add_argument("--source", required=True)
        r.set_defaults(func=func)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return exit_code(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
