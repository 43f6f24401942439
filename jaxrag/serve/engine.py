"""Continuous batching for SR-RAG: the slot pool of `decode.slots`, each request in a phase of its own.

    queue --admit--> T_d: the question prefill (as `routing.route` runs it on one row), p_M, the
                     policy (p_M x kNN p_D); the prompt waits in its parking row
       <Self>  -> enters the pool with its source token: verbalizes until <EOK> / EOS / budget
                  (T_v), is fed `<EOK> Answer:` and answers (T_g), all on the device
       <Wiki>  -> retrieval worker (batched over the rows waiting)       (T_r)
                  -> enters with its source token, passages and `<EOK> Answer:`; answers (T_g)
       <None>  -> enters with its source token and `<EOK> Answer:`; answers (T_g)

One engine thread runs the loop: admit what fits, hand finished retrievals back, let the rows
that have their knowledge enter the pool, run decode steps over every slot (`slots.steps`, on the
device until a row's answer ends), repeat. Rows that reach a prefill together share one call
(`slots.admit`: the questions admitted together whose prompts share a length bucket;
`slots.enter`: the rows whose chunks share a width), padded to a power of two up to the slot
count. Retrieval runs on its own thread, so a row waiting for passages never stalls the others,
and questions that need passages at the same time share one encoder + index call. Every prefill
and decode shape is bucketed and compiled by `warm_up` before the first request; the metrics
count the programs traced after it (zero while serving).

A row's prefills compute what `route` computes for that question alone (same prompt bucket, cache
length, columns and positions) and its steps read the same keys: greedy answers and traces equal
`SRRAG.ask([q])`, and a sampled row draws with its own keys (`slots.stage_keys`, the request's
serial number as its row id) whatever shares the pool (`tests/test_serve.py`).
"""

from __future__ import annotations

import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrag.decode.policy import PolicyInputs, source_probabilities
from jaxrag.decode.routing import Routed, answer_text, knowledge_chunk, knowledge_text, phase_lengths
from jaxrag.decode.sampler import NO_TOKEN, bucket, left_pad
from jaxrag.decode.slots import ANSWER, VERBAL, admit, enter, init_parking, init_pool, stage_keys, steps
from jaxrag.errors import JaxragError
from jaxrag.models.tokens import EOK, NONE, SELF, source_token
from jaxrag.policies.srrag import srrag_policy
from jaxrag.prompts import answer_prefix_ids, prompt_ids
from jaxrag.serve.jobs import Answer, Job, Options, QueueFull, Unavailable
from jaxrag.serve.metrics import Metrics
from jaxrag.serve.retrieval import RetrievalWorker

MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_K = 64  # largest kNN k a request may ask for (the datastore is searched once at this k)
# Decode steps per call at most: a call also ends as soon as a row's answer ends, so a waiting
# request joins within this many steps, and the host's work per call is spread over them.
STEPS_PER_CALL = 16


