"""Training records -> fixed-length token arrays with per-segment target masks.

One SR-RAG sequence per example (paper §3.2; with a chat template, `Question: {q}` is the user
turn and the rest follows the assistant header):

    Question: {q} Background knowledge:<EOQ><s> {knowledge}<EOK> Answer: {a}</s>
                                            src  verb (Self only)        ans

`<s>` is the labelled source. The verb targets cover c_i+ and the `<EOK>` that ends it (at
inference the model itself stops verbalizing); the ans targets cover the answer and EOS;
" Answer:" is forced text. Knowledge is c_i+ for Self and c_e+ followed by Poisson(lambda)
extra retrieved passages (seeded per epoch and record) for Wiki. Only the knowledge is ever
truncated to fit `max_length`; truncations are flagged per row (`truncated`) and summed into
the training metrics. Stage 2 adds the rejected verbalization c_i- as a second sequence.
`targets` [rows, k] lists each row's target positions (k fixed per dataset) so the losses run
the model's head there only.
Inference must build its prompt with the same functions (`prompt_ids`, `knowledge_ids`,
`answer_prefix_ids`) so that it sees exactly the token ids the model was trained on.

Construct-stage record (JSONL, one per question):
  {"id", "dataset", "question", "golden_answers": [..], "label": "self"|"wiki",
   "contexts": [{"source", "text", "loglik"}], "no_context_loglik",
   "best": {"self": i, "wiki": j}, "worst": {"self": i, "wiki": j}}
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from jaxrag.errors import JaxragError
from jaxrag.models.tokens import NONE, SELF, source_token
from jaxrag.prompts import answer_ids, answer_prefix_ids, knowledge_ids, prompt_ids


@dataclasses.dataclass(frozen=True)
class TrainRecord:
    where: str  # "file:line" (or "records[i]"), for error messages
    id: str
    question: str
    answer: str  # the first golden answer
    label: str  # preferred source
    contexts: tuple[tuple[str, str], ...]  # (source, text)
    best: dict[str, int]
    worst: dict[str, int]


def _field(obj: dict, name: str, kind, where: str):
    if name not in obj:
        raise JaxragError(f"{where}: field {name!r}: missing")
    if not isinstance(obj[name], kind) or isinstance(obj[name], bool):
        expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise JaxragError(f"{where}: field {name!r}: expected {expected}, got {type(obj[name]).__name__}")
    return obj[name]


def parse_record(obj, where: str, sources: Sequence[str]) -> TrainRecord:
    """Validates one construct-stage record; errors name `where`, the record id and the field."""
    if not isinstance(obj, dict):
        raise JaxragError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ident = str(_field(obj, "id", (str, int), where))
    where = f"{where} (record {ident!r})"
    question = _field(obj, "question", str, where)
    answers = _field(obj, "golden_answers", list, where)
    if not question.strip() or not answers or not isinstance(answers[0], str) or not answers[0].strip():
        raise JaxragError(f"{where}: fields 'question' and 'golden_answers'[0] must be non-empty strings")
    label = _field(obj, "label", str, where)
    if label not in sources:
        raise JaxragError(f"{where}: field 'label': unknown source {label!r} (model sources: {list(sources)})")
    contexts = []
    for i, c in enumerate(_field(obj, "contexts", list, where)):
        cw = f"{where}: contexts[{i}]"
        if not isinstance(c, dict):
            raise JaxragError(f"{cw}: expected an object")
        src, text = _field(c, "source", str, cw), _field(c, "text", str, cw)
        if src not in sources:
            raise JaxragError(f"{cw}: field 'source': unknown source {src!r} (model sources: {list(sources)})")
        contexts.append((src, text))
    picks = {}
    for key in ("best", "worst"):
        picks[key] = _field(obj, key, dict, where)
        for src, i in picks[key].items():
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(contexts) or contexts[i][0] != src:
                raise JaxragError(f"{where}: field {key!r}: {src!r} -> {i!r} is not the index of a "
                                  f"{src!r} context (there are {len(contexts)} contexts)")
    if label not in picks["best"] and label != NONE:
        raise JaxragError(f"{where}: field 'best': no context for the label {label!r}")
    return TrainRecord(where, ident, question, answers[0], label, tuple(contexts), picks["best"], picks["worst"])


def read_records(path: str | os.PathLike, sources: Sequence[str]) -> list[TrainRecord]:
    """Reads construct-stage JSONL; errors name `file:line`. An empty file is an error."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise JaxragError(f"{path}:{line_no}: invalid JSON: {e.msg}") from None
                records.append(parse_record(obj, f"{path}:{line_no}", sources))
    if not records:
        raise JaxragError(f"{path}: no training records (empty dataset)")
    return records


