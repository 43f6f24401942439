"""Pretraining text of the embedded world, regenerated (re-phrased, re-sampled) every epoch.

Parts: `bio` (each known entity's facts, `mentions` times, in varied phrasings), `rule` (rules and
worked applications; the corpus covers rules poorly), `qa` (closed-book QA for reserved head
facts and for rules, so knowledge transfers to question form), `verbalize` (questions answered
with a knowledge document from memory, in SR-RAG's and GenRead's formats; chain questions with
both their facts, never in closed-book form) and `rc` (reading
comprehension over FRESH entities with random values, so the model learns to copy from context
rather than memorise a fixed pool; each example asks every fact its passages state, so one
passage teaches several copies).
"""

from __future__ import annotations

import random

from jaxrag.data.schema import CLAIM, QAExample
from jaxrag.prompts import ANSWER_PREFIX, base_prompt_text, genread_prompt_text
from jaxrag.world import text as wt
from jaxrag.world.corpus import entity_passage, with_fillers
from jaxrag.world.entities import ENTITY_TYPES, Category, Entity, NameMaker

RC_KINDS = {"fact": 0.55, "claim": 0.15, "dialogue": 0.1, "rule": 0.12, "rule_claim": 0.08}
RULE_FORMS = ("open", "easy", "challenge", "claim")


# A pretraining document: plain text (loss on every token) or an instruction-format example
# `(prompt, completion, follow-up prompt, completion, ...)` with the loss on the completions
# only, as in instruction tuning: in a reading-comprehension example the ~150 passage tokens are
# unpredictable noise that would otherwise drown the answer tokens copying is learnt from.
Document = str | tuple[str, ...]


def document_text(doc: Document) -> str:
    return doc if isinstance(doc, str) else "".join(doc)


def pretraining_parts(world, epoch: int) -> dict[str, list[Document]]:
    rng = random.Random(f"{world.config.seed}:pretrain:{epoch}")
    names = NameMaker(rng, world.reserved_words())
    examples = reading_comprehension(world, world.config.rc_docs_per_epoch, names, rng)
    return {
        "bio": [bio(e, rng) for e in world.entities for _ in range(e.mentions)],
        "rule": rule_texts(world, names, rng),
        "qa": closed_book_texts(world, names, rng),
        "verbalize": verbalization_texts(world, names, rng),
        "rc": [knowledge_text(ex.prompt_question(), ex.metadata["passages"], ex.golden_answers[0])
               + followups(ex.metadata["followups"]) for ex in examples],
    }


def closed_book_text(question: str, answer: str) -> tuple[str, str]:
    return base_prompt_text(question), f" {answer}"


def knowledge_text(question: str, passages: list[str], answer: str) -> tuple[str, str]:
    return base_prompt_text(question, passages), f" {answer}"


def followups(questions: list[tuple[str, str]]) -> tuple[str, ...]:
    """Further questions on the same passages, each answered after it: `Question: q Answer: a`."""
    return tuple(t for q, a in questions for t in (f"\n{base_prompt_text(q)}", f" {a}"))


def bio(entity: Entity, rng: random.Random, first: str | None = None) -> str:
    """The entity's facts in random order and phrasing; attribute `first` opens it."""
    facts = {a: rng.choice(wt.ATTRIBUTES[entity.type][a].statements).format(n=entity.name, v=v)
             for a, v in entity.attributes.items()}
    order = list(facts)
    rng.shuffle(order)
    if first is not None:
        order.remove(first)
        order.insert(0, first)
    return " ".join(facts[a] for a in order)


def fact_question(entity: Entity, attribute: str, rng: random.Random) -> str:
    style = rng.choice(wt.QUESTION_STYLES)
    return wt.ATTRIBUTES[entity.type][attribute].questions[style].format(n=entity.name)


def rule_texts(world, names: NameMaker, rng: random.Random) -> list[str]:
    """Each rule stated `rule_mentions` times, half as a bare rule, half applied to an item;
    grouped into short textbook-like paragraphs."""
    sentences = []
    for category in world.known_categories:
        for prop, value in category.properties.items():
            for k in range(world.config.rule_mentions):
                sentences.append(
                    rng.choice(wt.RULE_STATEMENTS[prop]).format(c=category.name, v=value)
                    if k % 2 == 0 else
                    wt.RULE_APPLICATIONS[prop].format(c=category.name, v=value, i=names.word()))
    rng.shuffle(sentences)
    return [" ".join(sentences[i:i + 6]) for i in range(0, len(sentences), 6)]


