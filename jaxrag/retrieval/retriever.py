"""Passage retrieval: build an index from a corpus (encoding it, or from DPR's released
embeddings) and search it with questions.

    index = build_passage_index("psgs.jsonl", "runs/index", load_encoder())
    hits = Retriever(VectorIndex("runs/index"), load_encoder()).search(["who wrote Hamlet?"], k=5)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

from jaxrag.errors import JaxragError
from jaxrag.models.encoder_io import TextEncoder, load_encoder
from jaxrag.retrieval.corpus import Passage, is_int_id, read_corpus_rows
from jaxrag.retrieval.dpr import DPR_CTX_ENCODER, read_dpr_embeddings
from jaxrag.retrieval.index import IndexParams, VectorIndex
from jaxrag.retrieval.writer import IndexWriter


class Hit(NamedTuple):
    passage: Passage
    score: float


def _batches(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch


def build_passage_index(corpus: str | os.PathLike, out: str | os.PathLike, encoder: TextEncoder, *,
                        params: IndexParams = IndexParams(), batch_size: int = 64, chunk: int = 8192,
                        expected_rows: int | None = None, overwrite: bool = False,
                        progress: bool = True) -> VectorIndex:
    """Streams a DPR TSV / JSONL corpus through `encoder` into an index at `out`. Rows keep the
    byte offset of their corpus line, so `index.passages(rows)` reads text back on demand."""
    with IndexWriter(out, dim=encoder.dim, encoder=encoder.name, params=params, corpus=corpus,
                     expected_rows=expected_rows, overwrite=overwrite, progress=progress) as writer:
        for batch in _batches(read_corpus_rows(corpus), chunk):
            passages = [p for p, _ in batch]
            vectors = encoder.encode_passages([p.title for p in passages], [p.text for p in passages],
                                              batch_size=batch_size)
            writer.add([p.id for p in passages], vectors, [o for _, o in batch])
        return writer.finish()


class CorpusOffsets:
    """Passage id -> byte offset of its line, for aligning precomputed embeddings with a corpus.
    Integer ids (DPR's 1..21M) live in one int64 array; other ids in a dict."""

    def __init__(self, corpus: str | os.PathLike, progress: bool = True):
        self.corpus, self._other = corpus, {}
        self._by_int = np.full(1 << 20, -1, np.int64)  # grows by doubling; no 21M-entry dict
        for p, offset in tqdm(read_corpus_rows(corpus), desc="scan corpus", unit="passage", disable=not progress):
            if not is_int_id(p.id):
                self._other[p.id] = offset
                continue
            i = int(p.id)
            if i >= len(self._by_int):
                grown = np.full(max(i + 1, 2 * len(self._by_int)), -1, np.int64)
                grown[: len(self._by_int)] = self._by_int
                self._by_int = grown
            self._by_int[i] = offset

    def lookup(self, ids: Sequence[str], where: str) -> np.ndarray:
        out = np.empty(len(ids), np.int64)
        for j, i in enumerate(ids):
            if is_int_id(i) and int(i) < len(self._by_int):
                out[j] = self._by_int[int(i)]
            else:
                out[j] = self._other.get(i, -1)
            if out[j] < 0:
                raise JaxragError(f"{where}: passage id {i!r} is not in corpus {self.corpus}")
        return out


def build_dpr_index(embeddings, corpus: str | os.PathLike, out: str | os.PathLike, *,
                    encoder: str = DPR_CTX_ENCODER, params: IndexParams = IndexParams(storage="float16"),
                    expected_rows: int | None = None, overwrite: bool = False,
                    progress: bool = True) -> VectorIndex:
    """DPR's released `wikipedia_passages_*.pkl` shards + `psgs_w100.tsv` -> an index, one shard
    in memory at a time (vectors stored float16: 21M x 768 = 32 GB on disk)."""
    offsets = CorpusOffsets(corpus, progress)
    shards = read_dpr_embeddings(embeddings)
    first = next(shards)  # dpr_embedding_files already refused an empty match
    with IndexWriter(out, dim=first[1].shape[1], encoder=encoder, params=params, corpus=corpus,
                     expected_rows=expected_rows, overwrite=overwrite, progress=progress) as writer:
        for number, (ids, vectors) in enumerate(itertools.chain([first], shards)):
            writer.add(ids, vectors, offsets.lookup(ids, f"embedding shard {number}"))
        return writer.finish()


def passage_encoder_for(query_encoder: str | os.PathLike | None) -> str | None:
    """DPR pairs a question encoder with a context encoder (same name, `ctx_encoder`);
    symmetric encoders (all-MiniLM-L6-v2) embed questions and passages alike."""
    return None if query_encoder is None else str(query_encoder).replace("question_encoder", "ctx_encoder")


def build_corpus_index(corpus: str | os.PathLike, out: str | os.PathLike, *, encoder=None, passage_encoder=None,
                       passage_embeddings=None, params: IndexParams | None = None, overwrite: bool = False,
                       progress: bool = True) -> VectorIndex:
    """The pipeline's `index` stage. `encoder` is the query encoder (directory, cached hub id, or
    None/"minilm"); passages are embedded by `passage_encoder` (default: its DPR context twin),
    or taken from DPR's precomputed `passage_embeddings` shards when given."""
    passage_encoder = passage_encoder or passage_encoder_for(encoder)
    if passage_embeddings:
        return build_dpr_index(passage_embeddings, corpus, out, encoder=str(passage_encoder or DPR_CTX_ENCODER),
                               params=params or IndexParams(storage="float16"), overwrite=overwrite,
                               progress=progress)
    return build_passage_index(corpus, out, load_encoder(passage_encoder), params=params or IndexParams(),
                               overwrite=overwrite, progress=progress)


class Retriever:
    """Question encoder + passage index. Refuses an index built in another embedding space."""

    def __init__(self, index: VectorIndex, encoder: TextEncoder):
        index.check_encoder(encoder.name)
        if encoder.dim != index.dim:
            raise JaxragError(f"{index.path}: {index.dim}-dim index, encoder {encoder.name!r} gives {encoder.dim} dims")
        self.index, self.encoder = index, encoder

    def search_rows(self, questions: Sequence[str], k: int = 5, *, batch_size: int = 64):
        """questions [b] -> SearchResult with scores/rows [b, k]."""
        return self.index.search(self.encoder.encode(questions, batch_size=batch_size), k)

    def search(self, questions: Sequence[str], k: int = 5, *, batch_size: int = 64) -> list[list[Hit]]:
        """questions [b] -> per question the top-k passages, best first."""
        result = self.search_rows(questions, k, batch_size=batch_size)
        passages = self.index.passages(result.rows)
        k_found = result.rows.shape[1]
        return [[Hit(passages[b * k_found + j], float(result.scores[b, j])) for j in range(k_found)]
                for b in range(len(questions))]

    def retrieve_texts(self, questions: Sequence[str], k: int = 5) -> list[list[str]]:
        """questions -> k passages each as prompt lines; fits `decode.routing.Retrieve`."""
        return [[h.passage.to_prompt() for h in hits] for hits in self.search(questions, k)]

    @classmethod
    def load(cls, index: str | os.PathLike, encoder: str | os.PathLike | None = None) -> Retriever:
        """Index directory + query encoder (directory, cached hub id, or None for MiniLM)."""
        return cls(VectorIndex(index), load_encoder(encoder))
