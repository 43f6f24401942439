"""`data.check`: a real-model config's ten datasets loaded, validated and sized before any stage."""

import json
import sys
import types

import pytest
from data_files import jsonl, parquet, tsv

from jaxrag.data import loaders
from jaxrag.data.check import check_data, fit_counts
from jaxrag.errors import JaxragError
from jaxrag.pipeline.config import TRAIN_DATASETS, paper_config
from jaxrag.pipeline.workdir import dataset_items, eval_items


def mc(i, labels="ABCD"):
    return {"text": [f"option {j} of {i}" for j in range(len(labels))], "label": list(labels)}


# Each dataset in one of its public releases' formats (tests/test_loaders.py covers every format).
WRITERS = {
    "popqa": lambda d, n: tsv(d / "popqa.tsv", [  # akariasai/PopQA, long-tail rows (s_pop < 100)
        {"id": i, "subj": f"S{i}", "prop": "occupation", "obj": "poet", "question": f"What is S{i}'s job?",
         "possible_answers": '["poet"]', "s_pop": 5, "o_pop": 9} for i in range(n)]),
    "triviaqa": lambda d, n: parquet(d / "triviaqa.parquet", [  # mandarjoshi/trivia_qa
        {"question": f"Trivia {i}?", "question_id": f"tc_{i}",
         "answer": {"value": f"A{i}", "aliases": [f"A{i}"]}} for i in range(n)]),
    "pubhealth": lambda d, n: tsv(d / "pubhealth.tsv", [  # the PUBHEALTH TSV release
        {"claim_id": i, "claim": f"Claim number {i}", "label": ["true", "false"][i % 2]} for i in range(n)]),
    "arc_challenge": lambda d, n: parquet(d / "arc_challenge.parquet", [  # allenai/ai2_arc
        {"id": f"c{i}", "question": f"Challenge {i}?", "choices": mc(i), "answerKey": "B"} for i in range(n)]),
    "wow": lambda d, n: jsonl(d / "wow-train-kilt.jsonl", [  # KILT
        {"id": f"w{i}", "input": f"I like topic {i}.", "output": [{"answer": f"Topic {i} is old."}]}
        for i in range(n)]),
    "nq": lambda d, n: jsonl(d / "nq-open-train.jsonl", [  # nq_open: no ids
        {"question": f"who is person {i}", "answer": [f"person {i}"]} for i in range(n)]),
    "fever": lambda d, n: jsonl(d / "fever-train-kilt.jsonl", [  # KILT
        {"id": str(i), "input": f"Fact {i} holds.", "output": [{"answer": ["SUPPORTS", "REFUTES"][i % 2]}]}
        for i in range(n)]),
    "obqa": lambda d, n: parquet(d / "obqa.parquet", [  # allenai/openbookqa main
        {"id": f"o{i}", "question_stem": f"Science {i}", "choices": mc(i), "answerKey": "C"} for i in range(n)]),
    "arc_easy": lambda d, n: jsonl(d / "ARC-Easy-Train.jsonl", [  # the original ARC release
        {"id": f"e{i}", "answerKey": "A", "question": {"stem": f"Easy {i}?", "choices": [
            {"text": t, "label": lab} for t, lab in zip(mc(i)["text"], "ABCD")]}} for i in range(n)]),
    "asqa": lambda d, n: (d / "ASQA.json").write_text(json.dumps({"dev": {}, "train": {  # ASQA.json
        f"s{i}": {"ambiguous_question": f"Ambiguous {i}?", "qa_pairs": [],
                  "annotations": [{"long_answer": f"Long answer {i}."}]} for i in range(n)}})) and d / "ASQA.json",
}


def real_config(tmp_path, n=12, val=2, train=10):
    """qwen2's paper config with all ten datasets as `n`-row files, `val` + `train` asked of each."""
    cfg = paper_config("qwen2")
    for name, write in WRITERS.items():
        cfg.data.paths[name] = str(write(tmp_path, n))
    cfg.data.validation_sizes.update({name: val for name in TRAIN_DATASETS})
    cfg.data.train_sizes.update({name: train for name in TRAIN_DATASETS})
    return cfg


def error(cfg) -> str:
    with pytest.raises(JaxragError) as info:
        check_data(cfg)
    return str(info.value)