def closed_book_texts(world, names: NameMaker, rng: random.Random) -> list[tuple[str, str]]:
    texts = []
    for entity, attribute in world.pretrain_qa_facts():
        for _ in range(world.config.pretrain_qa_repeats):
            texts.append(closed_book_text(fact_question(entity, attribute, rng),
                                          entity.attributes[attribute]))
        claim = fact_claim(world, entity, attribute, rng)
        texts.append(closed_book_text(claim.question, claim.golden_answers[0]))
    for _ in range(world.config.rule_qa_per_epoch):
        category = rng.choice(world.known_categories)
        ex = rule_example(category, rng.choice(RULE_FORMS), names.word(), None, rng)
        texts.append(closed_book_text(ex.prompt_question(), ex.golden_answers[0]))
    rng.shuffle(texts)
    return texts


def verbalization_texts(world, names: NameMaker, rng: random.Random) -> list[tuple[str, ...]]:
    """A question followed by a knowledge document written from memory, so a base model can
    verbalize knowledge (SR-RAG's <Self> path, GenRead in data construction)."""
    texts = []
    for entity, attribute in world.pretrain_qa_facts():
        # The asked fact first, as a question-focused GenRead document: a greedy verbalization
        # cut at the token budget then still states it.
        question = fact_question(entity, attribute, rng)
        texts.append(verbalized(question, bio(entity, rng, attribute), entity.attributes[attribute], rng))
    for subject, attribute, linked in world.pretrain_chain_facts():
        # Both facts, in the order the answer needs them: the chain's verbalization.
        second, questions = wt.CHAINS[(subject.type, attribute)]
        question = questions[rng.choice(wt.QUESTION_STYLES)].format(n=subject.name)
        texts.append(verbalized(question, chain_document(subject, attribute, linked, rng),
                                linked.attributes[second], rng))
    for _ in range(world.config.rule_verbalize_per_epoch):
        category, item = rng.choice(world.known_categories), names.word()
        prop = rng.choice(tuple(category.properties))
        ex = rule_example(category, rng.choice(RULE_FORMS), item, prop, rng)
        # Item and category first, as the question names them (a fact document likewise opens
        # with its entity): the writer copies them, then recalls the rule. Rule-first documents
        # left the base model writing rules about unrelated categories.
        templates = [wt.RULE_APPLICATIONS[prop], rng.choice(wt.RULE_STATEMENTS[prop])]
        document = " ".join(templates).format(c=category.name, v=category.properties[prop], i=item)
        texts.append(verbalized(ex.prompt_question(), document, ex.golden_answers[0], rng))
    return texts


def chain_document(subject: Entity, attribute: str, linked: Entity, rng: random.Random) -> str:
    """A chain's two facts: the subject's link, then the linked entity's asked fact."""
    second = wt.CHAINS[(subject.type, attribute)][0]
    return " ".join(
        rng.choice(wt.ATTRIBUTES[e.type][a].statements).format(n=e.name, v=e.attributes[a])
        for e, a in ((subject, attribute), (linked, second)))


def verbalized(question: str, document: str, answer: str, rng: random.Random) -> tuple[str, ...]:
    """Half GenRead's zero-shot prompt, half SR-RAG's form without its tokens: the model writes
    the document after `Background knowledge:` and answers from it (loss on both), as the <Self>
    path will. (With a quarter of them as one-shot GenRead prompts instead, the base reads far
    worse, gold passage tail 0.24, and writes no better rule documents.)"""
    if rng.random() < 0.5:
        return genread_prompt_text(question), f" {document}"
    head = base_prompt_text(question, [document]).removesuffix(f" {document}{ANSWER_PREFIX}")
    return head, f" {document}", ANSWER_PREFIX, f" {answer}"


def fact_claim(world, entity: Entity, attribute: str, rng: random.Random) -> QAExample:
    truth = entity.attributes[attribute]
    label = rng.random() < 0.5
    pool = world.pools[wt.ATTRIBUTES[entity.type][attribute].values]
    value = truth if label else rng.choice([v for v in pool if v != truth])
    statement = rng.choice(wt.ATTRIBUTES[entity.type][attribute].statements)
    return QAExample("", CLAIM.format(s=statement.format(n=entity.name, v=value)),
                     (str(label).lower(),))


def rule_example(category, form: str, item: str, prop: str | None,
                 rng: random.Random) -> QAExample:
    """A rule question about `item` (a member of `category`): multiple choice in one of the
    three question styles, or a true/false claim."""
    prop = prop or rng.choice(tuple(category.properties))
    truth = category.properties[prop]
    if form == "claim":
        label = rng.random() < 0.5
        value = truth if label else rng.choice([v for v in wt.POOLS[prop] if v != truth])
        claim = wt.RULE_CLAIMS[prop].format(i=item, c=category.name, v=value)
        return QAExample("", CLAIM.format(s=claim), (str(label).lower(),))
    others = rng.sample([v for v in wt.POOLS[prop] if v != truth], 3)
    choices = [truth, *others]
    rng.shuffle(choices)
    question = wt.RULE_QUESTIONS[prop][form].format(i=item, c=category.name)
    return QAExample("", question, (truth,), tuple(choices))


