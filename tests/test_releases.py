"""Releases a researcher downloads, each in its exact published schema, loaded and scored as the
paper scores them: FlashRAG's files (each dataset's own handling), TriviaQA's original JSON and
its normalized aliases, DPR's question CSVs, PUBHEALTH's TSV with unlabeled rows."""

import json

import pytest
from data_files import jsonl, parquet, tsv

from jaxrag.data import loaders
from jaxrag.data.formats import triviaqa_normalize
from jaxrag.data.loaders import left_out, load_dataset_examples
from jaxrag.eval.metrics import score_prediction, substring_match
from jaxrag.errors import JaxragError

# --- FlashRAG (RUC-NLPIR/FlashRAG_datasets): {"id", "question", "golden_answers", "metadata"} -----

# popqa/test.jsonl's first row as published: George Rankin's page has 142 views, not long-tail.
FLASHRAG_POPQA = [
    {"id": "test_0", "question": "What is George Rankin's occupation?",
     "metadata": {"subj": "George Rankin", "prop": "occupation", "obj": "politician", "s_pop": 142,
                  "o_pop": 25692},
     "golden_answers": ["politician", "political leader", "political figure", "polit.", "pol"]},
    {"id": "test_1", "question": "What is John Mayne's occupation?",
     "metadata": {"subj": "John Mayne", "prop": "occupation", "obj": "journalist", "s_pop": 97,
                  "o_pop": 14337},
     "golden_answers": ["journalist", "journo", "journalists"]},
]


def test_flashrag_popqa_keeps_the_long_tail(tmp_path):
    path = jsonl(tmp_path / "test.jsonl", FLASHRAG_POPQA)
    [ex] = load_dataset_examples("popqa", path)  # s_pop 142 >= 100: left out, as Self-RAG evaluates
    assert (ex.id, ex.golden_answers[0], ex.metadata["s_pop"]) == ("test_1", "journalist", 97)
    assert left_out("popqa", path) == {"not long-tail (s_pop >= 100)": 1}


def test_flashrag_fever_and_pubhealth_labels_score_as_true_false(tmp_path):
    fever = jsonl(tmp_path / "fever-train.jsonl", [  # FlashRAG's fever: the claim and KILT's label
        {"id": "train_0", "question": "Nikolaj Coster-Waldau worked with the Fox Broadcasting Company.",
         "golden_answers": ["SUPPORTS"], "metadata": {}},
        {"id": "train_1", "question": "Roman Atwood is a content creator.", "golden_answers": ["REFUTES"],
         "metadata": {}},
        {"id": "train_2", "question": "Adrienne Bailon is an accountant.",
         "golden_answers": ["NOT ENOUGH INFO"], "metadata": {}}])
    sup, ref = load_dataset_examples("fever", fever)
    kilt = jsonl(tmp_path / "fever-train-kilt.jsonl", [  # the same claim in KILT's release
        {"id": "75397", "input": "Nikolaj Coster-Waldau worked with the Fox Broadcasting Company.",
         "output": [{"answer": "SUPPORTS"}]}])
    [native] = load_dataset_examples("fever", kilt)
    assert (sup.question, sup.golden_answers) == (native.question, native.golden_answers) == (
        "Claim: Nikolaj Coster-Waldau worked with the Fox Broadcasting Company. True or false?", ("true",))
    assert ref.golden_answers == ("false",) and left_out("fever", fever) == {"label not enough info": 1}
    assert score_prediction("fever", "True, he did.", sup) == score_prediction("fever", "False", ref) == 1.0
    assert score_prediction("fever", "SUPPORTS", ref) == 0.0

    health = jsonl(tmp_path / "pubhealth.jsonl", [
        {"id": "test_0", "question": "Vitamin C prevents colds", "golden_answers": ["false"]},
        {"id": "test_1", "question": "Tea is good for you.", "golden_answers": ["mixture"]}])
    [ex] = load_dataset_examples("pubhealth", health)
    assert (ex.question, ex.golden_answers) == ("Claim: Vitamin C prevents colds. True or false?", ("false",))
    assert left_out("pubhealth", health) == {"label mixture": 1}