def as_records(records, sources: Sequence[str]) -> list[TrainRecord]:
    """A JSONL path, TrainRecords, or decoded dicts (named `records[i]` in errors)."""
    if isinstance(records, (str, os.PathLike)):
        return read_records(records, sources)
    out = [r if isinstance(r, TrainRecord) else parse_record(r, f"records[{i}]", sources)
           for i, r in enumerate(records)]
    if not out:
        raise JaxragError("training records: empty dataset")
    return out


@dataclasses.dataclass(frozen=True)
class Row:
    """One assembled sequence, unpadded."""
    ids: list[int]
    src: int  # index of the source token
    verb: tuple[int, int]  # [start, end) of verbalization targets (empty for retrieved sources)
    ans: tuple[int, int]
    truncated: bool


def assemble(prompt: list[int], source: int, knowledge: list[int], tail: list[int], answer: list[int],
             verbalized: bool, max_length: int) -> Row:
    """prompt (..<EOQ>) <s> knowledge tail (<EOK> Answer:) answer; only knowledge is cut."""
    budget = max_length - len(prompt) - 1 - len(tail) - len(answer)
    knowledge_kept = knowledge[:max(budget, 0)]
    ids = prompt + [source] + knowledge_kept + tail + answer
    k0 = len(prompt) + 1
    verb = (k0, k0 + len(knowledge_kept) + 1) if verbalized else (k0, k0)  # + <EOK>
    return Row(ids, len(prompt), verb, (len(ids) - len(answer), len(ids)), len(knowledge_kept) < len(knowledge))


