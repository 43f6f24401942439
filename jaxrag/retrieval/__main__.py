"""`python -m jaxrag.retrieval build|build-dpr|search|chunk`: passage indexes from the shell.

    build     --corpus psgs.jsonl --out runs/index [--encoder DIR]       encode + index a corpus
    build-dpr --embeddings 'wikipedia_passages_*.pkl' --corpus psgs_w100.tsv --out runs/wiki
    search    --index runs/index [--encoder DIR] -k 5 "who wrote hamlet?"
    chunk     docs.jsonl passages.jsonl [--words 100]                     100-word passages
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxrag.errors import exit_code
from jaxrag.models.encoder_io import load_encoder
from jaxrag.retrieval.corpus import chunk_documents, read_corpus, write_jsonl_corpus
from jaxrag.retrieval.index import IndexParams, VectorIndex
from jaxrag.retrieval.retriever import Retriever, build_dpr_index, build_passage_index


def _params(args, auto_storage: str = "auto"):
    storage = auto_storage if args.storage == "auto" else args.storage
    return IndexParams(exact_below=args.exact_below, storage=storage)


def build(args) -> None:
    index = build_passage_index(args.corpus, args.out, load_encoder(args.encoder), params=_params(args),
                                batch_size=args.batch_size, overwrite=args.overwrite)
    print(f"{index.path}: {index.count} passages, {index.meta.kind} search")


def build_dpr(args) -> None:
    index = build_dpr_index(args.embeddings, args.corpus, args.out, params=_params(args, "float16"),
                            overwrite=args.overwrite)
    print(f"{index.path}: {index.count} passages, {index.meta.kind} search")


def search(args) -> None:
    retriever = Retriever(VectorIndex(args.index), load_encoder(args.encoder))
    for question, hits in zip(args.questions, retriever.search(args.questions, args.k)):
        for rank, (p, score) in enumerate(hits, start=1):
            print(json.dumps({"question": question, "rank": rank, "score": round(score, 4), "id": p.id,
                              "title": p.title, "text": p.text}, ensure_ascii=False))


def chunk(args) -> None:
    n = write_jsonl_corpus(chunk_documents(read_corpus(args.documents), args.words), args.out)
    print(f"{args.out}: {n} passages of <= {args.words} words")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxrag.retrieval", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="encode a corpus and index it")
    b.add_argument("--corpus", required=True)
    b.add_argument("--encoder", help="encoder directory (default: all-MiniLM-L6-v2)")
    b.add_argument("--batch-size", type=int, default=64)
    d = sub.add_parser("build-dpr", help="index DPR's precomputed Wikipedia embeddings")
    d.add_argument("--embeddings", required=True, help="glob or directory of wikipedia_passages_*.pkl")
    d.add_argument("--corpus", required=True, help="psgs_w100.tsv (uncompressed)")
    for sp in (b, d):
        sp.add_argument("--out", required=True)
        sp.add_argument("--exact-below", type=int, default=20_000, help="brute force below this many rows")
        sp.add_argument("--storage", default="auto", choices=("auto", "float32", "float16"))
        sp.add_argument("--overwrite", action="store_true")
    b.set_defaults(func=build)
    d.set_defaults(func=build_dpr)
    s = sub.add_parser("search", help="top-k passages for questions")
    s.add_argument("--index", required=True)
    s.add_argument("--encoder", help="query encoder directory (default: all-MiniLM-L6-v2)")
    s.add_argument("-k", type=int, default=5)
    s.add_argument("questions", nargs="+")
    s.set_defaults(func=search)
    c = sub.add_parser("chunk", help="split documents into passages")
    c.add_argument("documents")
    c.add_argument("out")
    c.add_argument("--words", type=int, default=100)
    c.set_defaults(func=chunk)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return exit_code(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
