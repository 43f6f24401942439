"""Retrieval: passage corpora, one vector index (exact on device / ScaNN), the policy datastore."""

from jaxrag.retrieval.corpus import (Passage, PassageStore, chunk_documents, chunk_words, read_corpus,
                                     read_corpus_rows, write_jsonl_corpus)
from jaxrag.retrieval.datastore import (DEFAULT_K, DEFAULT_SOURCES, Entry, Neighbours, PolicyDatastore,
                                        build_datastore, knn_policy, label_distribution, write_datastore)
from jaxrag.retrieval.dpr import read_dpr_embeddings, read_dpr_shard
from jaxrag.retrieval.index import IndexMeta, IndexParams, SearchResult, VectorIndex, exact_search
from jaxrag.retrieval.retriever import (Hit, Retriever, build_corpus_index, build_dpr_index, build_passage_index,
                                        passage_encoder_for)
from jaxrag.retrieval.writer import IndexWriter, build_index

__all__ = [
    "DEFAULT_K", "DEFAULT_SOURCES", "Entry", "Hit", "IndexMeta", "IndexParams", "IndexWriter", "Neighbours",
    "Passage", "PassageStore", "PolicyDatastore", "Retriever", "SearchResult", "VectorIndex",
    "build_corpus_index", "build_datastore", "build_dpr_index", "build_index", "build_passage_index",
    "chunk_documents", "chunk_words", "exact_search", "knn_policy", "label_distribution",
    "passage_encoder_for", "read_corpus", "read_corpus_rows", "read_dpr_embeddings", "read_dpr_shard",
    "write_datastore", "write_jsonl_corpus",
]
