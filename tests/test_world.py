"""The embedded world: deterministic, leak-free, every answer derivable, tokenizer round-trips."""

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest

from jaxrag.data.schema import read_examples
from jaxrag.models.tokens import srrag_tokens
from jaxrag.world import text as wt
from jaxrag.world.datasets import EVAL_SETS, TRAIN_SETS
from jaxrag.world.generate import WorldConfig, generate_world, write_world

DIGEST = """
import hashlib, json
from jaxrag.world.generate import generate_world
w = generate_world()
blob = json.dumps([w.corpus(), {n: {s: [e.to_dict() for e in x] for s, x in d.items()}
                   for n, d in w.datasets().items()}, w.pretraining_texts(0)], sort_keys=True)
print(hashlib.sha256(blob.encode()).hexdigest())
"""


@pytest.fixture(scope="module")
def world():
    return generate_world()


@pytest.fixture(scope="module")
def written(world, tmp_path_factory):
    return write_world(world, tmp_path_factory.mktemp("w") / "world")


def examples(world):
    return [(name, split, e) for name, splits in world.datasets().items()
            for split, xs in splits.items() for e in xs]


def digest(world):
    blob = json.dumps([world.corpus(), {n: {s: [e.to_dict() for e in x] for s, x in d.items()}
                       for n, d in world.datasets().items()}, world.pretraining_texts(0)],
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def test_same_seed_same_world_across_processes(world):
    """Also across hash seeds: no output may depend on set or dict-of-set iteration order."""
    runs = {digest(world), digest(generate_world())}
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", DIGEST], env=env, capture_output=True,
                             text=True, check=True)
        runs.add(out.stdout.strip())
    assert len(runs) == 1


def test_different_seed_different_world(world):
    other = generate_world(WorldConfig(seed=1))
    assert other.corpus() != world.corpus()
    assert [e.name for e in other.entities] != [e.name for e in world.entities]


def test_every_epoch_is_rephrased_with_fresh_reading_comprehension(world):
    first, second = world.pretraining_parts(0), world.pretraining_parts(1)
    assert first["rc"] != second["rc"] and first["bio"] != second["bio"]
    assert world.reading_comprehension(3, 5) == world.reading_comprehension(3, 5)
    assert world.reading_comprehension(3, 5) != world.reading_comprehension(4, 5)


def test_rule_verbalizations_state_the_asked_rule(world):
    """Each rule verbalization names the question's item and states its category's true value
    of the asked property (the <Self> path for ARC-like questions copies and recalls both)."""
    rules = []
    for doc in world.pretraining_parts(0)["verbalize"]:  # GenRead or knowledge-in-context form
        text = "".join(doc)
        category = next((c for c in world.categories if f" {c.name}, so" in text), None)
        if category is None:
            continue
        item = text.split(f" is a {category.name}, so")[0].split()[-1]
        assert text.count(f" {item}") >= 2  # in the question and in the document
        stated = [p for p, v in category.properties.items()
                  if any(t.format(c=category.name, v=v) in text for t in wt.RULE_STATEMENTS[p])]
        assert len(stated) == 1 and wt.RULE_APPLICATIONS[stated[0]].format(
            c=category.name, v=category.properties[stated[0]], i=item) in text, text
        rules.append(stated[0])
    assert len(rules) == world.config.rule_verbalize_per_epoch


def test_fact_verbalizations_open_with_the_asked_fact(world):
    """A fact verbalization's document opens with a statement of the asked value about the
    asked entity; in SR-RAG's form the document and the answer are both training targets."""
    docs, facts = world.pretraining_parts(0)["verbalize"], world.pretrain_qa_facts()
    forms = Counter()
    for doc, (entity, attribute) in zip(docs, facts):
        value = entity.attributes[attribute]
        document = doc[1]
        first = document.strip().split(". ")[0]
        assert entity.name in first and value in first, (first, entity.name, value)
        assert len(document.split(". ")) == len(entity.attributes)  # then the rest of the bio
        if len(doc) == 4:  # `Question: q Background knowledge:` | doc | ` Answer:` | answer
            assert doc[0].endswith("Background knowledge:") and doc[2:] == (" Answer:", f" {value}")
        else:
            assert len(doc) == 2 and doc[0].endswith("Background document:")
        forms[len(doc)] += 1
    assert forms[2] > 0 and forms[4] > 0