def test_flashrag_multiple_choice_scores_the_option(tmp_path):
    # FlashRAG's multiple choice: the options in `choices`, the gold option's index in
    # `golden_answers` (its evaluator reads choices[idx]).
    path = jsonl(tmp_path / "arc-test.jsonl", [
        {"id": "test_0", "question": "Which is a source of heat?",
         "golden_answers": [1], "choices": ["ice", "the Sun", "snow", "a cloud"], "metadata": {}}])
    [ex] = load_dataset_examples("arc_challenge", path)
    assert (ex.golden_answers, ex.choices) == (("the Sun",), ("ice", "the Sun", "snow", "a cloud"))
    assert (ex.metadata["answer_key"], ex.metadata["choice_labels"]) == ("B", ["A", "B", "C", "D"])
    assert score_prediction("arc_challenge", "B", ex) == score_prediction("arc_challenge", "the Sun", ex) == 1.0
    assert score_prediction("arc_challenge", "A", ex) == 0.0
    path = jsonl(tmp_path / "obqa-train.jsonl", [{"id": "train_0", "question": "The sun is", "golden_answers": [0]}])
    with pytest.raises(JaxragError, match=r"obqa-train.jsonl:1: field 'choices': missing or empty"):
        load_dataset_examples("obqa", path)


def test_flashrags_combined_arc_is_refused_with_how_to_split_it(tmp_path):
    rows = [{"id": f"dev_{i}", "question": f"Q{i}?", "golden_answers": [0], "choices": ["a", "b"],
             "metadata": {}} for i in range(869)]  # arc/dev.jsonl: 299 Challenge + 570 Easy
    path = jsonl(tmp_path / "dev.jsonl", rows)
    with pytest.raises(JaxragError) as info:
        load_dataset_examples("arc_challenge", path, split="validation")
    msg = str(info.value)
    assert msg.startswith(f"{path}: 869 rows, the size of FlashRAG's combined `arc` dev file (ARC-Challenge "
                          "and ARC-Easy together; no field of a row says which), not arc_challenge. ")
    assert "split FlashRAG's file by keeping the rows whose question is in ARC-Challenge's file" in msg
    assert "\n" not in msg
    assert len(load_dataset_examples("arc_challenge", jsonl(tmp_path / "c.jsonl", rows[:299]))) == 299


# --- TriviaQA: the original release and its normalized aliases ------------------------------------

# samples/triviaqa_sample.json of mandarjoshi90/triviaqa (the release's layout), its answer as given.
SUNSET = {"Aliases": ["Sunset Blvd", "West Sunset Boulevard", "Sunset Boulevard", "Sunset Bulevard",
                      "Sunset Blvd."],
          "MatchedWikiEntityName": "Sunset Boulevard",
          "NormalizedAliases": ["west sunset boulevard", "sunset blvd", "sunset boulevard", "sunset bulevard"],
          "NormalizedMatchedWikiEntityName": "sunset boulevard", "NormalizedValue": "sunset boulevard",
          "Type": "WikipediaEntity", "Value": "Sunset Boulevard"}
TRIVIA_ORIGINAL = {"Data": [{
    "Answer": SUNSET, "EntityPages": [{"DocSource": "TagMe", "Filename": "Andrew_Lloyd_Webber.txt",
                                       "LinkProbability": "0.02934", "Rho": "0.22520",
                                       "Title": "Andrew Lloyd Webber"}],
    "Question": "Which Lloyd Webber musical premiered in the US on 10th December 1993?",
    "QuestionId": "tc_33", "QuestionSource": "http://www.triviacountry.com/", "SearchResults": []}],
    "Domain": "Web", "VerifiedEval": False, "Version": 1.0}


def test_triviaqa_normalization_is_the_releases_own():
    # Independent reference: the release's NormalizedAliases are its aliases under that normalization.
    assert {triviaqa_normalize(a) for a in SUNSET["Aliases"]} == set(SUNSET["NormalizedAliases"])
    assert triviaqa_normalize("Eugene O\u2019Neill") == triviaqa_normalize("Eugene O'Neill") == "eugene o neill"
    assert triviaqa_normalize("The_Who") == "who"


def test_triviaqa_original_json(tmp_path):
    path = tmp_path / "unfiltered-web-dev.json"
    path.write_text(json.dumps(TRIVIA_ORIGINAL, indent=4))
    [ex] = load_dataset_examples("triviaqa", path)
    assert (ex.id, ex.question) == ("tc_33", "Which Lloyd Webber musical premiered in the US on 10th December 1993?")
    assert ex.golden_answers == ("Sunset Boulevard", "Sunset Blvd", "West Sunset Boulevard", "Sunset Bulevard",
                                 "Sunset Blvd.", "west sunset boulevard", "sunset blvd", "sunset boulevard",
                                 "sunset bulevard")


