"""Continuous batching for SR-RAG: a fixed pool of decode slots, each request in a phase of its own.

    queue --admit--> T_d: the question prefill (`sampler.extend`, as `routing.route` on one row), p_M,
                     the policy (p_M x kNN p_D), the source token; the row joins the pool
       <Self>  -> verbalize: pool steps until <EOK> / EOS / budget       (T_v)
       <Wiki>  -> retrieval worker (batched over the rows waiting)       (T_r)
       <None>  -> nothing
            -> knowledge chunk + `<EOK> Answer:` into the row, then answer steps  (T_g)

One engine thread runs the loop: admit what fits, hand finished retrievals back, prefill the
knowledge of the rows that have it, decode steps over every decoding row (`slots.steps`, on
device until a row ends its phase), repeat. Rows that reach a prefill together share one call
(`slots.admit_rows`: the questions admitted together whose prompts share a length bucket;
`slots.prefill_rows`: source tokens, knowledge chunks of one width), padded to a power of two
up to the slot count. Retrieval runs on its own thread, so a row waiting for passages never
stalls the others, and questions that need passages at the same time share one encoder + index
call. Every prefill and decode shape is bucketed and compiled by `warm_up` before the first
request; the metrics count the programs traced after it (zero while serving).

A row's prefills and decode steps compute what `route` computes for that question alone (same
prompt bucket, cache length, columns and positions), mapped over the rows of a wider batch:
greedy answers and traces equal `SRRAG.ask([q])` (`tests/test_serve.py`).
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
from jaxrag.decode.sampler import NO_TOKEN, bucket, left_pad, stop_matrix
from jaxrag.decode.slots import admit_rows, init_pool, prefill_rows, steps
from jaxrag.errors import JaxragError
from jaxrag.models.tokens import EOK, NONE, SELF, source_token
from jaxrag.policies.srrag import srrag_policy
from jaxrag.prompts import answer_prefix_ids, prompt_ids
from jaxrag.serve.jobs import Answer, Job, Options, QueueFull, Unavailable
from jaxrag.serve.metrics import Metrics
from jaxrag.serve.retrieval import RetrievalWorker

MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_K = 64  # largest kNN k a request may ask for (the datastore is searched once at this k)
# Decode steps per call at most: a call also ends as soon as a row ends its phase, so a waiting
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
        self.pool = init_pool(self.dec, self.slots, self._length(self.prompt_buckets[-1]))
        self.rows: list[Job | None] = [None] * self.slots
        self.waiting: collections.deque[Job] = collections.deque()
        self.found: list[tuple[Job, list]] = []
        self.ready: list[tuple[Job, list[int]]] = []  # knowledge chunks to prefill, this loop
        self.cv = threading.Condition()
        self.stopping, self.dispatches, self.key = False, 0, jax.random.key(0)
        self.draining, self.failure, self.rebuilds = False, None, 0  # SIGTERM; the loop's fatal error; pools rebuilt
        self.metrics = Metrics(self)
        # The decoder bound once: nnx.jit would walk its module graph on every call.
        self._admit_rows, self._prefill_rows, self._steps = (nnx.cached_partial(f, self.dec)
                                                             for f in (admit_rows, prefill_rows, steps))
        self.retrieval = RetrievalWorker(system, self.slots, self._deliver, self._fail)
        self.threads = [threading.Thread(target=self._loop, name="srrag-engine", daemon=True), self.retrieval.thread]

    def _length(self, plen: int) -> int:
        """Cache slots of a question of `plen` (bucketed) tokens, as `route` sizes it alone."""
        return plen + 1 + self.vlen + self.klen + self.alen

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
            for width in [1, *self.chunk_buckets]:
                self._prefill(rows, [[filler] * width] * n, width)
        self._policy(self.system.k)(PolicyInputs([""], self.sources, p_src[:1], hidden[:1]))
        self._run_steps(np.ones(self.slots, bool), np.full((self.slots, 2), NO_TOKEN, np.int32),
                        np.ones(self.slots, np.int32), np.full(self.slots, 0.5, np.float32),
                        np.full(self.slots, 0.9, np.float32))
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
                        self._free(job, "cancelled")
                admit = []
                while self.waiting and None in self.rows:
                    job = self.waiting.popleft()
                    if job.cancelled:
                        self.metrics.finished("cancelled")
                        continue
                    job.slot = self.rows.index(None)
                    self.rows[job.slot] = job
                    admit.append(job)
                found, self.found = self.found, []
            for jobs in _grouped(admit, lambda job: bucket(len(job.prompt))).values():
                self._together(jobs, self._admit)
            for job, hits in found:
                if self.rows[job.slot] is job and not job.cancelled:
                    self._guarded(job, lambda j: self._retrieved(j, hits))
            self._prefill_knowledge()
            if any(j is not None and j.phase in ("verbalize", "answer") for j in self.rows):
                try:
                    self._step()
                except Exception as e:
                    self._rebuild(e)
                self._prefill_knowledge()

    def _rebuild(self, e: Exception) -> None:
        """A failed call of decode steps took the pool with it (donated): every row in the pool
        fails (its cache is gone), and a fresh pool serves the queue."""
        for job in [j for j in self.rows if j is not None]:
            self._fail(job, e)
        self.ready = []
        self.pool = init_pool(self.dec, self.slots, self._length(self.prompt_buckets[-1]))
        self.rebuilds += 1

    def _work(self) -> bool:
        return bool(self.found or (self.waiting and None in self.rows)
                    or any(j is not None and (j.cancelled or j.phase in ("verbalize", "answer")) for j in self.rows))

    def _guarded(self, job: Job, fn) -> None:
        try:
            fn(job)
        except Exception as e:  # one request's failure is its own; the engine keeps serving
            self._fail(job, e)

    def _together(self, jobs: list[Job], fn) -> None:
        """fn(jobs), one call for rows that share a program; its failure fails those rows only."""
        try:
            fn(jobs)
        except Exception as e:
            for job in jobs:
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
        its row: p_M [rows, sources] and the hidden state at <EOQ> [rows, hidden]."""
        plen = bucket(max(map(len, prompts)))
        ids, mask = left_pad(prompts, plen, len(rows))
        self.pool, logits, hidden = self._admit_rows(self.pool, jnp.asarray(rows), jnp.asarray(ids), jnp.asarray(mask),
                                                     length=self._length(plen), hidden_layer=self.cfg.hidden_layer)
        return source_probabilities(logits, self.src_ids), np.asarray(hidden)

    def _prefill(self, rows: np.ndarray, chunks: list[list[int]], width: int) -> None:
        ids, mask = left_pad(chunks, width, len(rows))
        self.pool = self._prefill_rows(self.pool, jnp.asarray(rows), jnp.asarray(ids), jnp.asarray(mask))

    def _policy(self, k: int):
        """SR-RAG's policy with p_D from the k nearest entries (one search at `max_k`: one program)."""
        store = self.system.datastore
        return srrag_policy(lambda keys: store.neighbour_labels(np.asarray(keys, np.float32), self.max_k)[:, :k],
                            self.system.tau)

    def _admit(self, jobs: list[Job]) -> None:
        """T_d for questions admitted together whose prompts share a length bucket: their
        prefills in one call, each one's policy, their source tokens in one call."""
        start = time.perf_counter()
        rows = self._row_indices(jobs)
        p_src, hidden = self._prefill_questions(rows, [job.prompt for job in jobs])
        for i, job in enumerate(jobs):
            job.latency["queue"] = start - job.submitted
            inputs = PolicyInputs([job.question], self.sources, p_src[i:i + 1], hidden[i:i + 1])
            decision = self._policy(job.options.k or self.system.k)(inputs)
            job.source = job.options.source or self.sources[int(np.asarray(decision.source)[0])]
            job.p_model = p_src[i].tolist()
            job.p_datastore = None if decision.p_datastore is None else np.asarray(decision.p_datastore[0]).tolist()
            job.score = None if decision.score is None else float(decision.score[0])
        self._prefill(rows, [[self.src_ids[self.sources.index(job.source)]] for job in jobs], 1)
        jax.block_until_ready(self.pool)
        t_d = time.perf_counter() - start
        for job in jobs:
            job.latency["T_d"] = t_d
            if job.source == SELF:
                job.phase, job.tokens, job.budget, job.stops = "verbalize", [], self.cfg.max_verbal_tokens, [self.eok, *self.eos]
                job.phase_start = time.perf_counter()
            elif job.source == NONE:
                self._knowledge(job, [])
            else:
                job.phase, job.phase_start = "retrieve", time.perf_counter()
                self.retrieval.put(job)

    def _retrieved(self, job: Job, hits) -> None:
        job.latency["T_r"] = time.perf_counter() - job.phase_start
        job.hits = [{"id": h.passage.id, "title": h.passage.title} for h in hits]
        self._knowledge(job, [h.passage.to_prompt() for h in hits])

    def _knowledge(self, job: Job, passages: list[str] | None) -> None:
        """The row's knowledge chunk (passages; nothing for Self, whose verbalization is in the
        row) and `<EOK> Answer:`, prefilled by `_prefill_knowledge` in this loop; T_g starts
        (as `route` times it)."""
        job.phase_start = time.perf_counter()
        job.passages = passages
        has_eok = job.verbal_stopped and bool(job.verbal) and job.verbal[-1] == self.eok
        chunk, job.truncated = knowledge_chunk(self.tok, passages, job.verbal_stopped, has_eok, self.tail,
                                               self.cfg.max_knowledge_tokens)
        job.phase, job.chunk_tokens = "knowledge", len(chunk)
        self.ready.append((job, chunk))

    def _prefill_knowledge(self) -> None:
        """The ready rows' chunks into their rows, one call per chunk width; then their answer phase."""
        ready = [(job, chunk) for job, chunk in self.ready if self.rows[job.slot] is job and not job.cancelled]
        self.ready = []
        for width, group in _grouped(ready, lambda item: min(self.klen, bucket(len(item[1])))).items():
            jobs = [job for job, _ in group]
            self._together(jobs, lambda jobs: self._prefill(self._row_indices(jobs), [c for _, c in group], width))
            for job in jobs:
                if job.phase == "knowledge":
                    job.phase, job.tokens, job.stops = "answer", [], self.eos
                    job.budget = job.options.max_tokens or self.cfg.max_answer_tokens

    def _step(self) -> None:
        live = np.array([j is not None and j.phase in ("verbalize", "answer") for j in self.rows])
        rows = [(j if on else None) for j, on in zip(self.rows, live)]
        stops = stop_matrix([j.stops if j else [] for j in rows], self.slots)
        stops = np.pad(stops, ((0, 0), (0, 2 - stops.shape[1])), constant_values=NO_TOKEN)  # one width: one program
        budget = np.array([j.budget - len(j.tokens) if j else 0 for j in rows], np.int32)
        temperature = np.array([j.options.temperature if j else 0.0 for j in rows], np.float32)
        top_p = np.array([j.options.top_p if j else 1.0 for j in rows], np.float32)
        start = time.perf_counter()
        tokens = self._run_steps(live, stops, budget, temperature, top_p)
        self.metrics.stepped(time.perf_counter() - start, int(live.sum()), int((tokens != NO_TOKEN).sum()))
        for slot in np.flatnonzero(live):
            job = self.rows[slot]
            new = [int(t) for t in tokens[slot] if t != NO_TOKEN]
            job.tokens += new
            hit = bool(new) and new[-1] in job.stops
            if job.phase == "answer":
                self._stream(job)
            if hit or len(job.tokens) >= job.budget:
                if job.phase == "verbalize":
                    job.latency["T_v"] = time.perf_counter() - job.phase_start
                    job.verbal, job.verbal_stopped = job.tokens, hit
                    self._guarded(job, lambda j: self._knowledge(j, None))
                else:
                    self._finish(job, "stop" if hit else "length")

    def _run_steps(self, live, stops, budget, temperature, top_p) -> np.ndarray:
        self.pool, tokens, _ = self._steps(self.pool, jnp.asarray(live), jnp.asarray(stops), jnp.asarray(budget),
                                           jnp.asarray(temperature), jnp.asarray(top_p),
                                           jax.random.fold_in(self.key, self.dispatches), max_steps=STEPS_PER_CALL)
        self.dispatches += 1
        return np.asarray(tokens)

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