# -- reading comprehension over fresh entities --------------------------------------------------


def reading_comprehension(world, n: int, names: NameMaker,
                          rng: random.Random) -> list[QAExample]:
    """`n` fresh examples: 1..`rc_max_passages` passages about fresh entities or items (one of
    them gold, at a random position), a question only the gold passage answers and, in
    metadata `followups`, `(question, answer)` for every other fact the passages state."""
    examples = []
    for i in range(n):
        kind = rng.choices(list(RC_KINDS), list(RC_KINDS.values()))[0]
        count = passage_count(world.config, rng)
        maker = fact_reading if kind in ("fact", "claim", "dialogue") else rule_reading
        draft, passages, more = maker(world, kind, count, names, rng)
        gold = rng.randrange(count)
        passages.insert(gold, passages.pop(0))
        examples.append(QAExample(f"rc-{i:05d}", draft.question, draft.golden_answers,
                                  draft.choices, {"kind": kind, "passages": passages,
                                                  "gold_index": gold, "followups": more}))
    return examples


def passage_count(cfg, rng: random.Random) -> int:
    count = 1
    while count < cfg.rc_max_passages and rng.random() < cfg.rc_extra_passage_prob:
        count += 1
    return count


def rc_words(cfg, rng: random.Random) -> int:
    """Reading-comprehension passages run from bare facts to the corpus's full length: short
    ones put more copy examples in each token of training, long ones match the corpus."""
    return rng.randint(cfg.passage_words // 4, cfg.passage_words)


def fact_reading(world, kind: str, count: int, names: NameMaker, rng: random.Random):
    """Question about the first of `count` fresh same-type entities (the others distract)."""
    entity_type = rng.choice(ENTITY_TYPES)
    entities = [fresh_entity(world, entity_type, names, rng) for _ in range(count)]
    cities = world.pools["city"]
    passages = [f"{e.name}\n{entity_passage(e, cities, rc_words(world.config, rng), rng)}"
                for e in entities]
    entity, attribute = entities[0], rng.choice(tuple(entities[0].attributes))
    spec = wt.ATTRIBUTES[entity_type][attribute]
    value = entity.attributes[attribute]
    more = [(fact_question(e, a, rng), v) for e in entities for a, v in e.attributes.items()
            if (e, a) != (entity, attribute)]
    rng.shuffle(more)
    if kind == "claim":
        return fact_claim(world, entity, attribute, rng), passages, more
    question = fact_question(entity, attribute, rng)
    if kind == "dialogue":
        opener = rng.choice(wt.WOW_OPENERS).format(n=entity.name)
        answer = rng.choice(spec.statements).format(n=entity.name, v=value)
        return QAExample("", f"{opener} {question}", (answer,)), passages, more
    return QAExample("", question, (value,)), passages, more


def fresh_entity(world, entity_type: str, names: NameMaker, rng: random.Random) -> Entity:
    """An entity that exists only in this example: new name, random values."""
    attributes = {a: rng.choice(world.pools[spec.values])
                  for a, spec in wt.ATTRIBUTES[entity_type].items()}
    return Entity("fresh", entity_type, fresh_name(world, entity_type, names, rng), attributes,
                  1, 0, "tail")


def fresh_name(world, entity_type: str, names: NameMaker, rng: random.Random) -> str:
    """A new word, or for people a new pairing of the world's first and last names."""
    if entity_type != "person":
        return names.name()
    while True:
        name = f"{rng.choice(world.pools['first_name'])} {rng.choice(world.pools['last_name'])}"
        if name not in world.person_names:
            return name


def rule_reading(world, kind: str, count: int, names: NameMaker, rng: random.Random):
    """A rule question about a fresh category, answerable only by copying from the passage
    about its item (fresh categories never contradict the world's rules)."""
    domain = rng.choice(tuple(wt.RULE_PROPERTIES))
    prop = rng.choice(wt.RULE_PROPERTIES[domain])
    passages = []
    for _ in range(count):
        item, category = names.word(), names.word()
        value = rng.choice(wt.POOLS[prop])
        facts = [wt.RULE_APPLICATIONS[prop].format(i=item, c=category, v=value)]
        text = with_fillers(facts, item, world.pools["city"], rc_words(world.config, rng), rng)
        passages.append((item, category, value, f"{wt.sentence_case(item)}\n{text}"))
    examples = [rule_example(Category(category, domain, {prop: value}, {}),
                             "claim" if kind == "rule_claim" else rng.choice(RULE_FORMS[:3]),
                             item, prop, rng) for item, category, value, _ in passages]
    more = [(ex.prompt_question(), ex.golden_answers[0]) for ex in examples[1:]]
    return examples[0], [p[3] for p in passages], more

