"""VectorIndex: exact vs ScaNN agreement, save/load, sharded float16 builds, passage retrieval, and
clear errors with nothing half-written."""

import json
import os
import pickle

import numpy as np
import pytest

from jaxrag.errors import JaxragError
from jaxrag.models.encoder_io import load_encoder
from jaxrag.retrieval.index import IndexParams, VectorIndex, exact_search
from jaxrag.retrieval.retriever import Retriever, build_corpus_index, build_dpr_index, build_passage_index
from jaxrag.retrieval.writer import IndexWriter, build_index


def clustered(n, dim=32, clusters=100, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    x = centres[rng.integers(0, clusters, n)] + 0.6 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def queries_near(x, count=200, seed=1):
    rng = np.random.default_rng(seed)
    q = x[rng.integers(0, len(x), count)] + 0.3 * rng.normal(size=(count, x.shape[1]))
    return q.astype(np.float32)


def recall(found, truth):
    return np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(found, truth)])


def ids_for(n):
    return [f"p{i}" for i in range(n)]


@pytest.fixture(scope="module")
def corpus_25k():
    return clustered(25_000)


def test_params_follow_corpus_size():
    p = IndexParams()
    assert p.derive(5_000, 384)["kind"] == "exact"
    big = p.derive(1_000_000, 384)
    assert big["kind"] == "scann" and big["num_leaves"] == 1000 and big["leaves_to_search"] == 100
    wiki = p.derive(21_015_324, 768)
    assert wiki["shards"] == 6 and abs(wiki["num_leaves"] - 1871) <= 1 and wiki["reorder"] == "memmap"
    assert p.storage_dtype(21_015_324, 768) == "float16" and p.storage_dtype(50_000, 768) == "float32"


def test_exact_search_matches_numpy_on_device_and_streamed():
    x, q = clustered(3_000, dim=16), queries_near(clustered(3_000, dim=16), 7)
    truth = np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :5]
    import jax.numpy as jnp

    on_device = exact_search(q, jnp.asarray(x), 5)
    streamed = exact_search(q, x, 5, chunk_rows=1024)  # 3 chunks, the last one padded
    for result in (on_device, streamed):
        np.testing.assert_array_equal(result.rows, truth)
        np.testing.assert_allclose(result.scores, np.take_along_axis(q @ x.T, truth, 1), rtol=1e-5)


def test_scann_agrees_with_exact_and_survives_reload(tmp_path, corpus_25k):
    index = build_index(tmp_path / "idx", corpus_25k, ids_for(len(corpus_25k)), encoder="test-enc")
    assert index.meta.kind == "scann" and index.meta.settings["reorder"] == "scann"
    q = queries_near(corpus_25k)
    exact, approx = index.search(q, 10, exact=True), index.search(q, 10)
    assert recall(approx.rows, exact.rows) >= 0.95
    again = VectorIndex.load(tmp_path / "idx")
    reloaded = again.search(q, 10)
    np.testing.assert_array_equal(reloaded.rows, approx.rows)
    np.testing.assert_array_equal(reloaded.scores, approx.scores)
    assert again.id_of(approx.rows[0, :2]) == [f"p{r}" for r in approx.rows[0, :2]]
    meta = json.loads((tmp_path / "idx" / "meta.json").read_text())
    assert (meta["encoder"], meta["dim"], meta["count"]) == ("test-enc", 32, 25_000)


def test_sharded_float16_memmap_build(tmp_path, corpus_25k):
    params = IndexParams(exact_below=1_000, shard_rows=10_000, storage="float16", reorder="memmap")
    index = build_index(tmp_path / "idx", corpus_25k, ids_for(len(corpus_25k)), encoder="e", params=params, chunk=4_096)
    assert index.meta.shard_rows == [8_333, 8_333, 8_334] and index.vectors.dtype == np.float16
    assert os.path.getsize(tmp_path / "idx" / "vectors.bin") == 25_000 * 32 * 2
    q = queries_near(corpus_25k)
    truth = np.argsort(-(q @ corpus_25k.T), axis=1)[:, :10]
    approx = index.search(q, 10)
    assert recall(approx.rows, truth) >= 0.95
    np.testing.assert_array_equal(VectorIndex(tmp_path / "idx").search(q, 10).rows, approx.rows)


