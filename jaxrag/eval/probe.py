"""What the embedded world's base model knows: closed-book accuracy by popularity bucket and
accuracy with the gold passage in context (issue: head >= 0.8, tail <= 0.3, tail+gold >= 0.8).

Prompts are the world's pretraining formats (`Question: q Answer: a`, and with
`Background knowledge: {passage}`); an answer counts when the gold value is its first word.
"""

from __future__ import annotations

import random

from jaxrag.data.world_pretrain import closed_book_text, knowledge_text
from jaxrag.decode.sampler import generate

EVAL_SETS = ("popqa", "triviaqa")


def _prompt(text: str, answer: str) -> str:
    return text[: text.rindex(answer)].rstrip()  # the format up to "Answer:"


def _accuracy(model, prompts: list[str], golds: list[str], batch_size: int = 32) -> float:
    tok, correct = model.tokenizer, 0
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    for start in range(0, len(prompts), batch_size):
        ids = [tok(p)["input_ids"] for p in prompts[start:start + batch_size]]
        for out, gold in zip(generate(model.decoder, ids, 3, stop_ids=eos), golds[start:start + batch_size]):
            words = tok.decode(out, skip_special_tokens=True).split()
            correct += bool(words) and words[0].strip(".,").lower() == gold.lower()
    return correct / max(1, len(prompts))


def probe_world_knowledge(model, world, n: int) -> dict:
    """Accuracies on up to `n` test questions per bucket, from the PopQA/TriviaQA analogues."""
    passages = {p["id"]: p["contents"] for p in world.corpus()}
    by_bucket: dict[str, list] = {"head": [], "tail": []}
    for name in EVAL_SETS:
        for ex in world.datasets()[name]["test"]:
            if ex.metadata.get("bucket") in by_bucket and ex.metadata.get("gold_passage_id"):
                by_bucket[ex.metadata["bucket"]].append(ex)
    rng = random.Random(0)
    out = {}
    for bucket, examples in by_bucket.items():
        examples = rng.sample(examples, min(n, len(examples)))
        golds = [ex.golden_answers[0] for ex in examples]
        closed = [_prompt(closed_book_text(ex.question, g), g) for ex, g in zip(examples, golds)]
        gold_ctx = [_prompt(knowledge_text(ex.question, [passages[ex.metadata["gold_passage_id"]]], g), g)
                    for ex, g in zip(examples, golds)]
        out[f"closed_book_{bucket}"] = _accuracy(model, closed, golds)
        out[f"gold_passage_{bucket}"] = _accuracy(model, gold_ctx, golds)
        out[f"n_{bucket}"] = len(examples)
    return out