def test_normalized_aliases_count_as_golds(tmp_path):
    hub_row = {"question": "Who wrote Long Day's Journey into Night?", "question_id": "qb_1",
               "answer": {"value": "Eugene O'Neill", "aliases": ["Eugene O'Neill", "O'Neill"],
                          "normalized_aliases": ["eugene o neill", "o neill"], "normalized_value": "eugene o neill",
                          "type": "WikipediaEntity"}}
    [ex] = load_dataset_examples("triviaqa", jsonl(tmp_path / "tqa.jsonl", [hub_row]))
    assert substring_match("Eugene O Neill", ["Eugene O'Neill", "O'Neill"]) == 0.0  # the aliases alone
    assert score_prediction("triviaqa", "Eugene O Neill", ex) == 1.0
    assert score_prediction("triviaqa", "Eugene O'Neill", ex) == 1.0


# --- DPR's question files: tab-separated, no header, answers as a Python list literal -------------

def test_dpr_question_csvs(tmp_path):
    nq = tmp_path / "nq-test.csv"
    nq.write_text("who got the first nobel prize in physics\t['Wilhelm Conrad Röntgen']\n"
                  "who sings does he love me with reba\t['Linda Davis']\n"
                  "what is the name of the cat in cat's cradle\t[\"Cat's Cradle\", 'Kurt']\n", encoding="utf-8")
    one, two, three = load_dataset_examples("nq", nq)
    assert (one.id, one.question, one.golden_answers) == (
        "nq-1", "who got the first nobel prize in physics", ("Wilhelm Conrad Röntgen",))
    assert (two.golden_answers, three.golden_answers) == (("Linda Davis",), ("Cat's Cradle", "Kurt"))
    trivia = tmp_path / "trivia-test.csv"
    trivia.write_text("Who was the man behind The Chipmunks?\t['David Seville']\n")
    [ex] = load_dataset_examples("triviaqa", trivia)
    assert (ex.id, ex.golden_answers) == ("triviaqa-1", ("David Seville", "david seville"))
    bad = tmp_path / "nq-dev.csv"
    bad.write_text("q\t['a']\nr\t['b'\n")
    with pytest.raises(JaxragError, match=r"nq-dev.csv:2: expected DPR's `question<TAB>\['answer', ...\]`"):
        load_dataset_examples("nq", bad)


# --- PUBHEALTH's TSV (neemakot/Health-Fact-Checking): rows without a usable label ----------------

PUBHEALTH_COLUMNS = ("claim_id", "claim", "date_published", "explanation", "fact_checkers", "main_text",
                     "sources", "label", "subjects")


def test_pubhealth_tsv_skips_and_counts_unlabeled_rows(tmp_path, capsys):
    rows = [dict(zip(PUBHEALTH_COLUMNS, r)) for r in [
        ("15661", "The money the Clinton Foundation took from foreign governments ...", "April 26, 2015",
         "Gingrich said ...", "Katie Sanders", "...", "https://www.politifact.com/", "false", "Foreign Policy"),
        ("9893", "Annual Mammograms May Have More False-Positives", "October 18, 2011", "This article ...",
         "", "...", "", "mixture", "Screening"),
        ("11358", "SBRT Offers Prostate Cancer Patients High Cancer Control", "September 28, 2016",
         "This news release ...", "", "...", "", "true", "Cancer"),
        ("36582", "Flu shots cause the flu", "", "", "", "...", "", "", ""),  # no label
        ("3207", "Ebola spreads by air", "", "", "", "...", "", "snopes", ""),  # a stray value
    ]]
    path = tsv(tmp_path / "test.tsv", rows)
    examples = load_dataset_examples("pubhealth", path)
    assert [(e.id, e.golden_answers) for e in examples] == [("15661", ("false",)), ("11358", ("true",))]
    assert left_out("pubhealth", path) == {"label mixture": 1, "no label": 1, "unknown label": 1}
    assert f"pubhealth: {path}: 2 questions; left out 3 rows (label mixture: 1, no label: 1, unknown label: 1)" \
        in capsys.readouterr().err


def test_health_fact_rows_without_a_label_are_left_out(tmp_path):
    row = {"claim_id": "1", "claim": "Garlic cures flu.", "date_published": "", "explanation": "", "fact_checkers": "",
           "main_text": "", "sources": "", "subjects": ""}
    path = parquet(tmp_path / "health_fact.parquet", [{**row, "label": 0}, {**row, "claim_id": "2", "label": -1}])
    assert [e.id for e in load_dataset_examples("pubhealth", path)] == ["1"]
    assert left_out("pubhealth", path) == {"no label": 1}


