"""SR-RAG's sequence format, in one place for training, decoding and evaluation (paper §3.1):

    Question: {q} Background knowledge:<EOQ><s> {knowledge}<EOK> Answer: {a}</s>

With a chat template, `Question: {q}` is the user turn and the rest follows the assistant
header, so the model routes, verbalizes and answers inside its own reply. Training and inference
build token ids with the same functions below, so inference sees exactly the trained ids.
"""

from __future__ import annotations

from jaxrag.models.tokens import EOK, EOQ

ANSWER_PREFIX = " Answer:"
GENREAD_PROMPT = (
    "Generate a background document from Wikipedia to help answer the following question. "
    "Directly start with document content and do not generate URL.\nQuestion: {question}\nBackground document:"
)
GENREAD_DEMO_SEPARATOR = "\n\n"
GENREAD_AMBIGUOUS = " If the question is ambiguous, generate multiple documents for each possibility."


def join_passages(passages: list[str]) -> str:
    """Several passages as one knowledge string (one per line)."""
    return "\n".join(p.strip() for p in passages)


# Token ids of the prompt pieces: the single definition training and inference share.

def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def prompt_text(tokenizer, question: str) -> str:
    """Everything before `<EOQ>`; the chat template wraps the question as the user turn."""
    if getattr(tokenizer, "chat_template", None):
        turn = [{"role": "user", "content": f"Question: {question}"}]
        return tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) + "Background knowledge:"
    return f"Question: {question} Background knowledge:"


def prompt_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    """Token ids up to and including `<EOQ>`. Without a chat template the tokenizer adds its
    usual special tokens (BOS for Llama), as for pretraining text; a template writes its own."""
    eoq = tokenizer.convert_tokens_to_ids(EOQ)
    texts = [prompt_text(tokenizer, q) for q in questions]
    specials = not getattr(tokenizer, "chat_template", None)
    return [ids + [eoq] for ids in tokenizer(texts, add_special_tokens=specials)["input_ids"]]


def knowledge_ids(tokenizer, passages_per_row: list[list[str]]) -> list[list[int]]:
    """Knowledge between `<s>` and `<EOK>`: passages joined by newlines, after one space; no
    passages (the no-retrieval source) is no tokens."""
    ids = _encode(tokenizer, [" " + join_passages(ps) for ps in passages_per_row])
    return [row if ps else [] for row, ps in zip(ids, passages_per_row)]


def answer_prefix_ids(tokenizer) -> list[int]:
    """`<EOK> Answer:`: appended after the knowledge, never a training target."""
    return [tokenizer.convert_tokens_to_ids(EOK)] + _encode(tokenizer, [ANSWER_PREFIX])[0]


def answer_ids(tokenizer, answers: list[str]) -> list[list[int]]:
    """` {a}` + EOS (the model learns to stop)."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return [ids + eos for ids in _encode(tokenizer, [" " + a.strip() for a in answers])]


# The untuned (base) model's prompts: data construction's likelihoods p_M(a | q, c) and
# p_M(a | q), GenRead verbalization, and the untuned baselines. No SR-RAG tokens: the base model
# has never seen them. The embedded world pretrains on exactly these forms.

def base_prompt_text(question: str, passages: list[str] | None = None) -> str:
    """`Question: q[ Background knowledge: k] Answer:` (the answer follows after one space)."""
    knowledge = f" Background knowledge: {join_passages(passages)}" if passages else ""
    return f"Question: {question}{knowledge}{ANSWER_PREFIX}"


def genread_prompt_text(question: str, ambiguous: bool = False) -> str:
    """GenRead's zero-shot verbalization prompt (paper Fig. 5); the document follows one space."""
    prompt = GENREAD_PROMPT.format(question=question)
    return prompt.replace("\nQuestion:", GENREAD_AMBIGUOUS + "\nQuestion:", 1) if ambiguous else prompt


def genread_fewshot_text(demos: list[tuple[str, str]], question: str, ambiguous: bool = False) -> str:
    """GenRead's clustering-based prompt (round 2): each (question, document) demonstration as a
    completed zero-shot prompt, then the question's own prompt."""
    parts = [f"{genread_prompt_text(q, ambiguous)} {d}" for q, d in demos]
    return GENREAD_DEMO_SEPARATOR.join([*parts, genread_prompt_text(question, ambiguous)])


def base_prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of base-model prompts, inside the chat template (as the user turn) when there
    is one, with the tokenizer's usual special tokens (BOS) otherwise."""
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
        return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return tokenizer(texts)["input_ids"] if texts else []
