"""What the embedded world's base model knows (`W/base/metrics.json`): closed-book accuracy on
held-out questions about popular and about tail entities, and accuracy with the gold passage in
context (issue: popular >= 0.8, tail <= 0.3, tail with the gold passage >= 0.8).

Prompts are the base model's (`prompts.base_prompt_text`), as in pretraining; an answer counts
when its normalized text starts with the normalized gold value. `gold_passage_*_from_passage`
is the fraction of answers whose first word occurs in the gold passage: it tells a model that
reads but picks the wrong word (high) from one that ignores the passage (= accuracy).
`fresh_reading` is the accuracy on fact questions about fresh entities (never in pretraining,
never a test question) asked as the pipeline asks: the base stage's reading gate reads it. Its
knowledge is what retrieval returns (`retrieved_passages`: `retrieval.n_passages` passages in the
index's `(Title: T) text` lines, the gold one among same-type fresh distractors at a random rank)
in both prompts the pipeline puts passages in: the base prompt (`Question: q Background
knowledge: ... Answer:`, as construct's labelling and the untuned always-RAG read them) and the
routed Wiki row (`Question: q Background knowledge:<EOQ><Wiki> passages<EOK> Answer:`, truncated
at `inference.max_knowledge_tokens`, as `route()` builds it). The gate reads the base prompt: it is
what the pipeline asks of the base (construct's labels, the untuned baselines), while the routed
row's SR-RAG tokens are still untrained in the base (pretraining never writes them; stage 1 teaches
them), so `routed_prompt` is recorded beside it as a diagnostic, not gated on.
`genread_popular` / `genread_rule` are the fractions of greedy GenRead documents (the base
model's verbalizations, SR-RAG's <Self> knowledge) that state the gold answer, for popular-entity
questions and for rule questions (the ARC-Challenge analogue); `*_chain`: see `chain_knowledge`.
`claim_reading` is the accuracy of true/false judgements of fresh claims with the passage that
decides them in context (FEVER's and PubHealth's condition, on either knowledge path); 0.5 is
chance.
"""

from __future__ import annotations

import random

from jaxrag.data.schema import QAExample
from jaxrag.decode.sampler import generate
from jaxrag.eval.metrics import normalize_answer
from jaxrag.models.tokens import WIKI, source_token
from jaxrag.prompts import (answer_prefix_ids, base_prompt_ids, base_prompt_text, genread_prompt_text,
                            knowledge_ids, prompt_ids)
from jaxrag.retrieval.corpus import Passage
from jaxrag.world import pretrain as wp
from jaxrag.world import text as wt
from jaxrag.world.entities import NameMaker

EVAL_SETS = ("popqa", "triviaqa")
BUCKETS = {"head": "popular", "torso": "torso", "tail": "tail"}


def _answers(model, prompts: list[str], max_new: int = 6, batch_size: int = 32) -> list[str]:
    """Greedy continuations of base-model prompts (text)."""
    return _generate_ids(model, base_prompt_ids(model.tokenizer, prompts), max_new, batch_size)


def states_answer(documents: list[str], golds: list[str]) -> float:
    """Fraction of documents whose normalized words contain the normalized gold answer (whole
    words, unlike `metrics.substring_match`: a document naming "Parisville" does not state "Paris")."""
    hits = [f" {normalize_answer(g)} " in f" {normalize_answer(d)} " for d, g in zip(documents, golds)]
    return sum(hits) / max(1, len(hits))


def answer_scores(answers: list[str], golds: list[str], passages: list[str] | None = None) -> dict:
    """`accuracy` (the normalized answer starts with the normalized gold) and, given passages,
    `from_passage` (the answer's first normalized word is a word of its passage)."""
    n = max(1, len(answers))
    norm = [normalize_answer(a) for a in answers]
    out = {"accuracy": sum(a.startswith(normalize_answer(g)) for a, g in zip(norm, golds)) / n}
    if passages is not None:
        first = [a.split()[0] if a else "" for a in norm]
        out["from_passage"] = sum(bool(w) and w in normalize_answer(p).split() for w, p in zip(first, passages)) / n
    return out


def fresh_reading_questions(world, n: int, passages: int = 1) -> list[tuple[str, list[str], str]]:
    """(question, [gold passage, then passages - 1 same-type distractors], answer) about fresh
    entities, passages in the world's `title\ntext` form: a random stream of its own, so neither
    pretraining nor any dataset of the world holds them."""
    rng = random.Random(f"{world.config.seed}:fresh_reading")
    names = NameMaker(rng, world.reserved_words())
    out = []
    for _ in range(n):
        draft, found, _ = wp.fact_reading(world, "fact", passages, names, rng)
        out.append((draft.question, found, draft.golden_answers[0]))
    return out