def test_files_that_hold_the_counts_pass_and_give_them_exactly(tmp_path):
    cfg = real_config(tmp_path)
    check_data(cfg)
    val, test = eval_items(cfg, tmp_path)
    train = dataset_items(cfg, tmp_path, cfg.data.train, "train")
    for name in TRAIN_DATASETS:
        assert [n for n, _ in val].count(name) == 2 and [n for n, _ in train].count(name) == 10
    assert {n: [m for m, _ in test].count(n) for n in cfg.data.eval} == {
        "popqa": 12, "triviaqa": 12, "pubhealth": 12, "arc_challenge": 12}


def test_table5_counts_larger_than_a_file_name_dataset_file_size_and_settings(tmp_path):
    cfg = real_config(tmp_path, n=120)
    cfg.data.train = ["nq", "fever"]
    cfg.data.train_sizes.update(nq=14753, fever=100)  # Table 5's NQ; FEVER fits (20 + 100 <= 120)
    cfg.data.validation_sizes.update(nq=776, fever=20)
    nq = tmp_path / "nq-open-train.jsonl"
    assert error(cfg) == (
        "training mixture larger than its files (Table 5's counts need the full public train splits): "
        f"nq: {nq} has 120 usable questions, fewer than data.validation_sizes.nq=776 + data.train_sizes.nq=14753. "
        "Give the full files, or lower the counts to fit, e.g. "
        "--config.data.validation_sizes.nq=6 --config.data.train_sizes.nq=114")  # 120 x 776 / 15529 = 6.0


@pytest.mark.parametrize("val, train, why", [
    (13, 1, "validation short"), (12, 1, "train split empty"), (5, 8, "train count past what remains")])
def test_each_short_case_is_refused(tmp_path, val, train, why):
    cfg = real_config(tmp_path)  # 12 rows each
    cfg.data.train = ["fever"]
    cfg.data.validation_sizes.fever, cfg.data.train_sizes.fever = val, train
    msg = error(cfg)
    assert f"has 12 usable questions, fewer than data.validation_sizes.fever={val} + " \
           f"data.train_sizes.fever={train}. " in msg, why
    assert msg.endswith(f"--config.data.validation_sizes.fever={fit_counts(12, val, train)[0]} "
                        f"--config.data.train_sizes.fever={fit_counts(12, val, train)[1]}")


def test_every_short_dataset_in_one_line(tmp_path):
    msg = error(real_config(tmp_path, n=12, val=776, train=14753))
    assert "\n" not in msg
    assert [part.split(":")[0] for part in msg.split(": ", 1)[1].split(". Give")[0].split("; ")] == TRAIN_DATASETS
    assert msg.endswith(" ".join(f"--config.data.validation_sizes.{n}=1 --config.data.train_sizes.{n}=11"
                                 for n in TRAIN_DATASETS))


def test_fit_counts_by_hand():
    assert fit_counts(120, 776, 14753) == (6, 114)
    assert fit_counts(12, 13, 0) == (12, 0)  # no train asked: all of it validates
    assert fit_counts(12, 107, 2037) == (1, 11)  # 0.6 rounds to 1 and one stays for validation
    assert fit_counts(1, 5, 5) == (0, 1)  # a single question trains
    assert fit_counts(10, 0, 50) == (0, 10)


def test_filtered_rows_do_not_count(tmp_path):
    cfg = real_config(tmp_path)
    cfg.data.train = ["fever"]
    path = jsonl(tmp_path / "fever-nei.jsonl", [  # the paper keeps true/false: NOT ENOUGH INFO is left out
        {"id": str(i), "input": f"Fact {i}.", "output": [{"answer": "NOT ENOUGH INFO" if i % 3 else "SUPPORTS"}]}
        for i in range(12)])
    cfg.data.paths.fever = str(path)
    cfg.data.validation_sizes.fever, cfg.data.train_sizes.fever = 1, 3
    check_data(cfg)
    cfg.data.train_sizes.fever = 4
    assert f"fever: {path} has 4 usable questions, fewer than" in error(cfg)