def _grouped(items, key) -> dict:
    """items by key(item), in order: the rows that share one prefill program."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


class Engine:
    def __init__(self, system, *, slots: int = 8, max_queue: int = 256, max_question_tokens: int = 256):
        model, cfg = system.model, system.route_cfg
        if not model.sources:
            raise JaxragError("the model has no SR-RAG tokens (convert it with --sources first)")
        self.system, self.model, self.cfg, self.dec = system, model, cfg, model.decoder
        self.tok, self.sources = model.tokenizer, tuple(model.sources)
        self.src_ids = [model.token_id(source_token(s)) for s in self.sources]
        self.eok, self.tail = model.token_id(EOK), answer_prefix_ids(self.tok)
        self.eos = [] if self.tok.eos_token_id is None else [self.tok.eos_token_id]
        self.vlen, self.klen, self.alen = phase_lengths(cfg, self.tail)
        self.slots, self.max_queue, self.max_question_tokens = int(slots), int(max_queue), int(max_question_tokens)
        self.prompt_buckets = sorted({bucket(n) for n in range(1, self.max_question_tokens + 1)})
        self.chunk_buckets = sorted({min(self.klen, bucket(n)) for n in range(1, self.klen + 1)})
        # rows per prefill call: powers of two up to the slot count
        self.row_buckets = sorted({min(1 << b, self.slots) for b in range(self.slots.bit_length() + 1)})
        self.max_k = min(MAX_K, len(system.datastore))
        self.verbal_stops = jnp.asarray([self.eok, *self.eos], jnp.int32)
        self.answer_stops = jnp.asarray(self.eos or [NO_TOKEN], jnp.int32)
        self.tail_ids = jnp.asarray(self.tail, jnp.int32)
        self.pool, self.parking = self._new_pool()
        self.rows: list[Job | None] = [None] * self.slots
        self.waiting: collections.deque[Job] = collections.deque()
        self.found: list[tuple[Job, list]] = []
        self.ready: list[tuple[Job, list[int]]] = []  # rows to enter the pool, with their chunks, this loop
        self.pending = None  # the last call of steps dispatched: its outputs and the jobs it ran
        self.idle_next = np.zeros(self.slots, bool)  # rows of cancelled requests, idled by the next call of steps
        self.cv = threading.Condition()
        self.stopping, self.dispatches, self.serial, self.key = False, 0, 0, jax.random.key(0)
        self.draining, self.failure, self.rebuilds = False, None, 0  # SIGTERM; the loop's fatal error; pools rebuilt
        self.metrics = Metrics(self)
        # The decoder bound once: nnx.jit would walk its module graph on every call.
        self._admit_rows, self._enter_rows, self._steps = (nnx.cached_partial(f, self.dec)
                                                           for f in (admit, enter, steps))
        self.retrieval = RetrievalWorker(system, self.slots, self._deliver, self._fail)
        self.threads = [threading.Thread(target=self._loop, name="srrag-engine", daemon=True), self.retrieval.thread]

    def _length(self, plen: int) -> int:
        """Cache slots of a question of `plen` (bucketed) tokens, as `route` sizes it alone."""
        return plen + 1 + self.vlen + self.klen + self.alen

    def _new_pool(self):
        """The pool, whose ring holds the longest question's columns, and its parking rows."""
        return (init_pool(self.dec, self.slots, self._length(self.prompt_buckets[-1])),
                init_parking(self.dec, self.slots, self.prompt_buckets[-1]))

    # --- intake (any thread) --------------------------------------------------------------

    def prompt(self, question: str) -> list[int]:
        """The question's prompt ids; JaxragError when it is empty or over the length served."""
        if not question.strip():
            raise JaxragError("the question is empty")
        ids = prompt_ids(self.tok, [question])[0]
        if len(ids) > self.max_question_tokens:
            raise JaxragError(f"the question's prompt has {len(ids)} tokens; this server takes at most "
                              f"{self.max_question_tokens} (--max-question-tokens)")
        return ids

    def check(self, options: Options) -> None:
        """JaxragError naming the first bad option."""
        o = options
        if o.source is not None and o.source not in self.sources:
            raise JaxragError(f"source {o.source!r}: this model's sources are {', '.join(self.sources)}")
        if o.k is not None and not 1 <= o.k <= self.max_k:
            raise JaxragError(f"k {o.k}: must be between 1 and {self.max_k}")
        if o.max_tokens is not None and not 1 <= o.max_tokens <= self.cfg.max_answer_tokens:
            raise JaxragError(f"max_tokens {o.max_tokens}: must be between 1 and {self.cfg.max_answer_tokens}")
        if not 0.0 <= o.temperature <= MAX_TEMPERATURE:  # OpenAI's bounds
            raise JaxragError(f"temperature {o.temperature}: must be between 0 and {MAX_TEMPERATURE:g}")
        if not 0.0 < o.top_p <= 1.0:  # top_p 0 (the top token alone) is greedy: `http.OptionFields`
            raise JaxragError(f"top_p {o.top_p}: must be between 0 and 1")

    def submit(self, jobs: list[Job]) -> None:
        """Queues the jobs, all or none: QueueFull when they do not fit."""
        with self.cv:
            if self.failure is not None:
                raise Unavailable(f"the engine has failed ({self.failure}); restart the server")
            if self.stopping or self.draining:
                raise Unavailable("the server is shutting down")
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"the queue holds {len(self.waiting)} of {self.max_queue} requests")
            self.waiting.extend(jobs)
            self.cv.notify_all()

    def cancel(self, job: Job) -> None:
        with self.cv:
            job.cancelled = True
            self.cv.notify_all()

    def busy(self) -> int:
        return sum(j is not None for j in self.rows)

    def queued(self) -> int:
        return len(self.waiting)

    def start(self) -> Engine:
        for t in self.threads:
            t.start()
        return self

    def drain(self) -> None:
        """SIGTERM: no new request (`Unavailable`, 503); those queued and running finish."""
        with self.cv:
            self.draining = True

    def stop(self) -> None:
        """Finishes every queued and running request, then stops the threads."""
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        for t in self.threads:
            if t.is_alive():
                t.join()

    def warm_up(self) -> None:
        """Compiles every program a request can run, before the first one: per row bucket, the
        question prefill per prompt bucket, the source token and the knowledge chunk per chunk
        bucket; the datastore search, the pool's decode steps, and the retriever per encoder
        length bucket."""
        filler = self.tail[-1]
        for n in self.row_buckets:
            rows = np.full(n, self.slots, np.int32)  # padding rows only: the pool is not written
            for plen in self.prompt_buckets:
                p_src, hidden = self._prefill_questions(rows, [[filler] * plen] * n)
            for width in [0, *self.chunk_buckets]:
                self._enter(rows, [None] * n, [[filler] * width] * n, width)
        self._policy(self.system.k)(PolicyInputs([""], self.sources, p_src[:1], hidden[:1]))
        jax.block_until_ready(self._dispatch())
        encoder = self.system.retriever.encoder
        for length in encoder.buckets():
            words = max(1, length - 2)
            while words > 1 and len(encoder.tokenizer("a " * words)["input_ids"]) > length:
                words -= 1
            self.retrieval.search(["a " * words])
        self.metrics.serving()

    # --- the engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        """The engine thread: `_serve` until stopped; an error it did not expect ends it, every
        request in flight failing with it, and `/health` says so (503)."""
        try:
            self._serve()
        except Exception as e:
            with self.cv:
                self.failure = f"{type(e).__name__}: {e}"
                jobs = [*self.waiting, *(j for j in self.rows if j is not None)]
                self.waiting.clear()
            for job in jobs:
                self._fail(job, e)
            self.retrieval.close()

    def _serve(self) -> None:
        while True:
            with self.cv:
                while not self._work():
                    if self.stopping and not self.waiting and not self.busy():
                        self.retrieval.close()
                        return
                    self.cv.wait()
                for i, job in enumerate(self.rows):
                    if job is not None and job.cancelled:
                        self.idle_next[i] |= job.phase in ("verbalize", "answer")
                        self._free(job, "cancelled")
                admit = []
                # A slot per row waiting for its passages or holding them (each keeps its own).
                while self.waiting and None in self.rows:
                    job = self.waiting.popleft()
                    if job.cancelled:
                        self.metrics.finished("cancelled")
                        continue
                    job.slot, job.serial = self.rows.index(None), self.serial
                    self.rows[job.slot], self.serial = job, self.serial + 1
                    admit.append(job)
                found, self.found = self.found, []
            try:
                for jobs in _grouped(admit, lambda job: bucket(len(job.prompt))).values():
                    self._admit(jobs)
                for job, hits in found:
                    if self.rows[job.slot] is job and not job.cancelled:
                        self._guarded(job, lambda j: self._retrieved(j, hits))
                self._enter_ready()
                # The next call of steps is dispatched before the last one's tokens are read: the
                # device runs it while this thread reads, streams and admits.
                previous, self.pending = self.pending, None
                if any(j is not None and j.phase in ("verbalize", "answer") for j in self.rows):
                    self.pending = self._dispatch()
                if previous is not None:
                    self._read(*previous)
            except Exception as e:
                self._rebuild(e)

    def _rebuild(self, e: Exception) -> None:
        """A failed device call took the pool or the parking with it (donated): every request
        holding a slot fails (its cache is gone), and a fresh pool serves the queue."""
        for job in [j for j in self.rows if j is not None]:
            self._fail(job, e)
        self.ready, self.pending, self.idle_next[:] = [], None, False
        self.pool, self.parking = self._new_pool()
        self.rebuilds += 1

    def _work(self) -> bool:
        return bool(self.found or self.pending is not None or (self.waiting and None in self.rows)
                    or any(j is not None and (j.cancelled or j.phase in ("verbalize", "answer")) for j in self.rows))

    def _guarded(self, job: Job, fn) -> None:
        try:
            fn(job)
        except Exception as e:  # one request's failure is its own; the engine keeps serving
            self._fail(job, e)

    def _fail(self, job: Job, e: Exception) -> None:
        with self.cv:
            self._free(job, "error")
        job.listener("error", str(e) if isinstance(e, JaxragError) else f"internal error: {type(e).__name__}: {e}")

    def _free(self, job: Job, outcome: str) -> None:
        if job.slot is not None and self.rows[job.slot] is job:
            self.rows[job.slot] = None
        job.phase = outcome
        self.metrics.finished(outcome)

    def _row_indices(self, jobs: list[Job]) -> np.ndarray:
        """The jobs' slots, padded to a row bucket with an index past the pool (never written)."""
        n = next(r for r in self.row_buckets if r >= len(jobs))
        return np.array([j.slot for j in jobs] + [self.slots] * (n - len(jobs)), np.int32)

    def _prefill_questions(self, rows: np.ndarray, prompts: list[list[int]]):
        """T_d's prefill as `route` runs it on one row, for each prompt (one length bucket) into
        its parking row: p_M [rows, sources] and the hidden state at <EOQ> [rows, hidden]."""
        plen = bucket(max(map(len, prompts)))
        ids, mask = left_pad(prompts, plen, len(rows))
        self.parking, logits, hidden = self._admit_rows(self.parking, jnp.asarray(rows), jnp.asarray(ids),
                                                        jnp.asarray(mask), length=self._length(plen),
                                                        hidden_layer=self.cfg.hidden_layer)
        return source_probabilities(logits, self.src_ids), np.asarray(hidden)

    def _enter(self, rows: np.ndarray, jobs: list[Job | None], chunks: list[list[int]], width: int) -> None:
        """Parked rows into the pool: each job's source token and chunk (`width` columns; 0 for
        a `<Self>` row, which verbalizes first), its budgets, sampling and keys."""
        n = len(rows)
        self.idle_next[rows[rows < self.slots]] = False  # a cancelled request's row, now another's
        ids, mask = left_pad(chunks, width, n)
        pad = [None] * (n - len(jobs))
        source = [self.src_ids[self.sources.index(j.source)] if j else 0 for j in [*jobs, *pad]]
        answer = [(j.options.max_tokens or self.cfg.max_answer_tokens) if j else 1 for j in [*jobs, *pad]]
        budget = np.array([[self.cfg.max_verbal_tokens, a] for a in answer], np.int32)
        option = lambda name, default: np.array([getattr(j.options, name) if j else default for j in [*jobs, *pad]],
                                                np.float32)
        serials = np.array([j.serial if j else 0 for j in [*jobs, *pad]], np.uint32)
        self.pool = self._enter_rows(self.pool, self.parking, jnp.asarray(rows), jnp.asarray(source, jnp.int32),
                                     jnp.asarray(ids), jnp.asarray(mask),
                                     jnp.full(n, VERBAL if width == 0 else ANSWER, jnp.int32), jnp.asarray(budget),
                                     jnp.asarray(option("temperature", 0.0)), jnp.asarray(option("top_p", 1.0)),
                                     stage_keys(self.key, jnp.asarray(serials)))

    def _policy(self, k: int):
        """SR-RAG's policy with p_D from the k nearest entries (one search at `max_k`: one program)."""
        store = self.system.datastore
        return srrag_policy(lambda keys: store.neighbour_labels(np.asarray(keys, np.float32), self.max_k)[:, :k],
                            self.system.tau)

    def _admit(self, jobs: list[Job]) -> None:
        """T_d for questions admitted together whose prompts share a length bucket: their
        prefills in one call, then each one's policy; the rows that need no passages are ready
        to enter the pool, the others go to the retrieval worker."""
        start = time.perf_counter()
        p_src, hidden = self._prefill_questions(self._row_indices(jobs), [job.prompt for job in jobs])
        for i, job in enumerate(jobs):
            job.latency["queue"] = start - job.submitted
            inputs = PolicyInputs([job.question], self.sources, p_src[i:i + 1], hidden[i:i + 1])
            decision = self._policy(job.options.k or self.system.k)(inputs)
            job.source = job.options.source or self.sources[int(np.asarray(decision.source)[0])]
            job.p_model = p_src[i].tolist()
            job.p_datastore = None if decision.p_datastore is None else np.asarray(decision.p_datastore[0]).tolist()
            job.score = None if decision.score is None else float(decision.score[0])
        t_d = time.perf_counter() - start
        for job in jobs:
            job.latency["T_d"] = t_d
            if job.source == SELF:
                self.ready.append((job, []))
            elif job.source == NONE:
                self._knowledge(job, [])
            else:
                job.phase, job.phase_start = "retrieve", time.perf_counter()
                self.retrieval.put(job)

    def _retrieved(self, job: Job, hits) -> None:
        job.latency["T_r"] = time.perf_counter() - job.phase_start
        job.hits = [{"id": h.passage.id, "title": h.passage.title} for h in hits]
        self._knowledge(job, [h.passage.to_prompt() for h in hits])

    def _knowledge(self, job: Job, passages: list[str]) -> None:
        """The row's knowledge chunk (its passages, or none) and `<EOK> Answer:`, with which it
        enters the pool in this loop (`_enter_ready`)."""
        job.passages = passages
        chunk, job.truncated = knowledge_chunk(self.tok, passages, False, False, self.tail,
                                               self.cfg.max_knowledge_tokens)
        job.phase, job.chunk_tokens = "knowledge", len(chunk)
        self.ready.append((job, chunk))

    def _enter_ready(self) -> None:
        """The ready rows into the pool, one call per chunk width: `<Self>` rows verbalize, the
        others answer (T_g starts, as `route` times it)."""
        ready = [(job, chunk) for job, chunk in self.ready if self.rows[job.slot] is job and not job.cancelled]
        self.ready = []
        width_of = lambda item: min(self.klen, bucket(len(item[1]))) if item[1] else 0  # noqa: E731
        for width, group in _grouped(ready, width_of).items():
            jobs = [job for job, _ in group]
            self._enter(self._row_indices(jobs), jobs, [c for _, c in group], width)
            for job in jobs:
                job.phase, job.tokens = ("verbalize" if width == 0 else "answer"), []
                job.phase_start = time.perf_counter()
                job.budget = job.options.max_tokens or self.cfg.max_answer_tokens

    def _dispatch(self):
        """One call of decode steps, dispatched (not waited for): its outputs and the jobs it runs."""
        live = [(slot, j) for slot, j in enumerate(self.rows) if j is not None and j.phase in ("verbalize", "answer")]
        stop, self.idle_next = self.idle_next, np.zeros(self.slots, bool)
        self.pool, tokens, kinds, _ = self._steps(self.pool, jnp.asarray(stop), self.verbal_stops, self.answer_stops,
                                                  self.tail_ids, max_steps=STEPS_PER_CALL)
        self.dispatches += 1
        return tokens, kinds, live

    def _read(self, tokens, kinds, live) -> None:
        """A call's tokens, by kind, into its jobs (those still holding their slots): the
        verbalization, whose end starts the answer, and the answer, streamed and finished."""
        start = time.perf_counter()
        tokens, kinds = np.asarray(tokens), np.asarray(kinds)
        slots = [slot for slot, _ in live]
        self.metrics.stepped(time.perf_counter() - start, len(live), int(np.isin(kinds[slots], (VERBAL, ANSWER)).sum()))
        verbal_stops = {self.eok, *self.eos}
        for slot, job in live:
            if self.rows[slot] is not job or job.phase not in ("verbalize", "answer"):
                continue
            for token, kind in zip(tokens[slot].tolist(), kinds[slot].tolist()):
                if kind == VERBAL:
                    job.verbal.append(token)
                    if token in verbal_stops or len(job.verbal) >= self.cfg.max_verbal_tokens:
                        self._verbalized(job, token in verbal_stops)
                elif kind == ANSWER:
                    job.tokens.append(token)
            if job.phase == "answer":
                self._stream(job)
                hit = bool(job.tokens) and job.tokens[-1] in self.eos
                if hit or len(job.tokens) >= job.budget:
                    self._finish(job, "stop" if hit else "length")

    def _verbalized(self, job: Job, stopped: bool) -> None:
        """A `<Self>` row's verbalization ended on the device, which feeds it `<EOK> Answer:`
        (without `<EOK>` when it wrote one): T_v ends, T_g starts."""
        now = time.perf_counter()
        job.latency["T_v"], job.phase_start, job.phase = now - job.phase_start, now, "answer"
        job.verbal_stopped = stopped
        has_eok = stopped and job.verbal[-1] == self.eok
        chunk, job.truncated = knowledge_chunk(self.tok, None, stopped, has_eok, self.tail,
                                               self.cfg.max_knowledge_tokens)
        job.chunk_tokens = len(chunk)

    def _stream(self, job: Job) -> None:
        """The answer's new text, held back while it ends in whitespace or half a character."""
        text = self.tok.decode([t for t in job.tokens if t not in self.eos], skip_special_tokens=True).strip()
        if len(text) > len(job.sent) and text.startswith(job.sent) and not text.endswith("\ufffd"):
            delta, job.sent = text[len(job.sent):], text
            job.listener("delta", delta)

    def _finish(self, job: Job, reason: str) -> None:
        job.latency["T_g"] = time.perf_counter() - job.phase_start
        answer = answer_text(self.tok, job.tokens, self.eos)
        if answer != job.sent and answer.startswith(job.sent):
            job.listener("delta", answer[len(job.sent):])
        knowledge = knowledge_text(self.tok, job.source, job.passages, job.verbal, [self.eok, *self.eos])
        routed = Routed(question=job.question, source=job.source, p_model=job.p_model, p_datastore=job.p_datastore,
                        score=job.score, knowledge=knowledge, answer=answer, knowledge_truncated=job.truncated,
                        latency=dict(job.latency))
        with self.cv:
            self._free(job, "done")
        self.metrics.answered(job.latency)
        written = len(job.verbal) + len(job.tokens)
        job.listener("done", Answer(routed, job.hits, reason, completion_tokens=written, reasoning_tokens=len(job.verbal),
                                    prompt_tokens=len(job.prompt) + 1 + job.chunk_tokens))

    def _deliver(self, found: list) -> None:
        """Passages found by the retrieval thread, taken up by the engine thread's next loop."""
        with self.cv:
            self.found.extend(found)
            self.cv.notify_all()
