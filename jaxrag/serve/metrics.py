"""The server's Prometheus metrics (`GET /metrics`): queue depth, busy slots, tokens/s, per-phase
latency histograms, requests by outcome, and the programs compiled at start-up and while serving."""

from __future__ import annotations

import collections
import threading
import time

import jax
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PHASES = ("queue", "T_d", "T_r", "T_v", "T_g")
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKENS_WINDOW_S = 10.0  # tokens/s is the rate over the last ten seconds


class Metrics:
    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        Gauge("srrag_queue_depth", "requests waiting for a slot", registry=r).set_function(engine.queued)
        Gauge("srrag_busy_slots", "decode slots holding a request", registry=r).set_function(engine.busy)
        Gauge("srrag_slots", "decode slots", registry=r).set(engine.slots)
        Gauge("srrag_tokens_per_second", f"tokens generated per second over the last {TOKENS_WINDOW_S:.0f} s",
              registry=r).set_function(self.tokens_per_second)
        self.tokens = Counter("srrag_tokens", "tokens generated (verbalizations and answers)", registry=r)
        # the host's wait for a call of decode steps' tokens (the next call is already dispatched)
        self.steps = Histogram("srrag_step_seconds", "the host's wait for the tokens of one call of decode steps",
                               buckets=BUCKETS, registry=r)
        self.calls = Counter("srrag_device_calls", "device calls: question prefills (admit), pool entries (enter), "
                             "calls of decode steps (steps)", ["call"], registry=r)
        # how many requests shared each call of decode steps: 1 everywhere is an engine that serves one at a time
        self.step_rows = Histogram("srrag_step_rows", "requests advanced together by one call of decode steps",
                                   buckets=engine.row_buckets, registry=r)
        self.phase = Histogram("srrag_phase_seconds", "a request's phase latency (queue, T_d, T_r, T_v, T_g)",
                               ["phase"], buckets=BUCKETS, registry=r)
        self.requests = Counter("srrag_requests", "requests by outcome", ["outcome"], registry=r)
        self.compiles = Counter("srrag_compiles", "programs traced for compilation (start-up or serving)",
                                ["when"], registry=r)
        for outcome in ("done", "cancelled", "error"):
            self.requests.labels(outcome)
        for call in ("admit", "enter", "steps"):
            self.calls.labels(call)
        self.when = "startup"
        self.counted = {"startup": 0, "serving": 0}
        self.recent: collections.deque[tuple[float, int]] = collections.deque()
        self.lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._compiled)

    def _compiled(self, event: str, _seconds: float, **_) -> None:
        if event.endswith("jaxpr_trace_duration"):
            self.counted[self.when] += 1
            self.compiles.labels(self.when).inc()

    def serving(self) -> None:
        """Every program is compiled: what is traced from now on counts as compiled while serving."""
        self.when = "serving"
        self.compiles.labels("serving")

    def stepped(self, seconds: float, rows: int, tokens: int) -> None:
        self.steps.observe(seconds)
        self.step_rows.observe(rows)
        self.tokens.inc(tokens)
        now = time.monotonic()
        with self.lock:
            self.recent.append((now, tokens))
            while self.recent and self.recent[0][0] < now - TOKENS_WINDOW_S:
                self.recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self.lock:
            return sum(n for t, n in self.recent if t >= now - TOKENS_WINDOW_S) / TOKENS_WINDOW_S

    def answered(self, latency: dict[str, float]) -> None:
        for phase, seconds in latency.items():
            self.phase.labels(phase).observe(seconds)

    def finished(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