def retrieved_passages(passages: list[str], rng: random.Random) -> list[str]:
    """World passages (`title\ntext`, gold first) as retrieval hands them to a prompt: each as
    the index's prompt line `(Title: T) text` (`Passage.to_prompt`), the gold one at a uniformly
    drawn rank among the distractors (retrieval does not always rank it first)."""
    lines = [Passage("", *p.split("\n", 1)).to_prompt() for p in passages]
    gold, rest = lines[0], lines[1:]
    rest.insert(rng.randrange(len(lines)), gold)
    return rest


def routed_reading_prompts(tokenizer, wiki_id: int, questions: list[str], passages: list[list[str]],
                           max_knowledge_tokens: int) -> list[list[int]]:
    """A Wiki row's ids up to its answer, exactly as `route()` builds them: the prompt through
    `<EOQ>`, `<Wiki>`, the passages' knowledge tokens cut at `max_knowledge_tokens`, `<EOK> Answer:`."""
    tail = answer_prefix_ids(tokenizer)
    return [q + [wiki_id] + k[:max_knowledge_tokens] + tail
            for q, k in zip(prompt_ids(tokenizer, questions), knowledge_ids(tokenizer, passages))]


def fresh_rule_questions(world, n: int) -> list[tuple[str, str]]:
    """(question with its choices, the rule's value) about fresh items of the world's known
    categories: the rule is the world's (pretraining states it), the item is new (a random
    stream of its own, so no dataset of the world holds the question)."""
    rng = random.Random(f"{world.config.seed}:fresh_rules")
    names = NameMaker(rng, world.reserved_words())
    out = []
    for _ in range(n):
        category = rng.choice(world.known_categories)
        prop = rng.choice(wt.RULE_PROPERTIES[category.domain])
        truth = category.properties[prop]
        choices = [truth, *rng.sample([v for v in wt.POOLS[prop] if v != truth], 3)]
        rng.shuffle(choices)
        template = wt.RULE_QUESTIONS[prop][rng.choice(sorted(wt.RULE_QUESTIONS[prop]))]
        ex = QAExample("", template.format(i=names.word(), c=category.name), (truth,), tuple(choices))
        out.append((ex.prompt_question(), truth))
    return out


def fresh_claim_questions(world, n: int) -> list[tuple[str, list[str], str]]:
    """(claim, [the passage that decides it], "true"/"false"): alternately a claim about a fresh
    entity with its passage, and a rule claim about a fresh item of the world's known categories
    with the rule applied to it (as a verbalization states it); a random stream of its own, so no
    dataset of the world holds them."""
    rng = random.Random(f"{world.config.seed}:fresh_claims")
    names = NameMaker(rng, world.reserved_words())
    out = []
    for i in range(n):
        if i % 2 == 0:
            draft, passages, _ = wp.fact_reading(world, "claim", 1, names, rng)
        else:
            category = rng.choice(world.known_categories)
            prop, item = rng.choice(wt.RULE_PROPERTIES[category.domain]), names.word()
            draft = wp.rule_example(category, "claim", item, prop, rng)
            passages = [wt.RULE_APPLICATIONS[prop].format(i=item, c=category.name, v=category.properties[prop])]
        out.append((draft.question, passages, draft.golden_answers[0]))
    return out


def fresh_claim_reading(model, world, n: int) -> float:
    """Accuracy of true/false answers on `n` fresh claims, the deciding passage in context."""
    return _accuracy_in_context(model, fresh_claim_questions(world, n))


def fresh_rule_verbalization(model, world, n: int, verbal_tokens: int) -> float:
    """Fraction of greedy GenRead documents that state the rule, on `n` fresh rule questions."""
    questions = fresh_rule_questions(world, n)
    docs = _answers(model, [genread_prompt_text(q) for q, _ in questions], verbal_tokens)
    return states_answer(docs, [truth for _, truth in questions])


def fresh_reading(model, world, n: int, passages: int = 1, max_knowledge_tokens: int | None = None) -> dict:
    """Reading on `n` fresh-entity fact questions with `passages` retrieved-format passages
    (`retrieved_passages`): accuracy in the base prompt (`base_prompt`, also the gate's
    `reading`) and in the routed Wiki row's prompt (`routed_prompt`; needs the model's SR-RAG
    tokens, untrained in a base: a diagnostic)."""
    rng = random.Random(f"{world.config.seed}:fresh_reading_ranks")
    questions = [(q, retrieved_passages(ps, rng), a) for q, ps, a in fresh_reading_questions(world, n, passages)]
    golds = [a for *_, a in questions]
    base = _accuracy_in_context(model, questions)
    tok = model.tokenizer
    ids = routed_reading_prompts(tok, model.token_id(source_token(WIKI)), [q for q, *_ in questions],
                                 [p for _, p, _ in questions], max_knowledge_tokens or 10 ** 9)
    routed = answer_scores(_generate_ids(model, ids), golds)["accuracy"]
    return {"reading": base, "base_prompt": base, "routed_prompt": routed}