def test_bad_settings_and_empty_mixture(tmp_path):
    cfg = real_config(tmp_path)
    cfg.data.train = ["nq", "hotpotqa"]
    assert error(cfg).startswith("data.train: unknown dataset 'hotpotqa' (known: popqa, triviaqa,")
    cfg.data.train = ["nq"]
    cfg.data.train_sizes.nq = -1
    assert error(cfg) == "data.train_sizes.nq=-1: expected a count >= 0"
    cfg.data.train_sizes.nq = 0
    assert error(cfg) == ("data.train=['nq'] with data.train_sizes {'nq': 0}: no training question to "
                          "construct from; name a training dataset and a train size above 0")
    del cfg.data.validation_sizes["nq"]
    assert error(cfg) == ("data.validation_sizes.nq: missing for training dataset 'nq'; "
                          "set --config.data.validation_sizes.nq=N")


def test_a_bad_row_in_any_file_stops_the_check(tmp_path):
    cfg = real_config(tmp_path)
    path = parquet(tmp_path / "arc_challenge.parquet", [  # an evaluation file, checked as well
        {"id": "c0", "question": "Q?", "choices": mc(0), "answerKey": "B"},
        {"id": "c1", "question": "Q?", "choices": {"text": ["a", " ", "c"], "label": list("ABC")},
         "answerKey": "A"}])
    assert error(cfg) == f"{path}:2: field 'choices': option 'B' has no text"


def test_the_embedded_world_is_not_checked(tmp_path):
    cfg = real_config(tmp_path, val=776, train=14753)
    cfg.model.path = ""  # trains from scratch on the generated world: its files are its own
    check_data(cfg)


# --- TriviaQA from the Hub: Self-RAG's test set is the unfiltered validation split ----------------

TRIVIA_TEST_ROW = {  # what the hub's test split holds (huggingface/datasets#804): answers withheld
    "question": "Which planet is red?", "question_id": "tc_1",
    "answer": {"value": "<unk>", "aliases": [], "normalized_value": "<unk>", "type": "<unk>"}}


@pytest.fixture
def hub(monkeypatch):
    """`datasets.load_dataset` recording its calls (no network): the test split's rows as the hub
    gives them, every other split answered."""
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        if split == "test":
            return [TRIVIA_TEST_ROW]
        return [{**TRIVIA_TEST_ROW, "answer": {"value": "Mars", "aliases": ["Mars"]}}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(loaders, "_LOADED", {})  # nothing read before this test counts
    return calls


def test_triviaqa_test_set_is_the_unfiltered_validation_split(tmp_path, hub):
    cfg = real_config(tmp_path)
    cfg.data.paths.triviaqa = ""  # from the hub
    [(name, ex)] = dataset_items(cfg, tmp_path, ["triviaqa"], "test")
    assert hub == [("mandarjoshi/trivia_qa", "unfiltered.nocontext", "validation")]
    assert (name, ex.golden_answers) == ("triviaqa", ("Mars", "mars"))
    check_data(cfg)  # the preflight reads the same split (and the loaded examples: no second call)
    assert hub == [("mandarjoshi/trivia_qa", "unfiltered.nocontext", "validation")]


def test_the_hub_test_splits_unk_answers_are_refused(hub):
    with pytest.raises(JaxragError) as info:
        loaders.load_dataset_examples("triviaqa", split="test")
    assert str(info.value) == (
        "mandarjoshi/trivia_qa[test]:1: field 'answer': '<unk>' is the Hub's placeholder for a withheld "
        "answer, not an answer (TriviaQA's test split; use its validation split, huggingface/datasets#804)")


def test_a_file_is_parsed_once_until_its_contents_change(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders, "_LOADED", {})
    parsed = []
    real_load = loaders._load
    monkeypatch.setattr(loaders, "_load", lambda *a: parsed.append(a[0]) or real_load(*a))
    path = jsonl(tmp_path / "nq.jsonl", [{"question": "who is a", "answer": ["a"]}])
    first = loaders.load_dataset_examples("nq", path)
    assert loaders.load_dataset_examples("nq", path) == first and parsed == ["nq"]
    jsonl(path, [{"question": "who is b", "answer": ["b"]}])  # same size, new contents
    assert loaders.load_dataset_examples("nq", path)[0].golden_answers == ("b",) and parsed == ["nq", "nq"]