def test_dataset_names_and_splits(world):
    datasets = world.datasets()
    assert tuple(datasets) == (*TRAIN_SETS, *EVAL_SETS)
    for name in TRAIN_SETS:
        assert set(datasets[name]) == {"train", "validation"} and datasets[name]["train"]
    for name in EVAL_SETS:
        assert set(datasets[name]) == {"test"}  # validation comes from the training mixture only
        assert len(datasets[name]["test"]) == world.config.eval_test_size


def test_a_larger_training_mixture_keeps_the_test_and_validation_questions(world):
    """Recipes of different sizes are compared on the same validation data: doubling every
    train split at half the validation fraction redraws only the train splits."""
    cfg = world.config
    double = {f"{n}_size": 2 * getattr(cfg, f"{n}_size") for n in TRAIN_SETS}
    bigger = generate_world(replace(cfg, **double,
                                    validation_fraction=cfg.validation_fraction / 2)).datasets()
    for name, splits in world.datasets().items():
        for split, xs in splits.items():
            same = [e.question for e in bigger[name][split]] == [e.question for e in xs]
            assert same == (split != "train"), (name, split)
            if split == "train":  # ASQA's ambiguous names run out before twice its size
                assert len(bigger[name][split]) > len(xs)


def test_no_question_or_fact_leaks(world):
    """Each question once overall; each entity fact asked in one (dataset, split) only, and
    never one that pretraining shows in QA form; each rule item named once."""
    items = [(n, s, e) for n, s, e in examples(world)]
    questions = Counter(e.question for _, _, e in items)
    assert questions.most_common(1)[0][1] == 1
    asked: dict[tuple, tuple] = {}
    for name, split, e in items:
        m = e.metadata
        first = (m.get("entity"), m.get("attribute"))
        # a chain consumes its first fact, unless pretraining states that one as QA
        consumed = [first] if first not in set(world.pretrain_facts) else []
        facts = ([first] if m["kind"] == "fact" else
                 [(i, m["attribute"]) for i in m["entities"]] if m["kind"] == "ambiguous" else
                 [("chain", *first), *consumed] if m["kind"] == "chain" else [("item", m["item"])])
        for fact in facts:
            assert fact not in asked, f"{fact} asked in {asked.get(fact)} and {(name, split)}"
            asked[fact] = (name, split)
    assert not set(world.pretrain_facts) & set(asked)
    assert not {("chain", *c) for c in world.pretrain_chains} & set(asked)


def truths(world, example) -> list[str]:
    """The world's true value(s) behind an example, read from its facts, not the example."""
    m = example.metadata
    if m["kind"] == "ambiguous":
        return [world.entity(i).attributes[m["attribute"]] for i in m["entities"]]
    if m["kind"] == "fact":
        return [world.entity(m["entity"]).attributes[m["attribute"]]]
    if m["kind"] == "chain":  # the fact of the entity the subject's link names
        linked = world.entity(m["via"])
        assert linked.name == world.entity(m["entity"]).attributes[m["attribute"]]
        return [linked.attributes[m["via_attribute"]]]
    category = next(c for c in world.categories if c.name == m["category"])
    return [category.properties[m["property"]]]


def test_every_answer_is_derivable_from_world_facts(world):
    for name, _, e in examples(world):
        m, values = e.metadata, truths(world, e)
        if "label" in m:  # true/false claims
            assert m["label"] == (m["claimed_value"] == values[0])
            assert m["claimed_value"] in e.question
            assert e.golden_answers == (str(m["label"]).lower(),)
        elif name in ("wow", "asqa"):  # long-form: a sentence stating the value(s)
            assert all(re.search(rf"\b{v}\b", e.golden_answers[0]) for v in values)
        else:
            assert e.golden_answers == tuple(values)
        if e.choices:
            assert values[0] in e.choices and len(set(e.choices)) == len(e.choices) == 4


def test_gold_passages_exist_and_state_the_answer(world):
    corpus = {p["id"]: p["contents"] for p in world.corpus()}
    assert len(corpus) == len(world.corpus())
    for _, _, e in examples(world):
        m = e.metadata
        golds = m.get("gold_passage_ids") or [m["gold_passage_id"]]
        for gold, value in zip(golds, truths(world, e), strict=True):
            assert gold is None or re.search(rf"\b{value}\b", corpus[gold]), (e.id, gold)
        assert m.get("misleading_passage_id") is None or m["misleading_passage_id"] in corpus
    facts = [e for _, _, e in examples(world) if e.metadata["kind"] == "fact"]
    assert all(e.metadata["gold_passage_id"] for e in facts)
    for e in facts:  # the misleading passage states a wrong value under the same title
        m, entity = e.metadata, world.entity(e.metadata["entity"])
        if m["misleading_passage_id"]:
            wrong = entity.misleading[m["attribute"]][1]
            assert corpus[m["misleading_passage_id"]].startswith(entity.name + "\n")
            assert re.search(rf"\b{wrong}\b", corpus[m["misleading_passage_id"]])


