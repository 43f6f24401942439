"""SR-RAG routed inference (paper §3.4, Eq. 7) for a batch, in one left-to-right pass:

    prefill `Question: q Background knowledge:<EOQ>`   -> p_M(<s>|q) and the hidden state at <EOQ>
    policy(p_M, hidden)                                -> one source per row (kNN p_D for SR-RAG)
    append <s>; Self rows verbalize up to <EOK>        (Wiki rows sit idle: budget 0)
    retrieve for Wiki rows in one batched call; append passages<EOK> (Self rows: <EOK> only if
    their verbalization did not end with it) and " Answer:"; every row generates its answer.

A verbalization also ends at EOS: a model that closes its document the way its base closed
GenRead documents would otherwise write on past its own end (seen on the embedded world).

The prefix's KV cache is extended, never recomputed. Latency follows the paper's App. B.2:
T_d (source selection), T_v (verbalization) or T_r (retrieval), T_g (answer), per item.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxrag.decode.phases import charge_phases
from jaxrag.decode.policy import Policy, PolicyInputs, source_probabilities
from jaxrag.decode.sampler import (SamplingParams, batch_rows, bucket, decode, extend, init_state, left_pad, placement,
                                   on_mesh, stop_matrix)
from jaxrag.errors import JaxragError
from jaxrag.models.model import Model
from jaxrag.models.tokens import EOK, NONE, SELF, source_token
from jaxrag.prompts import answer_prefix_ids, join_passages, knowledge_ids, prompt_ids

Retrieve = Callable[[list[str]], list[list[str]]]  # questions -> passages per question


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    hidden_layer: int  # datastore layer (1-based), read at <EOQ>
    max_verbal_tokens: int = 150
    max_knowledge_tokens: int = 768  # retrieved passages beyond this are truncated (counted)
    max_answer_tokens: int = 64
    sampling: SamplingParams = SamplingParams()


@dataclasses.dataclass
class Routed:
    question: str
    source: str
    p_model: list[float]  # over the model's sources, in order
    p_datastore: list[float] | None
    score: float | None
    knowledge: str
    answer: str
    knowledge_truncated: bool  # passages cut to max_knowledge_tokens, or verbalization hit its budget
    latency: dict[str, float]  # T_d, T_v | T_r, T_g in seconds (batch phase time / rows sharing it)


def timed(fn):
    """(fn(), its seconds, device work included)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def knowledge_chunk(tok, passages: list[str] | None, verbal_stopped: bool, verbal_has_eok: bool,
                    tail: list[int], budget: int) -> tuple[list[int], bool]:
    """Tokens appended after the verbalization phase, ending in `<EOK> Answer:` (`tail`);
    returns (tokens, knowledge was truncated). A Self row that stopped on its own `<EOK>` has
    it in the cache already; one that stopped on EOS or ran out of budget does not."""
    if passages is None:  # Self: its verbalization is in the cache already
        return (tail[1:] if verbal_has_eok else tail), not verbal_stopped
    if not passages:  # no-retrieval source
        return tail, False
    text = knowledge_ids(tok, [passages])[0]
    return text[:budget] + tail, len(text) > budget


def phase_lengths(cfg: RouteConfig, tail: list[int]) -> tuple[int, int, int]:
    """Cache slots (bucketed) after the question: verbalization, knowledge + tail, answer."""
    return bucket(cfg.max_verbal_tokens), bucket(cfg.max_knowledge_tokens + len(tail)), bucket(cfg.max_answer_tokens)


def knowledge_text(tok, source: str, passages: list[str] | None, verbal: list[int], stops: list[int]) -> str:
    """What a row's trace reports as its knowledge: the passages it read, its verbalization
    (without `<EOK>`/EOS), or nothing for the no-retrieval source."""
    if source == NONE:
        return ""
    if source != SELF:
        return join_passages(passages)
    return tok.decode([t for t in verbal if t not in stops]).strip()


def answer_text(tok, tokens: list[int], eos: list[int]) -> str:
    return tok.decode([t for t in tokens if t not in eos], skip_special_tokens=True).strip()


