"""The world's QA datasets: a training mixture mirroring SR-RAG's six and four evaluation sets.

Every entity fact is asked in at most one (dataset, split), and facts stated in QA form during
pretraining are never asked, so no answer leaks between splits, datasets or pretraining.
Rule questions each name a fresh item; the rule itself is shared knowledge, like ARC's science.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from jaxrag.data.schema import CLAIM, QAExample
from jaxrag.world import text as wt
from jaxrag.world.entities import Category, Entity, NameMaker, stated_value

TRAIN_SETS = ("nq", "fever", "obqa", "arc_easy", "wow", "asqa")
EVAL_SETS = ("popqa", "triviaqa", "pubhealth", "arc_challenge")
BUCKETS = ("head", "torso", "tail")
# How often a dataset asks about head / torso / tail entities: PopQA is the long tail,
# TriviaQA leans popular, NQ-like user questions are mixed.
BUCKET_MIX = {
    "popqa": (0.05, 0.15, 0.8), "triviaqa": (0.5, 0.3, 0.2), "nq": (0.4, 0.3, 0.3),
    "fever": (0.4, 0.3, 0.3), "wow": (0.3, 0.3, 0.4),
}
# Each dataset's phrasings (world_text.QUESTION_STYLES). The test sets keep one each, as PopQA's
# templates and TriviaQA's quiz style; NQ's user questions come in every phrasing, as real NQ's do
# (and as pretraining's QA text). With NQ in its own phrasing only, fine-tuning teaches the 3M model
# to read for that phrasing alone: its forced-<Wiki> answers on PopQA/TriviaQA name another
# attribute's value where the untuned model copies the right one.
QUESTION_STYLE = {"popqa": ("popqa",), "triviaqa": ("trivia",), "nq": wt.QUESTION_STYLES,
                  "wow": ("popqa",)}
# The share of a dataset's questions that are chain questions (world_text.CHAINS): TriviaQA's
# quiz questions are often compositional, and NQ's training questions teach the router them.
CHAIN_MIX = {"triviaqa": 0.3, "nq": 0.3}
# Real ARC-Easy and ARC-Challenge are one exam's questions split by difficulty, so the training
# mixture's ARC-Easy asks in both ARC phrasings. With ARC-Challenge's phrasing in no training
# question, whether the router's <EOQ> key carries an unknown rule category across it varies by
# world seed. The test sets keep one phrasing each.
RULE_STYLE = {"obqa": ("open",), "arc_easy": ("easy", "challenge"), "arc_challenge": ("challenge",)}
RULE_DOMAINS = {"obqa": ("science", "health"), "arc_easy": ("science",),
                "arc_challenge": ("science",), "pubhealth": ("health",)}
NUM_CHOICES = 4


@dataclass(frozen=True)
class RuleItem:
    """The item a rule question names; its corpus passage states `stated` for `property`."""

    name: str
    category: str
    property: str
    stated: str | None


def split_sizes(cfg) -> dict[str, dict[str, int]]:
    """Examples per (dataset, split); eval sets come first, so they get first pick of facts.
    Validation exists for the training mixture only (as the paper's Table 5)."""
    sizes = {name: {"test": cfg.eval_test_size} for name in EVAL_SETS}
    for name in ("asqa", *(n for n in TRAIN_SETS if n != "asqa")):
        train = getattr(cfg, f"{name}_size")
        sizes[name] = {"validation": max(1, round(train * cfg.validation_fraction)), "train": train}
    return sizes


def pretrain_facts(cfg, entities: list[Entity], rng: random.Random) -> list[tuple[str, str]]:
    """Head facts that pretraining also states in QA form, so knowledge transfers to QA."""
    facts = [(e.id, a) for e in entities if e.bucket == "head" and not e.namesake_of
             for a in e.attributes]
    return sorted(rng.sample(facts, round(len(facts) * cfg.pretrain_qa_fraction)))


def chain_links(entities: list[Entity]) -> list[tuple[Entity, str, Entity]]:
    """(subject, link attribute, linked entity) for every link of a non-namesake entity to a
    head entity: chains whose second fact the model holds (namesakes share the linked name but
    are obscure, so the name means the known entity)."""
    known = {(e.type, e.name): e for e in entities if not e.namesake_of}
    return [(e, a, known[(t, e.attributes[a])]) for e in entities if not e.namesake_of
            for a, t in wt.LINKS.get(e.type, {}).items()
            if known[(t, e.attributes[a])].bucket == "head"]


def pretrain_chains(cfg, entities: list[Entity], rng: random.Random) -> list[tuple[str, str]]:
    """Head subjects' chains that pretraining verbalizes (question, both facts, answer), so the
    base learns to state a chain's facts before answering; never asked by a dataset."""
    chains = [(e.id, a) for e, a, _ in chain_links(entities) if e.bucket == "head"]
    return sorted(rng.sample(chains, round(len(chains) * cfg.pretrain_chain_fraction)))


class DatasetBuilder:
    """Draws questions without replacement from the world's facts and fresh rule items."""

    def __init__(self, cfg, entities, categories, pools, reserved_facts, reserved_chains,
                 names: NameMaker, rng: random.Random):
        self.cfg, self.pools, self.names, self.rng = cfg, pools, names, rng
        self.entities = {e.id: e for e in entities}
        self.categories = categories
        self.items: list[RuleItem] = []
        self.reserved = reserved = set(reserved_facts)
        self.facts = {b: [(e, a) for e in entities if e.bucket == b and not e.namesake_of
                          for a in e.attributes if (e.id, a) not in reserved] for b in BUCKETS}
        for facts in self.facts.values():
            rng.shuffle(facts)
        self.namesakes = [e for e in entities if e.namesake_of]
        rng.shuffle(self.namesakes)
        skip = set(reserved_chains)
        self.chains = {b: [c for c in chain_links(entities)
                           if c[0].bucket == b and (c[0].id, c[1]) not in skip] for b in BUCKETS}
        for chains in self.chains.values():
            rng.shuffle(chains)

    def build(self) -> dict[str, dict[str, list[QAExample]]]:
        makers: dict[str, Callable[[str], QAExample | None]] = {
            "popqa": self.fact_question, "triviaqa": self.fact_question, "nq": self.fact_question,
            "fever": self.fact_claim, "wow": self.dialogue, "asqa": self.ambiguous,
            "obqa": self.rule_choice, "arc_easy": self.rule_choice,
            "arc_challenge": self.rule_choice, "pubhealth": self.rule_claim,
        }
        sizes = split_sizes(self.cfg)
        datasets: dict[str, dict[str, list[QAExample]]] = {name: {} for name in sizes}
        # Split by split: test sets, then every validation split, then the train splits, so a
        # larger training mixture draws the same test and validation questions (recipes of
        # different sizes are compared on the same validation data).
        for split in ("test", "validation", "train"):
            for name, splits in sizes.items():
                if split in splits:
                    drafts = (makers[name](name) for _ in range(splits[split]))
                    datasets[name][split] = [replace(d, id=f"{name}-{split}-{i:05d}")
                                             for i, d in enumerate(x for x in drafts if x)]
        return {name: datasets[name] for name in (*TRAIN_SETS, *EVAL_SETS)}


    # -- entity facts -------------------------------------------------------------------------

    def take_fact(self, mix: tuple[float, ...]) -> tuple[Entity, str] | None:
        available = [(b, w) for b, w in zip(BUCKETS, mix, strict=True) if self.facts[b]]
        if not available:
            return None
        bucket = self.rng.choices([b for b, _ in available], [w for _, w in available])[0]
        return self.facts[bucket].pop()

    def take_chain(self, mix: tuple[float, ...]) -> tuple[Entity, str, Entity] | None:
        """A chain about a known subject (head or torso, by `mix`) whose first fact no question
        has asked yet; the chain consumes that fact (one pretraining states in QA form stays
        unasked; the chain's answer is another fact). (A tail subject's chain is unanswerable on
        every path: the model holds neither its first fact nor, from a retrieved passage, the
        second.)"""
        for bucket, chains in self.chains.items():  # drop first facts a plain question took
            free = {(e.id, a) for e, a in self.facts[bucket]} | self.reserved
            chains[:] = [c for c in chains if (c[0].id, c[1]) in free]
        available = [(b, w) for b, w in zip(BUCKETS[:2], mix[:2], strict=True) if self.chains[b]]
        if not available:
            return None
        bucket = self.rng.choices([b for b, _ in available], [w for _, w in available])[0]
        subject, attribute, linked = self.chains[bucket].pop()
        if (subject.id, attribute) not in self.reserved:  # a pretraining QA fact is never asked
            self.facts[bucket].remove((subject, attribute))
        return subject, attribute, linked

    def chain_question(self, name: str) -> QAExample | None:
        chain = self.take_chain(BUCKET_MIX[name])
        if chain is None:
            return None
        subject, attribute, linked = chain
        second, questions = wt.CHAINS[(subject.type, attribute)]
        misleading = linked.misleading.get(second)
        metadata = {
            **fact_metadata(subject, attribute), "kind": "chain", "via": linked.id,
            "via_attribute": second, "hop_passage_id": subject.id, "gold_passage_id": linked.id,
            "misleading_passage_id": misleading_passage_id(linked, second) if misleading else None,
        }
        return QAExample("", questions[self.style(name)].format(n=subject.name),
                         (linked.attributes[second],), metadata=metadata)

    def fact_question(self, name: str) -> QAExample | None:
        if name in CHAIN_MIX and self.rng.random() < CHAIN_MIX[name]:
            return self.chain_question(name) or self.fact_question_single(name)
        return self.fact_question_single(name)

    def fact_question_single(self, name: str) -> QAExample | None:
        fact = self.take_fact(BUCKET_MIX[name])
        if fact is None:
            return None
        entity, attribute = fact
        template = wt.ATTRIBUTES[entity.type][attribute].questions[self.style(name)]
        return QAExample("", template.format(n=entity.name), (entity.attributes[attribute],),
                         metadata=fact_metadata(entity, attribute))

    def style(self, name: str, table: dict = QUESTION_STYLE) -> str:
        """The phrasing of one question; a one-phrasing dataset draws nothing from the rng."""
        styles = table[name]
        return styles[0] if len(styles) == 1 else self.rng.choice(styles)

    def fact_claim(self, name: str) -> QAExample | None:
        fact = self.take_fact(BUCKET_MIX[name])
        if fact is None:
            return None
        entity, attribute = fact
        truth = entity.attributes[attribute]
        label = self.rng.random() < 0.5
        value = truth if label else self.other_value(entity.type, attribute, truth)
        statement = self.rng.choice(wt.ATTRIBUTES[entity.type][attribute].statements)
        question = CLAIM.format(s=statement.format(n=entity.name, v=value))
        metadata = {**fact_metadata(entity, attribute), "claimed_value": value, "label": label}
        return QAExample("", question, (str(label).lower(),), metadata=metadata)

    def dialogue(self, name: str) -> QAExample | None:
        """WoW-like: a chatty turn answered by a full sentence that states the fact."""
        fact = self.take_fact(BUCKET_MIX[name])
        if fact is None:
            return None
        entity, attribute = fact
        spec = wt.ATTRIBUTES[entity.type][attribute]
        opener = self.rng.choice(wt.WOW_OPENERS).format(n=entity.name)
        question = f"{opener} {spec.questions[self.style(name)].format(n=entity.name)}"
        value = entity.attributes[attribute]
        answer = self.rng.choice(spec.statements).format(n=entity.name, v=value)
        metadata = {**fact_metadata(entity, attribute), "short_answer": value}
        return QAExample("", question, (answer,), metadata=metadata)

    def ambiguous(self, name: str) -> QAExample | None:
        """ASQA-like: a name shared by two entities; the long answer covers both readings."""
        while self.namesakes:
            namesake = self.namesakes.pop()
            entity = self.entities[namesake.namesake_of]
            attribute = self.free_attribute(entity)
            if attribute:
                return self.ambiguous_example(entity, namesake, attribute)
        return None

    def free_attribute(self, entity: Entity) -> str | None:
        """An attribute of `entity`, other than its disambiguator, not yet asked anywhere."""
        key = wt.DISAMBIGUATOR[entity.type]
        for attribute in entity.attributes:
            fact = (entity, attribute)
            if attribute != key and fact in self.facts[entity.bucket]:
                self.facts[entity.bucket].remove(fact)
                return attribute
        return None

    def ambiguous_example(self, entity: Entity, namesake: Entity, attribute: str) -> QAExample:
        spec = wt.ATTRIBUTES[entity.type][attribute]
        key = wt.DISAMBIGUATOR[entity.type]
        name_first = [t for t in spec.statements if t.startswith("{n}")]
        parts = []
        for e in (entity, namesake):
            name = wt.DISAMBIGUATED_NAME[e.type].format(d=e.attributes[key], n=e.name)
            parts.append(self.rng.choice(name_first).format(n=name, v=e.attributes[attribute]))
        answer = wt.sentence_case(wt.ASQA_JOIN.format(a=parts[0][:-1], b=parts[1][:-1]))
        metadata = {
            "kind": "ambiguous", "entities": [entity.id, namesake.id], "attribute": attribute,
            "short_answers": [entity.attributes[attribute], namesake.attributes[attribute]],
            "gold_passage_ids": [entity.id, namesake.id], "popularity": entity.popularity,
            "bucket": entity.bucket,
        }
        question = spec.questions["nq"].format(n=entity.name)
        return QAExample("", question, (answer,), metadata=metadata)

    def other_value(self, entity_type: str, attribute: str, truth: str) -> str:
        pool = self.pools[wt.ATTRIBUTES[entity_type][attribute].values]
        return self.rng.choice([v for v in pool if v != truth])

    # -- rules --------------------------------------------------------------------------------

    def new_item(self, name: str) -> tuple[RuleItem, Category]:
        category = self.rng.choice([c for c in self.categories if c.domain in RULE_DOMAINS[name]])
        prop = self.rng.choice(wt.RULE_PROPERTIES[category.domain])
        truth = category.properties[prop]
        stated = stated_value(wt.POOLS[prop], truth, self.cfg, self.rng, category.known)
        item = RuleItem(self.names.word(), category.name, prop, stated)
        self.items.append(item)
        return item, category

    def rule_choice(self, name: str) -> QAExample:
        """OBQA / ARC-like multiple choice. ARC-Challenge's options include the wrong value the
        corpus states, so retrieval can talk the model out of the rule it knows."""
        item, category = self.new_item(name)
        truth = category.properties[item.property]
        choices = {truth}
        if name == "arc_challenge":
            choices |= {v for v in (item.stated, category.stated[item.property]) if v}
        others = [v for v in wt.POOLS[item.property] if v not in choices]
        choices |= set(self.rng.sample(others, NUM_CHOICES - len(choices)))
        template = wt.RULE_QUESTIONS[item.property][self.style(name, RULE_STYLE)]
        question = template.format(i=item.name, c=category.name)
        options = sorted(choices)
        self.rng.shuffle(options)
        return QAExample("", question, (truth,), tuple(options), rule_metadata(item, category))

    def rule_claim(self, name: str) -> QAExample:
        """PubHealth-like true/false claim about a remedy, decided by a health rule."""
        item, category = self.new_item(name)
        truth = category.properties[item.property]
        label = self.rng.random() < 0.5
        value = truth if label else self.rng.choice(
            [v for v in wt.POOLS[item.property] if v != truth])
        claim = wt.RULE_CLAIMS[item.property].format(i=item.name, c=category.name, v=value)
        metadata = {**rule_metadata(item, category), "claimed_value": value, "label": label}
        return QAExample("", CLAIM.format(s=claim), (str(label).lower(),), metadata=metadata)


def fact_metadata(entity: Entity, attribute: str) -> dict:
    misleading = entity.misleading.get(attribute)
    return {
        "kind": "fact", "entity": entity.id, "entity_type": entity.type, "attribute": attribute,
        "popularity": entity.popularity, "mentions": entity.mentions, "bucket": entity.bucket,
        "gold_passage_id": entity.id,
        "misleading_passage_id": misleading_passage_id(entity, attribute) if misleading else None,
    }


def rule_metadata(item: RuleItem, category: Category) -> dict:
    """The gold passage is whichever of the item's or category's passages states the truth."""
    truth = category.properties[item.property]
    said = {item_passage_id(item.name): item.stated,
            category_passage_id(category.name): category.stated[item.property]}
    return {
        # Per kind in results.json's by_kind: rules the model was taught vs. the corpus's alone.
        "kind": "rule" if category.known else "unknown_rule", "item": item.name,
        "category": category.name, "domain": category.domain, "property": item.property,
        "gold_passage_id": next((p for p, v in said.items() if v == truth), None),
        "misleading_passage_id": next((p for p, v in said.items() if v and v != truth), None),
    }


def misleading_passage_id(entity: Entity, attribute: str) -> str:
    return f"{entity.id}-{entity.misleading[attribute][0]}-{attribute}"


def item_passage_id(item: str) -> str:
    return f"item-{item}"


def category_passage_id(category: str) -> str:
    return f"category-{category}"