def test_passages_are_about_100_words(world):
    lengths = [len(p["contents"].split("\n", 1)[1].split()) for p in world.corpus()]
    assert min(lengths) >= 80 and max(lengths) <= 120
    assert all(p["contents"].count("\n") == 1 for p in world.corpus())


def test_popularity_is_zipf_and_buckets_follow_mentions(world):
    cfg = world.config
    base = sorted((e for e in world.entities if not e.namesake_of),
                  key=lambda e: (-e.popularity, -e.mentions))
    mentions = [e.mentions for e in base]
    assert mentions == sorted(mentions, reverse=True) and mentions[0] == cfg.max_mentions
    assert sum(m > 0 for m in mentions) == round(cfg.known_fraction * len(base))
    for e in world.entities:
        expected = ("head" if e.mentions >= cfg.head_min_mentions
                    else "torso" if e.mentions else "tail")
        assert e.bucket == expected
    head = sum(e.bucket == "head" for e in base)
    assert 0.1 * len(base) <= head <= 0.3 * len(base)  # a popular head (~15% at Zipf 1.5), not a few stars


def test_eval_sets_mirror_their_originals(world):
    buckets = {n: Counter(e.metadata["bucket"] for e in world.datasets()[n]["test"])
               for n in ("popqa", "triviaqa")}
    assert buckets["popqa"]["tail"] > 0.6 * world.config.eval_test_size
    assert buckets["triviaqa"]["head"] > 0.3 * world.config.eval_test_size
    challenge = world.datasets()["arc_challenge"]["test"]
    misled = [e for e in challenge if e.metadata["misleading_passage_id"]]
    assert len(misled) > 0.3 * len(challenge)  # retrieval often argues for a wrong choice
    head = [e for e in world.datasets()["triviaqa"]["test"] if e.metadata["bucket"] == "head"]
    assert any(e.metadata["misleading_passage_id"] for e in head)


def test_pretraining_states_known_facts_never_tail_ones(world):
    text = "\n".join(world.pretraining_texts(0))
    persons = [e for e in world.entities if e.type == "person" and not e.namesake_of]
    for e in persons:
        assert (e.name in text) == (e.bucket != "tail"), e
    head = next(e for e in persons if e.bucket == "head")
    assert text.count(head.name) >= head.mentions * len(head.attributes)
    for c in world.known_categories:
        for prop, value in c.properties.items():
            assert any(t.format(c=c.name, v=value) in text for t in wt.RULE_STATEMENTS[prop])
    words = set(re.findall(r"\w+", text))
    assert all(c.name not in words for c in world.categories if not c.known)


def test_unknown_rules_are_stated_by_the_corpus_alone(world):
    """A quarter of each domain's categories is never in pretraining (the test above); the
    corpus states their rules truly, in the category's passage and in every asked item's, so
    their questions are answerable by retrieval only, and the training mixture's OBQA and
    ARC-Easy hold some (their <Wiki> labels teach answering a choice after a passage)."""
    cfg = world.config
    sizes = {"science": cfg.num_science_categories, "health": cfg.num_health_categories}
    for domain, size in sizes.items():
        unknown = [c for c in world.categories if c.domain == domain and not c.known]
        assert len(unknown) == round(size * cfg.unknown_rule_fraction) > 0
        assert all(c.stated == c.properties for c in unknown)
    unknown = {c.name for c in world.categories if not c.known}
    items = {i.name: i for i in world.items}
    corpus = {p["id"]: p["contents"] for p in world.corpus()}
    rules = [e for _, _, e in examples(world) if e.metadata["kind"] in ("rule", "unknown_rule")]
    for e in rules:
        m = e.metadata
        assert (m["kind"] == "unknown_rule") == (m["category"] in unknown)
        if m["kind"] == "unknown_rule":
            assert items[m["item"]].stated == truths(world, e)[0]
            assert m["gold_passage_id"] and not m["misleading_passage_id"]
            assert f" {truths(world, e)[0]}" in corpus[f"item-{m['item']}"]
    for name in ("obqa", "arc_easy"):
        train = world.datasets()[name]["train"]
        asked = [e for e in train if e.metadata["kind"] == "unknown_rule"]
        assert 0.1 * len(train) < len(asked) < 0.5 * len(train)