def route(model: Model, questions: Sequence[str], policy: Policy, retrieve: Retrieve,
          cfg: RouteConfig, rng: jax.Array | None = None, rows: int | None = None,
          max_tokens: Sequence[int] | None = None) -> list[Routed]:
    """Routes, verbalizes or retrieves, and answers a batch of questions in one pass.

    Rows are split over the batch axes of the decoder's mesh (`sampler.placement`).
    `rows`: the batch size of the caller's loop, which every batch is padded to (`batch_rows`).
    `max_tokens`: each question's answer budget (1 to `cfg.max_answer_tokens`, its default), as an
    OpenAI request's `max_tokens`: the batch decodes until every row has ended, each at its own."""
    if not questions:
        raise JaxragError("route: empty batch of questions")
    if max_tokens is not None and (len(max_tokens) != len(questions)
                                   or not all(1 <= int(m) <= cfg.max_answer_tokens for m in max_tokens)):
        raise JaxragError(f"route: max_tokens needs one budget per question ({len(questions)}), each between 1 and "
                          f"max_answer_tokens {cfg.max_answer_tokens}; got {list(max_tokens)}")
    if not model.sources:
        raise JaxragError("route: the model has no SR-RAG tokens (convert it with --sources first)")
    tok, dec, sources = model.tokenizer, model.decoder, tuple(model.sources)
    mesh, n = placement(dec), len(questions)
    src_ids = [model.token_id(source_token(s)) for s in sources]
    eok, tail = model.token_id(EOK), answer_prefix_ids(tok)
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    prompts = prompt_ids(tok, list(questions))
    batch, plen = batch_rows(n, mesh, rows), bucket(max(map(len, prompts)))
    vlen, klen, alen = phase_lengths(cfg, tail)
    rng = jax.random.key(0) if rng is None else rng

    # T_d: prefill the question, read p_M over source tokens and the hidden state at <EOQ>.
    def select():
        state = init_state(dec, batch, plen + 1 + vlen + klen + alen)
        ids, mask = left_pad(prompts, plen, batch)
        return extend(dec, state, on_mesh(ids, mesh), on_mesh(mask, mesh), hidden_layer=cfg.hidden_layer)

    (state, hidden), t_d = timed(select)
    p_src = source_probabilities(state.logits[:n], src_ids)
    start = time.perf_counter()
    decision = policy(PolicyInputs(list(questions), sources, p_src, np.asarray(hidden[:n])))
    t_d += time.perf_counter() - start
    chosen = [sources[i] for i in np.asarray(decision.source)]

    # Appending each row's source token ends source selection: T_d, every row.
    def append_source():
        ids, mask = left_pad([[src_ids[sources.index(s)]] for s in chosen], 1, batch)
        return extend(dec, state, on_mesh(ids, mesh), on_mesh(mask, mesh))[0]

    state, t_s = timed(append_source)
    t_d += t_s

    # T_v: Self rows verbalize up to <EOK> (or EOS).
    def verbalize():
        budget = np.zeros(batch, np.int32)
        budget[:n] = [cfg.max_verbal_tokens if s == SELF else 0 for s in chosen]
        return decode(dec, state, on_mesh(stop_matrix([[eok, *eos]] * n, batch), mesh), on_mesh(budget, mesh),
                      jax.random.fold_in(rng, 0), on_mesh(np.arange(batch, dtype=np.uint32), mesh), max_new=vlen,
                      sampling=cfg.sampling)

    (state, verbal, verbal_len, verbal_stopped, _), t_v = timed(verbalize)
    verbal, verbal_len, verbal_stopped = map(np.asarray, (verbal, verbal_len, verbal_stopped))
    has_eok = [bool(verbal_stopped[i]) and verbal[i, verbal_len[i] - 1] == eok for i in range(n)]

    # T_r: one batched retrieval call for the Wiki rows.
    wiki_rows = [i for i, s in enumerate(chosen) if s not in (SELF, NONE)]  # every other source is retrieved
    start = time.perf_counter()
    found = retrieve([questions[i] for i in wiki_rows]) if wiki_rows else []
    t_r = time.perf_counter() - start
    if len(found) != len(wiki_rows) or any(not p for p in found):
        raise JaxragError(f"route: retrieval returned {len(found)} passage lists for {len(wiki_rows)} "
                          "questions (or an empty list); every Wiki row needs passages")
    passages = dict(zip(wiki_rows, found))
    passages.update({i: [] for i, s in enumerate(chosen) if s == NONE})

    # T_g: knowledge tail + " Answer:" for every row, then the answer.
    chunks = [knowledge_chunk(tok, passages.get(i), bool(verbal_stopped[i]), has_eok[i], tail,
                              cfg.max_knowledge_tokens) for i in range(n)]

    def answer_phase():
        # The cache has room for klen; the chunk is only as long as this batch needs (a batch of
        # Self rows appends a few tokens, not the passage budget).
        ids, mask = left_pad([c for c, _ in chunks], min(klen, bucket(max(len(c) for c, _ in chunks))), batch)
        st, _ = extend(dec, state, on_mesh(ids, mesh), on_mesh(mask, mesh))
        budget = np.zeros(batch, np.int32)
        budget[:n] = cfg.max_answer_tokens if max_tokens is None else max_tokens
        return decode(dec, st, on_mesh(stop_matrix([eos] * n, batch), mesh), on_mesh(budget, mesh),
                      jax.random.fold_in(rng, 1), on_mesh(np.arange(batch, dtype=np.uint32), mesh), max_new=alen,
                      sampling=cfg.sampling)

    (_, answers, answer_len, _, _), t_g = timed(answer_phase)
    answers, answer_len = np.asarray(answers), np.asarray(answer_len)

    out = []
    charged = charge_phases({"T_d": t_d, "T_v": t_v, "T_r": t_r, "T_g": t_g}, chosen)
    for i, q in enumerate(questions):
        knowledge = knowledge_text(tok, chosen[i], passages.get(i), verbal[i, : verbal_len[i]].tolist(), [eok, *eos])
        text = answer_text(tok, answers[i, : answer_len[i]].tolist(), eos)
        out.append(Routed(
            question=q, source=chosen[i], p_model=p_src[i].tolist(),
            p_datastore=None if decision.p_datastore is None else np.asarray(decision.p_datastore[i]).tolist(),
            score=None if decision.score is None else float(decision.score[i]),
            knowledge=knowledge, answer=text, knowledge_truncated=chunks[i][1],
            latency=charged[i],
        ))
    return out
