"""Continuous batching for SR-RAG: the slot pool of `decode.slots`, each request in a phase of its own.

    queue --admit--> T_d: the question prefill (as `routing.route` runs it on one row), p_M, the
                     policy (p_M x kNN p_D); the prompt waits in a parking row (no slot held)
       <Self>  -> enters the pool with its source token: verbalizes until <EOK> / EOS / budget
                  (T_v), is fed `<EOK> Answer:` and answers (T_g), all on the device
       <Wiki>  -> retrieval worker (batched over the rows waiting)       (T_r)
                  -> enters with its source token, passages and `<EOK> Answer:`; answers (T_g)
       <None>  -> enters with its source token and `<EOK> Answer:`; answers (T_g)

One engine thread runs the loop: admit what the parking holds, hand finished retrievals back, let
the rows that have their knowledge enter the pool's free slots, run decode steps over every slot (`slots.steps`, on the
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

import numpy as np

from jaxrag.decode.policy import source_probabilities
from jaxrag.decode.routing import Routed, answer_text, knowledge_chunk, knowledge_text
from jaxrag.decode.sampler import bucket
from jaxrag.decode.slots import ANSWER, VERBAL
from jaxrag.errors import JaxragError
from jaxrag.models.tokens import NONE, SELF, source_token
from jaxrag.policies.srrag import choose_source, policy_distribution
from jaxrag.prompts import prompt_ids
from jaxrag.serve.jobs import Answer, Job, Options, QueueFull, Unavailable
from jaxrag.serve.metrics import Metrics
from jaxrag.decode.engine import Device
from jaxrag.serve.retrieval import RetrievalWorker

MAX_K = 64  # largest kNN k a request may ask for (the datastore is searched once at this k)


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
        self.slots, self.max_queue, self.max_question_tokens = int(slots), int(max_queue), int(max_question_tokens)
        self.device = Device(model, cfg, self.slots, self.max_question_tokens)
        self.eok, self.eos, self.tail = self.device.eok, self.device.eos, self.device.tail
        self.row_buckets = self.device.row_buckets
        self.max_k = min(MAX_K, len(system.datastore))
        self.rows: list[Job | None] = [None] * self.slots  # the pool's rows
        self.parked: list[Job | None] = [None] * self.device.parking_rows  # the parking's rows
        self.waiting: collections.deque[Job] = collections.deque()
        self.found: list[tuple[Job, list]] = []
        self.ready: list[tuple[Job, list[int]]] = []  # rows to enter the pool, with their chunks, this loop
        self.pending = None  # the last call of steps dispatched: its outputs and the jobs it ran
        self.cv = threading.Condition()
        self.stopping, self.serial = False, 0
        self.draining, self.failure, self.rebuilds = False, None, 0  # SIGTERM; the loop's fatal error; pools rebuilt
        self.metrics = Metrics(self)
        self.retrieval = RetrievalWorker(system, self.slots, self._deliver, self._fail)
        self.threads = [threading.Thread(target=self._loop, name="srrag-engine", daemon=True), self.retrieval.thread]

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
        options.check(self.sources, self.max_k, self.cfg.max_answer_tokens)

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

    def _held(self) -> list[Job]:
        """The requests out of the queue: parked or in the pool."""
        return [j for j in (*self.parked, *self.rows) if j is not None]

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
        """Compiles every program a request can run, before the first one: the pool's
        (`Device.warm_up`), the datastore search, and the retriever per encoder length bucket."""
        for logits, hidden in self.device.warm_up():  # p_M and the datastore search, per admission's row count
            source_probabilities(logits, self.src_ids)
            self._neighbours(hidden, 0)
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
                jobs = [*self.waiting, *self._held()]
                self.waiting.clear()
            for job in jobs:
                self._fail(job, e)
            self.retrieval.close()

    def _serve(self) -> None:
        while True:
            with self.cv:
                while not self._work():
                    if self.stopping and not self.waiting and not self._held():
                        self.retrieval.close()
                        return
                    self.cv.wait()
                for job in self._held():
                    if job.cancelled:
                        if job.slot is not None:
                            self.device.idle_next[job.slot] |= job.phase in ("verbalize", "answer")
                        self._free(job, "cancelled")
                admit = []
                while self.waiting and None in self.parked:
                    job = self.waiting.popleft()
                    if job.cancelled:
                        self.metrics.finished("cancelled")
                        continue
                    job.park, job.serial = self.parked.index(None), self.serial
                    self.parked[job.park], self.serial = job, self.serial + 1
                    admit.append(job)
                found, self.found = self.found, []
            try:
                for jobs in _grouped(admit, lambda job: bucket(len(job.prompt))).values():
                    for start in range(0, len(jobs), self.slots):  # at most a slot count per call
                        self._admit(jobs[start:start + self.slots])
                for job, hits in found:
                    if self._parked(job):
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
        for job in self._held():
            self._fail(job, e)
        self.ready, self.pending = [], None
        self.device.reset()
        self.rebuilds += 1

    def _work(self) -> bool:
        return bool(self.found or self.pending is not None or (self.waiting and None in self.parked)
                    or (self.ready and None in self.rows)
                    or any(j.cancelled or j.phase in ("verbalize", "answer") for j in self._held()))

    def _parked(self, job: Job) -> bool:
        return job.park is not None and self.parked[job.park] is job and not job.cancelled

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
        if job.park is not None and self.parked[job.park] is job:
            self.parked[job.park] = None
        job.phase = outcome
        self.metrics.finished(outcome)

    def _row_indices(self, jobs: list[Job], parking: bool = False) -> np.ndarray:
        """The jobs' pool rows (or parking rows), padded to a row bucket."""
        if parking:
            return self.device.padded([j.park for j in jobs], len(self.parked))
        return self.device.padded([j.slot for j in jobs], self.slots)

    def _neighbours(self, hidden: np.ndarray, n: int) -> np.ndarray:
        """Labels [rows, max_k] of the datastore entries nearest the first `n` rows' keys (the
        padding rows' keys zeroed): one search per admission call, at `max_k` over its padded rows,
        so one program per row count."""
        keys = np.array(hidden, np.float32)
        keys[n:] = 0.0
        return self.system.datastore.neighbour_labels(keys, self.max_k)

    def _admit(self, jobs: list[Job]) -> None:
        """T_d for questions admitted together whose prompts share a length bucket: their
        prefills in one call, one datastore search, SR-RAG's policy once per k asked; the rows
        that need no passages are ready to enter the pool, the others go to the retrieval worker."""
        start = time.perf_counter()
        logits, hidden = self.device.admit(self._row_indices(jobs, parking=True), [job.prompt for job in jobs])
        self.metrics.calls.labels("admit").inc()
        p_src, labels = source_probabilities(logits, self.src_ids), self._neighbours(hidden, len(jobs))
        for k, idx in _grouped(range(len(jobs)), lambda i: jobs[i].options.k or self.system.k).items():
            # Eq. 7 once per k asked, p_D from the k nearest of the labels the one search found
            p_d = policy_distribution(labels[idx, :k], len(self.sources))
            source, score = choose_source(p_src[idx], p_d, self.sources, self.system.tau)
            for j, i in enumerate(idx):
                job = jobs[i]
                job.latency["queue"] = start - job.submitted
                job.source = job.options.source or self.sources[int(source[j])]
                job.p_model, job.p_datastore, job.score = p_src[i].tolist(), p_d[j].tolist(), float(score[j])
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
        ready = [(job, chunk) for job, chunk in self.ready if self._parked(job)]
        free = [slot for slot, j in enumerate(self.rows) if j is None]
        ready, self.ready = ready[:len(free)], ready[len(free):]  # the rest wait for a slot
        for (job, _), slot in zip(ready, free):
            job.slot, self.rows[slot] = slot, job
            job.budget = job.options.max_tokens or self.cfg.max_answer_tokens
        width_of = lambda item: min(self.device.klen, bucket(len(item[1]))) if item[1] else 0  # noqa: E731
        for width, group in _grouped(ready, width_of).items():
            jobs = [job for job, _ in group]
            self.device.enter(self._row_indices(jobs), self._row_indices(jobs, parking=True),
                              [self.src_ids[self.sources.index(j.source)] for j in jobs], [c for _, c in group], width,
                              [j.budget for j in jobs], [j.options.temperature for j in jobs],
                              [j.options.top_p for j in jobs], [j.serial for j in jobs])
            self.metrics.calls.labels("enter").inc()
            for job in jobs:
                self.parked[job.park], job.park = None, None  # its prompt is in the pool now
                job.phase, job.tokens = ("verbalize" if width == 0 else "answer"), []
                job.phase_start = time.perf_counter()

    def _dispatch(self):
        """One call of decode steps, dispatched (not waited for): its outputs and the jobs it runs."""
        live = [(slot, j) for slot, j in enumerate(self.rows) if j is not None and j.phase in ("verbalize", "answer")]
        self.metrics.calls.labels("steps").inc()
        return (*self.device.dispatch(), live)

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
        written, read = len(job.verbal) + len(job.tokens), len(job.prompt) + 1 + job.chunk_tokens
        job.listener("done", Answer(routed, job.hits, reason, completion_tokens=written,
                                    reasoning_tokens=len(job.verbal), prompt_tokens=read))

    def _deliver(self, found: list) -> None:
        """Passages found by the retrieval thread, taken up by the engine thread's next loop."""
        with self.cv:
            self.found.extend(found)
            self.cv.notify_all()
