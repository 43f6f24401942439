"""Corpus readers (DPR TSV, JSONL), chunking, random access, DPR embedding shards."""

import gzip
import json
import os
import pickle

import numpy as np
import pytest

from jaxrag.errors import JaxragError
from jaxrag.retrieval.corpus import (Passage, PassageStore, SeenIds, chunk_documents, chunk_words, read_corpus,
                                     read_corpus_rows, write_jsonl_corpus)
from jaxrag.retrieval.dpr import dpr_embedding_files, read_dpr_embeddings, read_dpr_shard

DPR_TSV = (
    "id\ttext\ttitle\n"
    '1\t"Aaron Aaron ( or ; ""Ahärôn"") is a prophet."\tAaron\n'
    "2\tPlain text without quotes.\tPlain\n"
    '3\tthird passage\t"""Weird Al"" Yankovic"\n'
)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_dpr_tsv_streams_passages_with_offsets(tmp_path):
    path = write(tmp_path / "psgs_w100.tsv", DPR_TSV)
    rows = list(read_corpus_rows(path))
    assert [p for p, _ in rows] == [
        Passage("1", "Aaron", 'Aaron Aaron ( or ; "Ahärôn") is a prophet.'),
        Passage("2", "Plain", "Plain text without quotes."),
        Passage("3", '"Weird Al" Yankovic', "third passage"),
    ]
    store = PassageStore(path, np.array([o for _, o in rows]))
    assert store.get([2, 0]) == [rows[2][0], rows[0][0]]


def test_tsv_header_order_and_gzip(tmp_path):
    path = tmp_path / "c.tsv.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("title\tid\ttext\nT\tx1\tsome text\n")
    assert list(read_corpus(path)) == [Passage("x1", "T", "some text")]
    with pytest.raises(JaxragError, match="decompress"):
        PassageStore(path, np.zeros(1, np.int64))


def test_jsonl_contents_and_title_text(tmp_path):
    path = write(tmp_path / "c.jsonl", "\n".join([
        json.dumps({"id": 7, "contents": "Paris\nParis is the capital of France."}),
        "",
        json.dumps({"id": "b", "title": "Hamlet", "text": "A tragedy."}),
        json.dumps({"id": "c", "contents": "only text"}),
    ]) + "\n")
    rows = list(read_corpus_rows(path))
    assert [p for p, _ in rows] == [Passage("7", "Paris", "Paris is the capital of France."),
                                    Passage("b", "Hamlet", "A tragedy."), Passage("c", "", "only text")]
    assert PassageStore(path, np.array([o for _, o in rows])).get([1])[0].title == "Hamlet"
    assert rows[0][0].contents == "Paris\nParis is the capital of France."


@pytest.mark.parametrize("name,text,message", [
    ("empty.tsv", "id\ttext\ttitle\n", "corpus has no passages"),
    ("empty.jsonl", "\n\n", "corpus has no passages"),
    ("notext.tsv", "id\ttext\ttitle\n1\tok\tT\n2\t  \tT\n", r"notext.tsv:3: passage '2' has no text"),
    ("notext.jsonl", '{"id": 1, "contents": "T\\n"}\n', r"notext.jsonl:1: passage '1' has no text"),
    ("nocontents.jsonl", '{"id": 1}\n', r"nocontents.jsonl:1: .*no `contents`"),
    ("dup.tsv", "id\ttext\ttitle\n1\ta\tT\n2\tb\tT\n1\tc\tT\n", r"dup.tsv:4: duplicate passage id '1'"),
    ("dup.jsonl", '{"id": "a", "contents": "t\\nx"}\n{"id": "a", "contents": "t\\ny"}\n',
     r"dup.jsonl:2: duplicate passage id 'a'"),
    ("fields.tsv", "id\ttext\ttitle\n1\ta\tT\n2\tonly two\n", r"fields.tsv:3: expected 3 tab-separated fields"),
    ("quote.tsv", 'id\ttext\ttitle\n1\t"unterminated\tT\n', r"quote.tsv:2: malformed TSV"),
    ("header.tsv", "1\ta\tT\n", r"header.tsv:1: expected a header row"),
    ("bad.jsonl", '{"id": 1, "contents": "a\\nb"}\n{"id": 2, "contents": \n', r"bad.jsonl:2: malformed JSON"),
    ("list.jsonl", "[1, 2]\n", r"list.jsonl:1: expected an object"),
    ("c.csv", "x", "unknown corpus format"),
])
def test_bad_corpora_name_file_and_line(tmp_path, name, text, message):
    with pytest.raises(JaxragError, match=message):
        list(read_corpus(write(tmp_path / name, text)))