def test_reading_comprehension_copies_from_the_gold_passage(world):
    names = {e.name for e in world.entities}
    for ex in world.reading_comprehension(0, 200):
        passages, gold = ex.metadata["passages"], ex.metadata["gold_index"]
        assert 1 <= len(passages) <= world.config.rc_max_passages
        assert passages[gold].split("\n")[0] not in names  # fresh, never a world entity
        if ex.metadata["kind"] == "fact":
            assert ex.golden_answers[0] in passages[gold]
            questions = {q for q, _ in ex.metadata["followups"]}
            assert len(ex.metadata["followups"]) == 3 * len(passages) - 1 == len(questions)
            assert ex.question not in questions
            assert all(f" {a}." in "".join(passages) for _, a in ex.metadata["followups"])


def test_written_world_and_tokenizer(world, written):
    from transformers import AutoTokenizer

    corpus = [json.loads(line) for line in (written / "corpus.jsonl").read_text().splitlines()]
    assert corpus == world.corpus()
    for name, splits in world.datasets().items():
        for split, xs in splits.items():
            assert read_examples(written / "datasets" / name / f"{split}.jsonl") == xs
    assert json.loads((written / "world.json").read_text())["config"]["seed"] == 0
    assert not [p for p in written.parent.iterdir() if p.name.startswith(".")]

    config = json.loads((written / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4
    tok = AutoTokenizer.from_pretrained(written / "tokenizer")
    for text in [p["contents"] for p in corpus[:300]] + world.pretraining_texts(0)[:300]:
        assert tok.decode(tok(text)["input_ids"]) == text
    prompt = "Question: q Background knowledge: <EOQ><Wiki>Some text.<EOK> Answer: a"
    ids = tok(prompt)["input_ids"]
    assert tok.decode(ids) == prompt
    for token in srrag_tokens():
        (token_id,) = tok(token)["input_ids"]
        assert tok.convert_ids_to_tokens(token_id) == token
        assert ids.count(token_id) == prompt.count(token)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    # every value the world uses (a pool value no text mentions earns no merges and may split)
    corpus_words = set(" ".join(p["contents"] for p in corpus).replace(".", " ").replace(",", " ").split())
    answers = {a for splits in world.datasets().values() for xs in splits.values() for e in xs for a in e.golden_answers}
    values = {v for kind, pool in world.pools.items()
              if kind not in ("first_name", "last_name", "band") for v in pool if v in corpus_words or v in answers}
    assert len(values) > 300
    assert all(len(tok(" " + v)["input_ids"]) == 1 for v in values)  # one uniform format


def test_fresh_rule_questions_ask_the_worlds_rules_about_items_no_dataset_holds(world):
    """The base's verbalization gate: each question names a new item of a known category, its
    truth is that category's value of the asked property and one of its four choices, and no
    dataset of the world asks it (the gate never reads a test question)."""
    from jaxrag.world.probe import fresh_rule_questions

    got = fresh_rule_questions(world, 50)
    assert got == fresh_rule_questions(world, 50) and len(got) == 50
    asked = {ex.prompt_question() for splits in world.datasets().values() for exs in splits.values() for ex in exs}
    categories = {c.name: c for c in world.known_categories}
    unknown = {c.name for c in world.categories if not c.known}
    known = {i.name for i in world.items}
    for question, truth in got:
        assert question not in asked
        words = set(question.replace(",", " ").replace(".", " ").replace("?", " ").split())
        (name,) = words & set(categories)
        assert truth in categories[name].properties.values()
        choices = question.split(" Choices: ")[1].rstrip(".").split(", ")
        assert len(choices) == 4 and truth in choices
        assert not words & known  # a new item, never one a dataset asks about
        assert not words & unknown  # the gate asks the rules pretraining taught
    assert len({truth for _, truth in got}) > 1


def test_fresh_claims_are_decided_by_their_passage(world):
    from jaxrag.world.probe import fresh_claim_questions

    claims = fresh_claim_questions(world, 200)
    asked = {ex.question for splits in world.datasets().values() for xs in splits.values() for ex in xs}
    assert not asked & {q for q, _, _ in claims}
    assert 80 <= sum(label == "true" for *_, label in claims) <= 120
    for i, (claim, (passage,), label) in enumerate(claims):
        assert claim.startswith("Claim: ") and label in ("true", "false")
        if i % 2:  # a rule claim ends in its value, and its passage states the rule's value only
            value = claim.removesuffix(". True or false?").split()[-1]
            assert (f" {value}." in passage) == (label == "true"), (claim, passage)
        else:  # a fact claim comes with its entity's passage
            assert passage.split("\n")[0] in claim, (claim, passage)