class RecordData:
    """Stage-1/2 examples, featurized on demand for the rows a host feeds.

    `rows(indices, epoch)` -> dict of [len(indices), ...] numpy arrays; index -1 = a padding row.
    With `pairs=True` (stage 2) Self rows also carry the rejected verbalization c_i-."""

    def __init__(self, records: list[TrainRecord], tokenizer, max_length: int, extra_passages_lambda: float,
                 seed: int, pairs: bool = False):
        self.records, self.tok, self.max_length = records, tokenizer, max_length
        self.lam, self.seed, self.pairs = extra_passages_lambda, seed, pairs
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.ref: np.ndarray | None = None  # [n, 2] reference log-probs (stage 2)
        self.tail = answer_prefix_ids(tokenizer)
        self.prompts = prompt_ids(tokenizer, [r.question for r in records])
        self.answers = answer_ids(tokenizer, [r.answer for r in records])
        self.source_ids = {s: tokenizer.convert_tokens_to_ids(source_token(s)) for s in {r.label for r in records}}
        for r, p, a in zip(records, self.prompts, self.answers):
            need = len(p) + 1 + len(self.tail) + len(a)
            if need > max_length:
                raise JaxragError(f"{r.where}: question and answer alone take {need} tokens > max_length "
                                  f"{max_length} (only knowledge is truncated); raise model.max_length")
            if pairs and r.label == SELF and SELF not in r.worst:
                raise JaxragError(f"{r.where}: field 'worst': a Self example needs a 'self' context for DPO")
        self.n_targets = self._max_targets()

    def _max_targets(self) -> int:
        """Static width of `targets`: the most target positions any row can have (<s>, the
        verbalization and its <EOK>, the answer), rounded up to a multiple of 8."""
        verbalized = [(i, r.best[SELF]) for i, r in enumerate(self.records) if r.label == SELF]
        if self.pairs:
            verbalized += [(i, r.worst[SELF]) for i, r in enumerate(self.records) if r.label == SELF]
        longest = [1 + len(a) for a in self.answers]
        k = knowledge_ids(self.tok, [[self.records[i].contexts[c][1]] for i, c in verbalized]) if verbalized else []
        for (i, _), ids in zip(verbalized, k):
            longest[i] = max(longest[i], 2 + len(ids) + len(self.answers[i]))
        return min(self.max_length, -(-max(longest) // 8) * 8)

    def __len__(self) -> int:
        return len(self.records)

    def order(self, epoch: int, batch_size: int) -> np.ndarray:
        """[n_batches, batch_size] record indices of one epoch, shuffled; -1 pads the last batch."""
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self))
        perm = np.pad(perm, (0, -len(perm) % batch_size), constant_values=-1)
        return perm.reshape(-1, batch_size)

    def passages(self, i: int, epoch: int) -> list[str]:
        """c_i+ for Self; nothing for None; c_e+ then Poisson(lambda) other retrieved passages
        (rank order) otherwise."""
        r = self.records[i]
        if r.label == NONE:
            return []
        best = r.best[r.label]
        if r.label == SELF:
            return [r.contexts[best][1]]
        others = [j for j, (s, _) in enumerate(r.contexts) if s == r.label and j != best]
        rng = np.random.default_rng([self.seed, epoch, i])
        k = min(int(rng.poisson(self.lam)) if self.lam > 0 else 0, len(others))
        extra = sorted(rng.choice(len(others), size=k, replace=False)) if k else []
        return [r.contexts[best][1]] + [r.contexts[others[j]][1] for j in extra]

    def _rows(self, idx: list[int], knowledge: list[list[int]], verbalized: list[bool]) -> list[Row]:
        return [assemble(self.prompts[i], self.source_ids[self.records[i].label], k, self.tail, self.answers[i],
                         v, self.max_length) for i, k, v in zip(idx, knowledge, verbalized)]

    def rows(self, indices: np.ndarray, epoch: int) -> dict[str, np.ndarray]:
        real = [int(i) for i in indices if i >= 0]
        is_self = [self.records[i].label == SELF for i in real]
        chosen = self._rows(real, knowledge_ids(self.tok, [self.passages(i, epoch) for i in real]), is_self)
        out = self._pack(chosen, indices)
        out["valid"] = (indices >= 0).astype(np.float32)
        out["truncated"] = self._scatter(indices, [float(r.truncated) for r in chosen])
        if self.pairs:
            worst = [self.records[i].contexts[self.records[i].worst[SELF]][1] if s else None
                     for i, s in zip(real, is_self)]
            rej_k = knowledge_ids(self.tok, [[w] for w in worst if w is not None])
            it = iter(self._rows([i for i, w in zip(real, worst) if w is not None], rej_k, [True] * len(rej_k)))
            # Retrieved-source rows have no pair: their rejected slot repeats the chosen sequence
            # (verb mask 0, `dpo` 0), keeping the batch shape static.
            rejected = [next(it) if s else c for s, c in zip(is_self, chosen)]
            rej = self._pack(rejected, indices)
            out.update(rej_ids=rej["ids"], rej_mask=rej["mask"], rej_verb=rej["verb"], rej_targets=rej["targets"])
            out["dpo"] = self._scatter(indices, [float(s) for s in is_self])
            ref = self.ref if self.ref is not None else np.zeros((len(self), 2), np.float32)
            out["ref_chosen"] = np.where(indices >= 0, ref[indices, 0], 0).astype(np.float32)
            out["ref_rejected"] = np.where(indices >= 0, ref[indices, 1], 0).astype(np.float32)
        return out

    @staticmethod
    def _scatter(indices: np.ndarray, values: list[float]) -> np.ndarray:
        out = np.zeros(len(indices), np.float32)
        out[indices >= 0] = values
        return out

    def _pack(self, rows: list[Row], indices: np.ndarray) -> dict[str, np.ndarray]:
        n, t = len(indices), self.max_length
        ids = np.full((n, t), self.pad, np.int32)
        mask = np.zeros((n, t), bool)
        mask[:, 0] = True  # padding rows keep one visible token: no fully masked attention row
        seg = {k: np.zeros((n, t), np.float32) for k in ("src", "verb", "ans")}
        targets = np.zeros((n, self.n_targets), np.int32)
        for b, row in zip(np.flatnonzero(indices >= 0), rows):
            ids[b, :len(row.ids)], mask[b, :len(row.ids)] = row.ids, True
            seg["src"][b, row.src] = 1.0
            seg["verb"][b, row.verb[0]:row.verb[1]] = 1.0
            seg["ans"][b, row.ans[0]:row.ans[1]] = 1.0
            at = [row.src, *range(*row.verb), *range(*row.ans)]
            targets[b, :len(at)] = at
        return {"ids": ids, "mask": mask, "targets": targets, **seg}


