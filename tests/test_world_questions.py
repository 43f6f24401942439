"""How the world asks: links by preferential attachment and chain questions (facts a model
holds but uses only after verbalizing them), and each dataset's phrasings (NQ and ARC-Easy train
on every phrasing their test-time peers use)."""

import re
from collections import Counter

import pytest

from jaxrag.world import text as wt
from jaxrag.world.generate import generate_world


@pytest.fixture(scope="module")
def world():
    return generate_world()


def test_links_follow_preferential_attachment(world):
    """Links name popular entities far more often than their share."""
    known = {(e.type, e.name): e for e in world.entities if not e.namesake_of}
    links = [known[(t, e.attributes[a])] for e in world.entities if not e.namesake_of
             for a, t in wt.LINKS.get(e.type, {}).items()]
    targets = [e for e in known.values() if e.type in ("city", "company")]
    head_share = sum(e.bucket == "head" for e in targets) / len(targets)
    assert head_share < 0.25 and sum(e.bucket == "head" for e in links) / len(links) > 0.5


def test_chain_questions_ask_the_linked_entitys_fact(world):
    """A chain question names a known subject; its answer is a fact of the head entity the
    subject's link names (the answer itself is checked by test_every_answer_is_derivable...)."""
    data = world.datasets()
    chains = {n: [e for s in xs.values() for e in s if e.metadata["kind"] == "chain"]
              for n, xs in data.items()}
    assert len(chains["triviaqa"]) > 0.2 * world.config.eval_test_size
    assert chains["nq"] and not chains["popqa"] and not chains["wow"]
    for e in chains["triviaqa"] + chains["nq"]:
        m = e.metadata
        assert m["bucket"] in ("head", "torso") and world.entity(m["via"]).bucket == "head"
        assert m["gold_passage_id"] == m["via"] and m["hop_passage_id"] == m["entity"]
        assert wt.CHAINS[(m["entity_type"], m["attribute"])][0] == m["via_attribute"]


def test_chain_verbalizations_state_both_facts_and_never_answer_closed_book(world):
    """Pretraining verbalizes its own chains (head subjects, never a dataset's) with both facts
    before the answer; no chain question is ever answered closed-book in pretraining."""
    parts = world.pretraining_parts(0)
    start = len(world.pretrain_qa_facts())
    docs = parts["verbalize"][start:start + len(world.pretrain_chains)]
    chains = world.pretrain_chain_facts()
    assert len(chains) > 10 and all(s.bucket == "head" for s, _, _ in chains)
    for doc, (subject, attribute, linked) in zip(docs, chains, strict=True):
        answer = linked.attributes[wt.CHAINS[(subject.type, attribute)][0]]
        first, second = doc[1].strip().split(". ")
        assert subject.name in first and linked.name in first
        assert linked.name in second and answer in second
        assert len(doc) == 2 or doc[2:] == (" Answer:", f" {answer}")
    asked = {d[0].removeprefix("Question: ").removesuffix(" Answer:") for d in parts["qa"]}
    chain_forms = [re.compile(re.escape(t).replace(re.escape("{n}"), ".+"))
                   for _, questions in wt.CHAINS.values() for t in questions.values()]
    assert any(q.endswith("?") for q in asked)  # the prefix/suffix strip left bare questions
    triviaqa = [e for e in world.datasets()["triviaqa"]["test"] if e.metadata["kind"] == "chain"]
    assert all(any(f.fullmatch(e.question) for f in chain_forms) for e in triviaqa)
    assert not any(form.fullmatch(q) for form in chain_forms for q in asked)


def phrasing(example) -> str:
    """Which of world_text's question styles an entity-fact question is phrased in."""
    m = example.metadata
    questions = (wt.CHAINS[(m["entity_type"], m["attribute"])][1] if m["kind"] == "chain" else
                 wt.ATTRIBUTES[m["entity_type"]][m["attribute"]].questions)
    return next(style for style, template in questions.items()
                if re.fullmatch(re.escape(template).replace(re.escape("{n}"), ".+"), example.question))


def test_test_sets_keep_one_phrasing_and_nq_trains_on_every_phrasing(world):
    """PopQA and TriviaQA keep their own templates; NQ's training and validation questions come in
    all of them (about a third each), so fine-tuning does not learn to read for one phrasing."""
    data = world.datasets()
    assert {phrasing(e) for e in data["popqa"]["test"]} == {"popqa"}
    assert {phrasing(e) for e in data["triviaqa"]["test"]} == {"trivia"}
    nq = [e for split in ("train", "validation") for e in data["nq"][split]]
    counts = Counter(phrasing(e) for e in nq)
    assert set(counts) == set(wt.QUESTION_STYLES)
    assert min(counts.values()) > 0.2 * len(nq)


def rule_phrasing(example) -> str:
    """Which of world_text's RULE_QUESTIONS styles a rule question is phrased in."""
    m = example.metadata
    return next(style for style, template in wt.RULE_QUESTIONS[m["property"]].items()
                if template.format(i=m["item"], c=m["category"]) == example.question)


def test_arc_challenge_phrasing_is_among_arc_easy_training_questions(world):
    """As real ARC-Easy and ARC-Challenge share one exam style, the training mixture's ARC-Easy
    asks in both ARC phrasings, known and unknown rules alike; ARC-Challenge's
    test set and OBQA keep one phrasing each."""
    data = world.datasets()
    assert {rule_phrasing(e) for e in data["arc_challenge"]["test"]} == {"challenge"}
    assert {rule_phrasing(e) for s in data["obqa"].values() for e in s} == {"open"}
    train = data["arc_easy"]["train"]
    counts = Counter((rule_phrasing(e), e.metadata["kind"]) for e in train)
    assert {style for style, _ in counts} == {"easy", "challenge"}
    assert all(counts[(style, kind)] >= 0.05 * len(train)
               for style in ("easy", "challenge") for kind in ("rule", "unknown_rule"))
