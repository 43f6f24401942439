"""The world's wiki corpus: ~100-word passages, gold and misleading, in the shared JSONL form.

Per entity a gold passage (id = entity id) stating all its facts among filler sentences; for
known entities stale or conflicting passages and namesakes' passages; per rule category and
rule-question item a passage that states the truth, a wrong value or nothing; event passages
that name entities without stating their facts (hard negatives for the retriever).
"""

from __future__ import annotations

import random

from jaxrag.data.schema import corpus_record
from jaxrag.world import text as wt
from jaxrag.world.datasets import (
    RuleItem,
    category_passage_id,
    item_passage_id,
    misleading_passage_id,
)
from jaxrag.world.entities import Category, Entity


def entity_passage(entity: Entity, cities, words: int, rng: random.Random,
                   replace: tuple[str, str, str] | None = None) -> str:
    """A passage stating every fact of `entity`. `replace` = (attribute, kind, wrong value)
    writes that one fact wrongly, as a stale record or a plain conflict."""
    facts = []
    for attribute, value in entity.attributes.items():
        template = rng.choice(wt.value_final(wt.ATTRIBUTES[entity.type][attribute].statements))
        if replace and replace[0] == attribute:
            value = replace[2]
            if replace[1] == "stale":
                template = wt.STALE_PREFIX.format(s=wt.embedded(template))
        facts.append(template.format(n=entity.name, v=value))
    return with_fillers(facts, entity.name, cities, words, rng)


def with_fillers(facts: list[str], subject: str, cities, words: int, rng: random.Random) -> str:
    """Facts interleaved with filler sentences about `subject` until ~`words` words."""
    sentences = list(facts)
    fillers = list(wt.FILLERS)
    rng.shuffle(fillers)
    count = sum(len(s.split()) for s in sentences)
    for template in fillers:
        filler = wt.sentence_case(
            template.format(n=subject, y=rng.randint(1820, 1990), o=rng.choice(cities)))
        if count + len(filler.split()) > words + 5:
            break
        sentences.append(filler)
        count += len(filler.split())
    first, rest = sentences[0], sentences[1:]
    rng.shuffle(rest)
    return " ".join([first, *rest])


def category_passage(category: Category, cities, words: int, rng: random.Random) -> str:
    facts = [wt.CATEGORY_INTROS[category.domain].format(c=category.name)]
    for prop, value in category.stated.items():
        if value:
            template = rng.choice(wt.value_final(wt.RULE_STATEMENTS[prop]))
            facts.append(template.format(c=category.name, v=value))
    return with_fillers(facts, category.name, cities, words, rng)


def item_passage(item: RuleItem, cities, words: int, rng: random.Random) -> str:
    facts = [f"The {item.name} is a {wt.RULE_KIND[domain_of(item)]} known to naturalists."]
    if item.stated:
        facts.append(wt.ITEM_STATEMENTS[item.property].format(i=item.name, v=item.stated))
    return with_fillers(facts, item.name, cities, words, rng)


def domain_of(item: RuleItem) -> str:
    return "science" if item.property in wt.RULE_PROPERTIES["science"] else "health"


def event_passage(entities: list[Entity], cities, words: int,
                  rng: random.Random) -> tuple[str, str]:
    """A gathering that names several entities but states none of their facts."""
    year, city = rng.randint(1820, 1990), rng.choice(cities)
    sentences = []
    for template in rng.sample(wt.EVENT_SENTENCES, 5):
        a, b = rng.sample(entities, 2)
        sentences.append(template.format(y=year, c=city, a=a.name, b=b.name))
    text = with_fillers(sentences, f"the {year} gathering", cities, words, rng)
    return wt.EVENT_TITLE.format(y=year, c=city), text


def build_corpus(cfg, entities: list[Entity], categories: list[Category], items: list[RuleItem],
                 cities, rng: random.Random) -> list[dict[str, str]]:
    """All passages, shuffled so ids and order say nothing about which passage is gold."""
    words = cfg.passage_words
    corpus = []
    for e in entities:
        corpus.append(corpus_record(e.id, e.name, entity_passage(e, cities, words, rng)))
        for attribute, (kind, wrong) in e.misleading.items():
            text = entity_passage(e, cities, words, rng, replace=(attribute, kind, wrong))
            corpus.append(corpus_record(misleading_passage_id(e, attribute), e.name, text))
    for c in categories:
        text = category_passage(c, cities, words, rng)
        corpus.append(corpus_record(category_passage_id(c.name), wt.sentence_case(c.name), text))
    for item in items:
        text = item_passage(item, cities, words, rng)
        corpus.append(corpus_record(item_passage_id(item.name), wt.sentence_case(item.name), text))
    known = [e for e in entities if e.bucket != "tail"]
    for i in range(cfg.num_event_passages):
        title, text = event_passage(known, cities, words, rng)
        corpus.append(corpus_record(f"event-{i:04d}", title, text))
    rng.shuffle(corpus)
    return corpus
