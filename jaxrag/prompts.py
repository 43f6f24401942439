"""SR-RAG's sequence format, in one place for training, decoding and evaluation (paper §3.1):

    Question: {q} Background knowledge: <EOQ><s>{knowledge}<EOK> Answer: {a}

With a chat template, the question is the user turn and the assistant turn starts at
"Background knowledge:", so the model routes, verbalizes and answers inside its own reply.
"""

from __future__ import annotations

from jaxrag.models.tokens import EOK, EOQ, source_token

ANSWER_PREFIX = " Answer:"
GENREAD_PROMPT = (
    "Generate a background document from Wikipedia to help answer the following question. "
    "Directly start with document content and do not generate URL.\nQuestion: {question}\nBackground document:"
)
GENREAD_AMBIGUOUS = " If the question is ambiguous, generate multiple documents for each possibility."


def question_prefix(tokenizer, question: str) -> str:
    """Text up to and including `<EOQ>`: where the model picks its knowledge source."""
    if getattr(tokenizer, "chat_template", None):
        turn = tokenizer.apply_chat_template([{"role": "user", "content": f"Question: {question}"}],
                                             tokenize=False, add_generation_prompt=True)
        return f"{turn}Background knowledge: {EOQ}"
    return f"Question: {question} Background knowledge: {EOQ}"


def knowledge_segment(source: str, knowledge: str) -> str:
    """`<Wiki>{passages}<EOK>` / `<Self>{verbalization}<EOK>`."""
    return f"{source_token(source)}{knowledge}{EOK}"


def answer_text(answer: str) -> str:
    return f" {answer}"


def join_passages(passages: list[str]) -> str:
    return "\n".join(p.strip() for p in passages)
