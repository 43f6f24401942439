"""What a request is inside the engine: its options, its state while in flight, its answer."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from jaxrag.decode.routing import Routed
from jaxrag.errors import JaxragError

MAX_TEMPERATURE = 2.0  # OpenAI's bound


class QueueFull(Exception):
    """The waiting queue holds `max_queue` requests."""


class Unavailable(Exception):
    """The engine takes no request: it is draining (SIGTERM) or its loop has failed."""


@dataclasses.dataclass(frozen=True)
class Options:
    """Per-request settings; None = the export's."""

    source: str | None = None  # forced knowledge source (skips the policy's choice)
    k: int | None = None  # neighbours for p_D
    max_tokens: int | None = None  # answer tokens
    temperature: float = 0.0  # 0 = greedy, as evaluated
    top_p: float = 1.0

    def check(self, sources: tuple[str, ...], max_k: int, max_answer_tokens: int) -> None:
        """JaxragError naming the first option out of its bounds (OpenAI's for the sampling)."""
        if self.source is not None and self.source not in sources:
            raise JaxragError(f"source {self.source!r}: this model's sources are {', '.join(sources)}")
        if self.k is not None and not 1 <= self.k <= max_k:
            raise JaxragError(f"k {self.k}: must be between 1 and {max_k}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= max_answer_tokens:
            raise JaxragError(f"max_tokens {self.max_tokens}: must be between 1 and {max_answer_tokens}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise JaxragError(f"temperature {self.temperature}: must be between 0 and {MAX_TEMPERATURE:g}")
        if not 0.0 < self.top_p <= 1.0:  # top_p 0 (the top token alone) is greedy: `http.OptionFields`
            raise JaxragError(f"top_p {self.top_p}: must be between 0 and 1")


@dataclasses.dataclass
class Answer:
    """A finished request: the route as `SRRAG.ask` returns it, and the passages' ids and titles."""

    routed: Routed
    passages: list[dict] | None
    finish_reason: str  # "stop" (EOS) or "length"
    completion_tokens: int  # tokens the model wrote: the verbalization (a Self row's) and the answer
    reasoning_tokens: int  # of which the verbalization
    prompt_tokens: int  # tokens the model read: the question's prompt, the source token, the knowledge chunk


class Job:
    """One question in flight. `listener(kind, value)` is called on the engine's threads:
    ("delta", answer text), then ("done", Answer) or ("error", message)."""

    def __init__(self, question: str, prompt: list[int], options: Options, listener: Callable):
        self.question, self.prompt, self.options, self.listener = question, prompt, options, listener
        self.cancelled = False
        self.slot: int | None = None  # its row of the engine's pool, once it entered
        self.park: int | None = None  # its parking row, from admission until it enters the pool
        self.serial = 0  # the engine's count of admissions before it: its sampling keys' row id
        self.submitted = time.perf_counter()
        self.latency: dict[str, float] = {}
        self.phase = "queued"
        self.tokens: list[int] = []
        self.verbal: list[int] = []
        self.verbal_stopped = False
        self.passages: list[str] | None = None
        self.hits = None
        self.sent = ""  # answer text streamed so far
        # set at admission and at each phase change
        self.source, self.p_model, self.p_datastore, self.score = None, None, None, None
        self.budget, self.truncated, self.phase_start = 0, False, 0.0  # budget: the answer's tokens
        self.chunk_tokens = 0  # the knowledge chunk's length (passages, `<EOK> Answer:`) once read