def test_a_file_of_left_out_rows_only_says_why(tmp_path):
    path = jsonl(tmp_path / "popqa.jsonl", FLASHRAG_POPQA[:1])
    with pytest.raises(JaxragError, match=r"no popqa examples \(every row was left out: not long-tail "
                                          r"\(s_pop >= 100\): 1\)"):
        load_dataset_examples("popqa", path)


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(loaders, "_LOADED", {})


# --- ids repeated across datasets (FlashRAG numbers every file's rows train_0, ...) --------------

def flashrag_train(path, stem, golds):
    return jsonl(path, [{"id": f"train_{i}", "question": f"{stem} {i}?", "golden_answers": [golds[i % len(golds)]],
                         "metadata": {}} for i in range(6)])


def two_datasets_config(tmp_path):
    from jaxrag.pipeline.config import paper_config

    cfg = paper_config("qwen2")
    cfg.data.train, cfg.data.eval = ["nq", "fever"], []
    cfg.data.paths.nq = str(flashrag_train(tmp_path / "nq-train.jsonl", "who is person", ["person"]))
    cfg.data.paths.fever = str(flashrag_train(tmp_path / "fever-train.jsonl", "Fact", ["SUPPORTS", "REFUTES"]))
    cfg.data.validation_sizes.update(nq=2, fever=2)
    cfg.data.train_sizes.update(nq=4, fever=4)
    return cfg


def test_ids_repeated_across_datasets_key_records_by_dataset_and_id(tmp_path):
    import numpy as np

    from jaxrag.data.check import check_data
    from jaxrag.data.construct import prepare_items
    from jaxrag.pipeline.datastore import entry_ids
    from jaxrag.pipeline.workdir import dataset_items
    from jaxrag.retrieval.datastore import build_datastore

    cfg = two_datasets_config(tmp_path)
    check_data(cfg)
    items = dataset_items(cfg, tmp_path, cfg.data.train, "train")
    [common, *_] = sorted({ex.id for d, ex in items if d == "nq"} & {ex.id for d, ex in items if d == "fever"})
    construct_items, _ = prepare_items(items)
    records = [{"dataset": it.dataset, "id": it.example.id, "question": it.question} for it in construct_items]
    keys = np.random.default_rng(0).normal(size=(len(records), 8)).astype(np.float32)
    labels = ["wiki", "self"] * (len(records) // 2)
    with pytest.raises(JaxragError, match="duplicate id"):  # what the datastore stage met before
        build_datastore(tmp_path / "bare", keys, labels, [r["id"] for r in records],
                        [r["question"] for r in records], model="m")
    ds = build_datastore(tmp_path / "ds", keys, labels, entry_ids(records), [r["question"] for r in records],
                         model="m")
    nq0, fever0 = ds.row_of(f"nq-{common}"), ds.row_of(f"fever-{common}")
    assert (records[nq0]["dataset"], records[nq0]["id"]) == ("nq", common)
    assert (records[fever0]["dataset"], records[fever0]["id"]) == ("fever", common)


def test_a_file_repeating_an_id_is_refused_before_the_first_stage(tmp_path):
    from jaxrag.data.check import check_data

    cfg = two_datasets_config(tmp_path)
    rows = [json.loads(line) for line in open(cfg.data.paths.fever)]
    rows[3]["id"] = "train_1"
    path = jsonl(tmp_path / "fever-dup.jsonl", rows)
    cfg.data.paths.fever = str(path)
    with pytest.raises(JaxragError) as info:
        check_data(cfg)
    assert str(info.value) == f"{path}:4: field 'id': duplicate id 'train_1' (first at row 2)"


def test_the_eval_data_summary_counts_rows_left_out(tmp_path):
    from jaxrag.data.check import rows_left_out

    cfg = two_datasets_config(tmp_path)
    cfg.data.paths.fever = str(jsonl(tmp_path / "fever-nei.jsonl", [
        {"id": f"train_{i}", "question": f"Fact {i}.", "golden_answers": ["NOT ENOUGH INFO" if i < 2 else "SUPPORTS"]}
        for i in range(8)]))
    assert rows_left_out(cfg, ["nq", "fever"]) == {"fever": {"label not enough info": 2}}