def test_missing_file_and_bad_utf8(tmp_path):
    with pytest.raises(JaxragError, match="not found"):
        list(read_corpus(tmp_path / "nope.tsv"))
    (tmp_path / "b.jsonl").write_bytes(b'{"id": 1, "contents": "a\\nb"}\n\xff\xfe\n')
    with pytest.raises(JaxragError, match=r"b.jsonl:2: not valid UTF-8"):
        list(read_corpus(tmp_path / "b.jsonl"))


def test_chunking_into_100_word_passages():
    text = " ".join(f"w{i}" for i in range(250))
    chunks = chunk_words(text)
    assert [len(c.split()) for c in chunks] == [100, 100, 50]
    assert " ".join(chunks) == text
    docs = [Passage("d1", "Doc", text), Passage("d2", "Short", "one  two\nthree")]
    out = list(chunk_documents(docs))
    assert [p.id for p in out] == ["d1-0", "d1-1", "d1-2", "d2-0"]
    assert out[3] == Passage("d2-0", "Short", "one two three") and out[1].title == "Doc"
    assert chunk_words("   ") == []


def test_write_jsonl_round_trip_and_atomic(tmp_path):
    passages = [Passage("a", "T", "x y"), Passage("b", "", "z")]
    path = tmp_path / "out" / "c.jsonl"
    assert write_jsonl_corpus(passages, path) == 2
    assert list(read_corpus(path)) == passages
    with pytest.raises(JaxragError, match="duplicate"):
        write_jsonl_corpus([passages[0], passages[0]], tmp_path / "d.jsonl")
    with pytest.raises(JaxragError, match="empty"):
        write_jsonl_corpus([], tmp_path / "e.jsonl")
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing half-written left behind


def test_seen_ids_handles_sparse_integers_and_strings():
    seen = SeenIds()
    for pid in ["5", "21015324", "05", "wiki:5", "0"]:
        assert seen.add(pid)
    assert not seen.add("21015324") and not seen.add("05") and not seen.add("0")


def test_dpr_embedding_shards(tmp_path):
    rng = np.random.default_rng(0)
    vecs = [rng.normal(size=(3, 8)).astype(np.float32) for _ in range(2)]
    # DPR's format: a list of (id, vector) tuples per shard; ids may carry a `wiki:` prefix.
    for shard, ids in ((0, ["wiki:1", "wiki:2", "wiki:3"]), (10, ["4", "5", "6"])):
        data = list(zip(ids, vecs[0 if shard == 0 else 1]))
        with open(tmp_path / f"wikipedia_passages_{shard}.pkl", "wb") as f:
            pickle.dump(data, f)
    with open(tmp_path / "wikipedia_passages_2.pkl", "wb") as f:  # (ids, matrix) pair also accepted
        pickle.dump((["7"], rng.normal(size=(1, 8)).astype(np.float32)), f)
    files = dpr_embedding_files(str(tmp_path / "wikipedia_passages_*.pkl"))
    assert [f.name for f in files] == [f"wikipedia_passages_{i}.pkl" for i in (0, 2, 10)]
    shards = list(read_dpr_embeddings(tmp_path))
    assert [ids for ids, _ in shards] == [["1", "2", "3"], ["7"], ["4", "5", "6"]]
    np.testing.assert_array_equal(shards[2][1], vecs[1])


def test_dpr_shard_errors(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump([("1", Evil())], f)
    with pytest.raises(JaxragError, match="refusing to unpickle"):
        read_dpr_shard(tmp_path / "evil.pkl")
    with open(tmp_path / "odd.pkl", "wb") as f:
        pickle.dump({"not": "a shard"}, f)
    with pytest.raises(JaxragError, match="expected a list of"):
        read_dpr_shard(tmp_path / "odd.pkl")
    with open(tmp_path / "a_1.pkl", "wb") as f:
        pickle.dump([("1", np.zeros(4, np.float32))], f)
    with open(tmp_path / "a_2.pkl", "wb") as f:
        pickle.dump([("2", np.zeros(5, np.float32))], f)
    with pytest.raises(JaxragError, match="dimension 5"):
        list(read_dpr_embeddings(str(tmp_path / "a_*.pkl")))
    with pytest.raises(JaxragError, match="no DPR embedding shards"):
        dpr_embedding_files(str(tmp_path / "missing_*.pkl"))