def test_small_index_is_exact_and_caps_k(tmp_path):
    x = clustered(50, dim=8)
    index = build_index(tmp_path / "small", x, ids_for(50), encoder="e")
    assert index.meta.kind == "exact" and not (tmp_path / "small" / "scann").exists()
    result = index.search(x[3], 100)  # one query, k above the row count
    assert result.rows.shape == (1, 50) and result.rows[0, 0] == 3


def test_bad_queries(tmp_path):
    index = build_index(tmp_path / "i", clustered(100, dim=8), ids_for(100), encoder="facebook/dpr-ctx_encoder-x")
    with pytest.raises(JaxragError, match=r"queries must be \[batch, 8\]"):
        index.search(np.zeros((2, 9)), 3)
    with pytest.raises(JaxragError, match="NaN"):
        index.search(np.full((1, 8), np.nan), 3)
    with pytest.raises(JaxragError, match="k must be"):
        index.search(np.zeros((1, 8)), 0)
    with pytest.raises(JaxragError, match="built with encoder 'facebook/dpr-ctx_encoder-x'"):
        index.search(np.zeros((1, 8)), 3, encoder="sentence-transformers/all-MiniLM-L6-v2")
    index.search(np.zeros((1, 8)), 3, encoder="dpr-question_encoder-x")  # same embedding space


def test_interrupted_build_leaves_nothing_that_looks_complete(tmp_path):
    x = clustered(300, dim=8)

    def batches():
        yield ids_for(300)[:100], x[:100]
        raise KeyboardInterrupt  # e.g. Ctrl-C halfway through encoding

    with pytest.raises(KeyboardInterrupt):
        with IndexWriter(tmp_path / "idx", dim=8, encoder="e") as writer:
            for ids, vecs in batches():
                writer.add(ids, vecs)
            writer.finish()
    assert os.listdir(tmp_path) == []
    # A killed process leaves only DIR.partial, which never loads and the next build clears.
    writer = IndexWriter(tmp_path / "idx", dim=8, encoder="e")
    writer.add(ids_for(100), x[:100])
    with pytest.raises(JaxragError, match="interrupted build"):
        VectorIndex(writer.tmp)
    with pytest.raises(JaxragError, match="not found"):
        VectorIndex(tmp_path / "idx")
    index = build_index(tmp_path / "idx", x, ids_for(300), encoder="e")
    assert index.count == 300 and sorted(os.listdir(tmp_path)) == ["idx"]


def test_build_errors_are_clear_and_atomic(tmp_path):
    x = clustered(10, dim=4)
    with pytest.raises(JaxragError, match="nothing to index"):
        build_index(tmp_path / "empty", x[:0], [], encoder="e")
    with pytest.raises(JaxragError, match="duplicate id 'p1'"):
        build_index(tmp_path / "dup", x[:3], ["p0", "p1", "p1"], encoder="e")
    with pytest.raises(JaxragError, match=r"expected \[n, 4\]"):
        with IndexWriter(tmp_path / "shape", dim=4, encoder="e") as w:
            w.add(["a"], np.zeros((1, 5)))
    with pytest.raises(JaxragError, match="NaN"):
        build_index(tmp_path / "nan", np.full((2, 4), np.nan), ["a", "b"], encoder="e")
    assert os.listdir(tmp_path) == []
    build_index(tmp_path / "ok", x, ids_for(10), encoder="e")
    with pytest.raises(JaxragError, match="already exists"):
        build_index(tmp_path / "ok", x, ids_for(10), encoder="e")
    assert build_index(tmp_path / "ok", x[:5], ids_for(5), encoder="e", overwrite=True).count == 5
    with open(tmp_path / "ok" / "vectors.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(JaxragError, match="truncated"):
        VectorIndex(tmp_path / "ok")
    assert sorted(os.listdir(tmp_path)) == ["ok"]


PASSAGES = [
    ("paris", "Paris", "Paris is the capital and most populous city of France."),
    ("hamlet", "Hamlet", "Hamlet is a tragedy written by William Shakespeare around 1600."),
    ("cell", "Mitochondrion", "The mitochondrion is an organelle that produces energy for the cell."),
    ("everest", "Mount Everest", "Mount Everest is Earth's highest mountain above sea level."),
    ("python", "Python", "Python is a high-level general-purpose programming language."),
    ("jupiter", "Jupiter", "Jupiter is the largest planet in the Solar System."),
]


def test_passage_index_end_to_end_with_minilm(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "contents": f"{t}\n{x}"}) + "\n" for i, t, x in PASSAGES))
    encoder = load_encoder()
    build_passage_index(corpus, tmp_path / "idx", encoder, progress=False)
    retriever = Retriever(VectorIndex(tmp_path / "idx"), encoder)
    hits = retriever.search(["Who wrote Hamlet?", "What is the biggest planet?", "capital of France"], k=2)
    assert [h[0].passage.id for h in hits] == ["hamlet", "jupiter", "paris"]
    assert hits[0][0].passage.text == PASSAGES[1][2] and hits[0][0].score > hits[0][1].score
    with open(corpus, "a") as f:
        f.write(json.dumps({"id": "new", "contents": "x\ny"}) + "\n")
    with pytest.raises(JaxragError, match="changed since"):
        VectorIndex(tmp_path / "idx").passages([0])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(JaxragError, match="corpus has no passages"):
        build_passage_index(tmp_path / "empty.jsonl", tmp_path / "none", encoder, progress=False)
    assert not (tmp_path / "none").exists() and not (tmp_path / "none.partial").exists()


