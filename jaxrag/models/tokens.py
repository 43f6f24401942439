"""SR-RAG special tokens: `<EOQ>`, one token per knowledge source, `<EOK>` (paper §3.1)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken

EOQ = "<EOQ>"
EOK = "<EOK>"
SELF = "self"  # the model itself as knowledge source: it verbalizes
WIKI = "wiki"  # retrieval from Wikipedia
NONE = "none"  # no knowledge (Selective RAG's null source, paper §4.2); every other source is retrieved
DEFAULT_SOURCES = (WIKI, SELF)


def source_token(source: str) -> str:
    """`wiki` -> `<Wiki>`, `self` -> `<Self>`."""
    if not source or not source.isidentifier():
        raise ValueError(f"source name {source!r} must be a non-empty identifier")
    return f"<{source.capitalize()}>"


def srrag_tokens(sources: Sequence[str] = DEFAULT_SOURCES) -> list[str]:
    """All SR-RAG tokens in a fixed order: `<EOQ>`, the source tokens, `<EOK>`."""
    if len(set(sources)) != len(sources) or not sources:
        raise ValueError(f"sources must be a non-empty list of distinct names, got {list(sources)}")
    return [EOQ, *(source_token(s) for s in sources), EOK]


def srrag_token_ids(model) -> tuple[int, ...]:
    """A jaxrag Model's SR-RAG token ids in `srrag_tokens` order (() for a model without them)."""
    return tuple(model.token_id(t) for t in srrag_tokens(model.sources)) if model.sources else ()


def add_srrag_tokens(tokenizer, sources: Sequence[str] = DEFAULT_SOURCES) -> list[int]:
    """Adds the SR-RAG tokens to a transformers tokenizer as atomic special tokens.

    Idempotent: tokens already present keep their ids. Returns the ids in `srrag_tokens` order.
    Special tokens are never split by the pre-tokenizer, so each encodes to exactly one id.
    """
    tokens = srrag_tokens(sources)
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False) for t in tokens],
        special_tokens=True,
    )
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def sources_in_tokenizer(tokenizer) -> tuple[str, ...]:
    """The sources whose tokens a tokenizer carries (an exported SR-RAG model), in token order:
    `add_srrag_tokens` adds `<EOQ>`, the source tokens, `<EOK>` as consecutive ids."""
    added = tokenizer.get_added_vocab()
    if EOQ not in added or EOK not in added:
        return ()
    between = sorted((i, t) for t, i in added.items() if added[EOQ] < i < added[EOK])
    return tuple(t[1:-1].lower() for _, t in between if t.startswith("<") and t.endswith(">"))
