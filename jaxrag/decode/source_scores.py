"""What the policy datastore records for a training question (paper §3.4), in one pass:

    prefill `Question: q Background knowledge:<EOQ>`   -> the key: the hidden state at <EOQ>
    copy the question's cache to two rows               <Self> row, <Wiki> row
    <Self> row: its greedy verbalization up to <EOK>    (EOS or its budget), as routing writes it
    each row: its knowledge tail and the gold answer    -> log p(answer | that row's prefix)

The value is the source whose prefix makes the gold answer more likely. Each question is
prefilled once; the <Self> row's knowledge is the tokens the model wrote, in the cache they were
written to, followed by `<EOK> Answer:` exactly as `routing.route` appends it (without `<EOK>`
when the verbalization ended on one); the <Wiki> row reads its passages cut to the knowledge
budget. No answer is generated: the gold answer is scored where routing would start generating.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxrag.decode.routing import RouteConfig, knowledge_chunk
from jaxrag.decode.sampler import (batch_rows, bucket, decode, extend, init_state, left_pad, on_mesh, placement,
                                   repeat_rows, stop_matrix)
from jaxrag.decode.scoring import extend_logprobs
from jaxrag.models.model import Model
from jaxrag.models.tokens import EOK, SELF, WIKI, source_token
from jaxrag.prompts import answer_ids, answer_prefix_ids, knowledge_ids, prompt_ids

SOURCES = (SELF, WIKI)  # the columns of `source_likelihoods`' log-likelihoods


def source_likelihoods(model: Model, questions: Sequence[str], answers: Sequence[str],
                       passages: Sequence[Sequence[str]], cfg: RouteConfig,
                       rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A batch of training questions -> (the hidden state of `cfg.hidden_layer` at `<EOQ>`
    [n, hidden], log p(answer | prefix) [n, 2] under `SOURCES`: `<Self>` and its own greedy
    verbalization (at most `cfg.max_verbal_tokens`), or `<Wiki>` and `passages[i]` (cut to
    `cfg.max_knowledge_tokens`; none: the answer follows the tail directly), each then
    `<EOK> Answer:`). `answers[i]` is scored as ` a` + EOS (`prompts.answer_ids`). `rows`: the
    batch size of the caller's loop, which every batch is padded to (`sampler.batch_rows`)."""
    tok, dec, n = model.tokenizer, model.decoder, len(questions)
    mesh = placement(dec)
    eok, tail = model.token_id(EOK), answer_prefix_ids(tok)
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    prompts, targets = prompt_ids(tok, list(questions)), answer_ids(tok, list(answers))
    know = [k[:cfg.max_knowledge_tokens] for k in knowledge_ids(tok, [list(p) for p in passages])]
    batch, plen, vlen = batch_rows(n, mesh, rows), bucket(max(map(len, prompts))), bucket(cfg.max_verbal_tokens)
    # the <Wiki> rows' chunks are the longer: a <Self> row's holds the tail (or less) and the answer
    width = bucket(max(len(k) + len(tail) + len(t) for k, t in zip(know, targets)))
    state = init_state(dec, batch, plen + 1 + vlen + width)
    ids, mask = left_pad(prompts, plen, batch)
    state, hidden = extend(dec, state, on_mesh(ids, mesh), on_mesh(mask, mesh), hidden_layer=cfg.hidden_layer)
    state, both = repeat_rows(dec, state, len(SOURCES)), len(SOURCES) * batch  # question i: rows 2i, 2i + 1
    sources = np.tile([[model.token_id(source_token(s))] for s in SOURCES], (batch, 1)).astype(np.int32)
    state, _ = extend(dec, state, on_mesh(sources, mesh), on_mesh(np.ones_like(sources, bool), mesh))

    budget = np.zeros(both, np.int32)
    budget[: len(SOURCES) * n: len(SOURCES)] = cfg.max_verbal_tokens  # the <Self> rows verbalize
    out = decode(dec, state, on_mesh(stop_matrix([[eok, *eos]] * both, both), mesh), on_mesh(budget, mesh),
                 jax.random.key(0), on_mesh(np.arange(both, dtype=np.uint32), mesh), max_new=vlen)
    verbal, count, stopped = np.asarray(out.tokens), np.asarray(out.count), np.asarray(out.stopped)
    chunks = []
    for i in range(n):
        r = len(SOURCES) * i
        has_eok = bool(stopped[r]) and verbal[r, count[r] - 1] == eok
        own, _ = knowledge_chunk(tok, None, bool(stopped[r]), has_eok, tail, cfg.max_knowledge_tokens)
        chunks += [own + targets[i], know[i] + tail + targets[i]]
    ids, mask = left_pad(chunks, width, both)
    at = np.zeros((both, bucket(max(map(len, targets)), 1)), np.int32)
    for r in range(len(chunks)):  # rows are left-padded: the answer ends its row
        t = len(targets[r // len(SOURCES)])
        at[r, :t] = np.arange(width - t, width)
    logp = extend_logprobs(dec, out.state, on_mesh(ids, mesh), on_mesh(mask, mesh), on_mesh(at, mesh))
    ll = np.asarray(logp, np.float64)[: len(chunks)].sum(axis=1).reshape(n, len(SOURCES))
    return np.asarray(hidden[:n], np.float32), ll