def pack_documents(docs: list[tuple[list[int], list[bool]]], max_length: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best-fit-decreasing packing of (token ids, loss mask) documents into [n_rows, max_length]
    ids (-1 = padding), loss masks and segment ids (1, 2, ... per document in its row, 0 =
    padding): a document never straddles two rows unless it is longer than one (then it is
    split), so a question and its answer are seen together; ~99% of slots are real tokens, where
    greedy in-order packing of the world's mix fills ~86%. Rows, and documents within a row, are
    shuffled."""
    pieces = [(ids[i:i + max_length], mask[i:i + max_length]) for ids, mask in docs
              for i in range(0, len(ids), max_length)]
    free: list[tuple[int, int]] = []  # (free slots, row index), sorted
    rows: list[list[tuple[list[int], list[bool]]]] = []
    for piece in sorted(pieces, key=lambda p: len(p[0]), reverse=True):
        size = len(piece[0])
        at = bisect.bisect_left(free, (size, -1))
        if at == len(free):
            rows.append([piece])
            bisect.insort(free, (max_length - size, len(rows) - 1))
            continue
        room, row = free.pop(at)
        rows[row].append(piece)
        bisect.insort(free, (room - size, row))
    packed = np.full((len(rows), max_length), -1, np.int32)
    loss = np.zeros((len(rows), max_length), bool)
    segments = np.zeros((len(rows), max_length), np.int32)
    for i, r in enumerate(rng.permutation(len(rows))):
        order = [rows[r][j] for j in rng.permutation(len(rows[r]))]
        row = [t for ids, _ in order for t in ids]
        packed[i, :len(row)] = row
        loss[i, :len(row)] = [m for _, mask in order for m in mask]
        segments[i, :len(row)] = [k + 1 for k, (ids, _) in enumerate(order) for _ in ids]
    return packed, loss, segments


class TextData:
    """LM data: each epoch's documents (`texts` or `texts(epoch)`), each ending in EOS, packed
    into [max_length] rows by `pack_documents`. A document is text (every token is a target) or
    a tuple of segments alternating context and target, `(prompt, completion, follow-up prompt,
    completion, ...)`, where only the targets and EOS are (instruction-format examples).
    `mask` holds segment ids: a packed document attends only to itself, from position 0, as it
    will at inference (with attention across a row's unrelated documents the tiny base model
    needed twice the steps to recall popular facts)."""

    def __init__(self, texts: Sequence | Callable[[int], Sequence], tokenizer, max_length: int, seed: int):
        self.texts, self.tok, self.max_length, self.seed = texts, tokenizer, max_length, seed
        self._epoch, self._rows, self._loss, self._segments = None, None, None, None
        self.where = "pretraining texts"

    def _documents(self, docs: list) -> list[tuple[list[int], list[bool]]]:
        """(ids + EOS, loss mask) per document, tokenized in two batched calls."""
        eos = [] if self.tok.eos_token_id is None else [self.tok.eos_token_id]
        segments = [(d,) if isinstance(d, str) else d for d in docs]
        firsts = self.tok([s[0] for s in segments], add_special_tokens=True)["input_ids"]
        rest = [t for s in segments for t in s[1:]]  # the tokenizer rejects an empty batch
        rests = iter(self.tok(rest, add_special_tokens=False)["input_ids"] if rest else [])
        out = []
        for d, s, first in zip(docs, segments, firsts):
            ids, loss = list(first), [isinstance(d, str)] * len(first)
            for k in range(1, len(s)):  # odd segments are targets, even ones context
                piece = next(rests)
                ids += piece
                loss += [k % 2 == 1] * len(piece)
            out.append((ids + eos, loss + [True] * len(eos)))
        return out

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """[n_rows, max_length] token ids of one epoch, -1 = padding (cached for the current epoch)."""
        if self._epoch != epoch:
            docs = list(self.texts(epoch) if callable(self.texts) else self.texts)
            if not docs:
                raise JaxragError(f"{self.where}: empty dataset (epoch {epoch})")
            rng = np.random.default_rng([self.seed, epoch])
            self._rows, self._loss, self._segments = pack_documents(self._documents(docs), self.max_length, rng)
            self._epoch = epoch
        return self._rows

    def order(self, epoch: int, batch_size: int) -> np.ndarray:
        n = len(self.epoch_rows(epoch)) // batch_size
        if n == 0:
            raise JaxragError(f"{self.where}: {len(self.epoch_rows(epoch))} rows per epoch, fewer than one "
                              f"batch of {batch_size}")
        perm = np.random.default_rng([self.seed, epoch, 1]).permutation(len(self.epoch_rows(epoch)))
        return perm[: n * batch_size].reshape(n, batch_size)

    def rows(self, indices: np.ndarray, epoch: int) -> dict[str, np.ndarray]:
        ids = self.epoch_rows(epoch)[indices]
        return {"ids": np.where(ids >= 0, ids, 0), "mask": self._segments[indices],
                "loss_mask": self._loss[indices].astype(np.float32)}