def _accuracy_in_context(model, questions: list[tuple[str, list[str], str]]) -> float:
    """Accuracy on (question, passages, answer) triples, the passages in the base prompt."""
    answers = _answers(model, [base_prompt_text(q, p) for q, p, _ in questions])
    return answer_scores(answers, [a for *_, a in questions])["accuracy"]


def _generate_ids(model, prompts: list[list[int]], max_new: int = 6, batch_size: int = 32) -> list[str]:
    tok, answers = model.tokenizer, []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    for start in range(0, len(prompts), batch_size):
        answers += [tok.decode(out, skip_special_tokens=True)
                    for out in generate(model.decoder, prompts[start:start + batch_size], max_new, stop_ids=eos)]
    return answers


def chain_knowledge(model, world, n: int, verbal_tokens: int, rng: random.Random) -> dict:
    """Chain questions about head subjects: answered directly
    (`closed_book_chain`), whether a greedy GenRead document states the answer
    (`genread_chain`), and answered from that document (`chain_after_verbalizing`): the world's
    knowledge usable only after verbalizing it shows as the last far above the first."""
    chains = [ex for name in EVAL_SETS for ex in world.datasets()[name]["test"]
              if ex.metadata["kind"] == "chain" and ex.metadata["bucket"] == "head"]
    chains = rng.sample(chains, min(n, len(chains)))
    golds = [ex.golden_answers[0] for ex in chains]
    closed = _answers(model, [base_prompt_text(ex.question) for ex in chains])
    docs = _answers(model, [genread_prompt_text(ex.question) for ex in chains], verbal_tokens)
    read = _answers(model, [base_prompt_text(ex.question, [d]) for ex, d in zip(chains, docs)])
    return {"closed_book_chain": answer_scores(closed, golds)["accuracy"],
            "genread_chain": states_answer(docs, golds),
            "chain_after_verbalizing": answer_scores(read, golds)["accuracy"],
            "n_chain": len(chains)}


def probe_world_knowledge(model, world, n: int, verbal_tokens: int = 48) -> dict:
    """Accuracies on up to `n` test questions per bucket, from the PopQA/TriviaQA analogues;
    GenRead documents of up to `verbal_tokens` tokens."""
    passages = {p["id"]: p["contents"] for p in world.corpus()}
    by_bucket: dict[str, list] = {b: [] for b in BUCKETS}
    for name in EVAL_SETS:
        for ex in world.datasets()[name]["test"]:
            if ex.metadata["kind"] == "fact" and ex.metadata["bucket"] in by_bucket:
                by_bucket[ex.metadata["bucket"]].append(ex)
    rng = random.Random(0)
    out = {}
    for bucket, examples in by_bucket.items():
        examples = rng.sample(examples, min(n, len(examples)))
        golds = [ex.golden_answers[0] for ex in examples]
        gold = [passages[ex.metadata["gold_passage_id"]] for ex in examples]
        closed = _answers(model, [base_prompt_text(ex.question) for ex in examples])
        read = _answers(model, [base_prompt_text(ex.question, [p]) for ex, p in zip(examples, gold)])
        name = BUCKETS[bucket]
        out[f"closed_book_{name}"] = answer_scores(closed, golds)["accuracy"]
        scores = answer_scores(read, golds, gold)
        out[f"gold_passage_{name}"] = scores["accuracy"]
        out[f"gold_passage_{name}_from_passage"] = scores["from_passage"]
        out[f"n_{name}"] = len(examples)
        if name == "popular":
            docs = _answers(model, [genread_prompt_text(ex.question) for ex in examples], verbal_tokens)
            out["genread_popular"] = states_answer(docs, golds)
    out.update(chain_knowledge(model, world, n, verbal_tokens, rng))
    rules = world.datasets()["arc_challenge"]["test"]
    rules = rng.sample(rules, min(n, len(rules)))
    docs = _answers(model, [genread_prompt_text(ex.prompt_question()) for ex in rules], verbal_tokens)
    out["genread_rule"] = states_answer(docs, [ex.golden_answers[0] for ex in rules])
    out["n_rule"] = len(rules)
    out["claim_reading"] = fresh_claim_reading(model, world, 2 * n)
    return out