def test_dpr_precomputed_embeddings_index(tmp_path):
    tsv = tmp_path / "psgs_w100.tsv"
    tsv.write_text("id\ttext\ttitle\n" + "".join(f"{k + 1}\t{x}\t{t}\n" for k, (_, t, x) in enumerate(PASSAGES)))
    vectors = clustered(len(PASSAGES), dim=12, clusters=3)
    for shard, rows in enumerate((range(0, 4), range(4, 6))):
        with open(tmp_path / f"wikipedia_passages_{shard}.pkl", "wb") as f:
            pickle.dump([(f"wiki:{r + 1}", vectors[r]) for r in rows], f)
    index = build_dpr_index(str(tmp_path / "wikipedia_passages_*.pkl"), tsv, tmp_path / "wiki", progress=False)
    assert index.meta.storage == "float16" and index.meta.encoder == "facebook/dpr-ctx_encoder-single-nq-base"
    result = index.search(vectors[[5, 1]], 1)
    assert [p.title for p in index.passages(result.rows)] == ["Jupiter", "Hamlet"]
    with pytest.raises(JaxragError, match="different embedding space"):
        Retriever(index, load_encoder())
    with open(tmp_path / "wikipedia_passages_2.pkl", "wb") as f:
        pickle.dump([("99", vectors[0])], f)
    with pytest.raises(JaxragError, match="passage id '99' is not in corpus"):
        build_dpr_index(str(tmp_path / "wikipedia_passages_*.pkl"), tsv, tmp_path / "wiki2", progress=False)
    assert not (tmp_path / "wiki2").exists() and not (tmp_path / "wiki2.partial").exists()


def tiny_dpr_pair(tmp_path):
    """Random tiny DPR question + context encoders saved as `dpr-{question,ctx}_encoder-tiny`."""
    import torch
    import transformers

    vocab = tmp_path / "vocab.txt"
    words = {w.lower().strip(".,'") for _, t, x in PASSAGES for w in f"{t} {x}".split()}
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]) + "\n")
    tok = transformers.BertTokenizerFast(vocab_file=str(vocab))
    cfg = transformers.DPRConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, max_position_embeddings=128)
    dirs = []
    for kind, cls in (("question", transformers.DPRQuestionEncoder), ("ctx", transformers.DPRContextEncoder)):
        torch.manual_seed(0)
        out = tmp_path / f"dpr-{kind}_encoder-tiny"
        cls(cfg).save_pretrained(out)
        tok.save_pretrained(out)
        dirs.append(out)
    return dirs


def test_corpus_index_pairs_dpr_question_and_context_encoders(tmp_path):
    question_dir, ctx_dir = tiny_dpr_pair(tmp_path)
    tsv = tmp_path / "psgs.tsv"
    tsv.write_text("id\ttext\ttitle\n" + "".join(f"{k}\t{x}\t{t}\n" for k, (_, t, x) in enumerate(PASSAGES)))
    index = build_corpus_index(tsv, tmp_path / "idx", encoder=question_dir, progress=False)
    assert index.meta.encoder == ctx_dir.name and index.dim == 16  # passages went through the ctx encoder
    texts = Retriever.load(tmp_path / "idx", question_dir).retrieve_texts(["who wrote hamlet?", "paris"], k=3)
    assert len(texts) == 2 and all(len(t) == 3 for t in texts)
    assert {t for ts in texts for t in ts} <= {f"(Title: {t}) {x}" for _, t, x in PASSAGES}
    with pytest.raises(JaxragError, match="different embedding space"):
        Retriever.load(tmp_path / "idx", "minilm")
