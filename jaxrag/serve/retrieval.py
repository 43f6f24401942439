"""Retrieval off the decode loop: the engine thread queues the rows that chose `<Wiki>`; a thread
of its own searches for every row queued meanwhile in one encoder + index call, so a row waiting
for passages never stalls the others, and hands the hits back to the engine."""

from __future__ import annotations

import threading
from typing import Callable

from jaxrag.errors import JaxragError


class RetrievalWorker:
    def __init__(self, system, slots: int, deliver: Callable[[list], None], fail: Callable):
        """`deliver([(job, hits), ...])` hands a batch's passages to the engine; `fail(job, error)`
        fails one row."""
        self.system, self.slots, self.deliver, self.fail = system, slots, deliver, fail
        self.pending: list = []
        self.closed = False
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="srrag-retrieval", daemon=True)

    def put(self, job) -> None:
        with self.cv:
            self.pending.append(job)
            self.cv.notify_all()

    def close(self) -> None:
        """No more rows will come: the thread ends once the queued ones are searched."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.pending:
                    if self.closed:
                        return
                    self.cv.wait()
                batch, self.pending = self.pending, []
            try:
                found = self.search([j.question for j in batch])
            except Exception as e:  # every row of the batch fails; the others keep going
                for job in batch:
                    self.fail(job, JaxragError(f"retrieval failed: {e}"))
                continue
            self.deliver(list(zip(batch, found)))

    def search(self, questions: list[str]) -> list:
        """Top-n passages per question; batches are padded to the slot count (one program per
        encoder length bucket)."""
        out = []
        for start in range(0, len(questions), self.slots):
            part = questions[start:start + self.slots]
            padded = part + [part[0]] * (self.slots - len(part))
            out += self.system.retriever.search(padded, self.system.n_passages, batch_size=self.slots)[:len(part)]
        return out
