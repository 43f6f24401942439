"""SR-RAG's HTTP API on FastAPI: OpenAI-compatible chat completions (streamed or not), a batch
route for lists of questions, health and Prometheus metrics. Every answer carries its route.

    POST /v1/chat/completions   the last user message is the question; `stream: true` sends
                                server-sent events; each choice has `srrag` (the trace)
    POST /v1/srrag              {"questions": [...], options} -> {"answers": [{question, answer, srrag}]}
    GET  /health                {"status": "ok", slots, busy, queued}
    GET  /metrics               Prometheus text

Options (both POST routes): `source` (force a knowledge source), `k` (neighbours for p_D),
`max_tokens`, `temperature`, `top_p`; the default is greedy, as evaluated. A bad request gets a
4xx with one message in OpenAI's error shape; a full queue gets 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from jaxrag.errors import JaxragError
from jaxrag.serve.engine import Engine
from jaxrag.serve.jobs import Answer, Job, Options, QueueFull

RETRY_AFTER_S = 1


class OptionFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # OpenAI clients send fields SR-RAG has no use for

    source: str | None = None
    k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None

    def options(self) -> Options:
        return Options(source=self.source, k=self.k, max_tokens=self.max_completion_tokens or self.max_tokens,
                       temperature=0.0 if self.temperature is None else self.temperature,
                       top_p=1.0 if self.top_p is None else self.top_p)


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str


class ChatRequest(OptionFields):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    n: int = 1


class SRRAGRequest(OptionFields):
    questions: list[str] = Field(min_length=1)


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind}}, status, headers=headers)


def trace(engine: Engine, answer: Answer) -> dict:
    """The route of one answer: source, p_M, p_D, the knowledge, and the phase latencies (s)."""
    r = answer.routed
    named = lambda ps: None if ps is None else dict(zip(engine.sources, ps))
    return {"source": r.source, "p_M": named(r.p_model), "p_D": named(r.p_datastore), "score": r.score,
            "tau": engine.system.tau,
            "knowledge": {"text": r.knowledge, "passages": answer.passages, "truncated": r.knowledge_truncated},
            "latency": r.latency}


def create_app(engine: Engine, model_name: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)  # uvicorn has drained the connections: nothing is queued

    app = FastAPI(title="SR-RAG", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        e = exc.errors()[0]
        if e.get("type") == "json_invalid":
            return error(400, f"malformed JSON: {e.get('ctx', {}).get('error', e['msg'])}")
        where = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
        return error(400, f"{where}: {e['msg']}")

    def jobs(questions: list[str], fields: OptionFields, loop) -> list[tuple[Job, asyncio.Queue]]:
        options = fields.options()
        engine.check(options)
        out = []
        for i, q in enumerate(questions):
            try:
                prompt = engine.prompt(q)
            except JaxragError as e:
                raise JaxragError(f"question {i}: {e}" if len(questions) > 1 else str(e)) from None
            events: asyncio.Queue = asyncio.Queue()
            listener = lambda kind, value, events=events: loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            out.append((Job(q, prompt, options, listener), events))
        engine.submit([j for j, _ in out])
        return out

    async def finished(job: Job, events: asyncio.Queue) -> Answer:
        while True:
            kind, value = await events.get()
            if kind == "done":
                return value
            if kind == "error":
                raise RuntimeError(value)

    def intake(questions, fields):
        """(jobs, None) or (None, the error response)."""
        try:
            return jobs(questions, fields, asyncio.get_running_loop()), None
        except JaxragError as e:
            return None, error(400, str(e))
        except QueueFull as e:
            return None, error(429, f"{e}; retry later", {"Retry-After": str(RETRY_AFTER_S)})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        users = [m.content for m in body.messages if m.role == "user"]
        if not users:
            return error(400, "messages: no user message (the last one is the question)")
        if body.n != 1:
            return error(400, f"n {body.n}: SR-RAG answers one choice per question")
        started, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        queued, failed = intake([users[-1]], body)
        if failed:
            return failed
        job, events = queued[0]
        head = {"id": cid, "created": started, "model": body.model or model_name}
        if body.stream:
            return StreamingResponse(stream(job, events, head), media_type="text/event-stream")
        try:
            answer = await finished(job, events)
        except RuntimeError as e:
            return error(500, str(e))
        finally:
            if job.phase not in ("done", "error"):
                engine.cancel(job)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.routed.answer},
                             "finish_reason": answer.finish_reason, "srrag": trace(engine, answer)}],
                "usage": usage(job, answer)}

    def usage(job: Job, answer: Answer) -> dict:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": answer.completion_tokens,
                "total_tokens": len(job.prompt) + answer.completion_tokens}

    async def stream(job: Job, events: asyncio.Queue, head: dict):
        chunk = lambda delta, finish=None, **extra: "data: " + json.dumps(
            {**head, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}) + "\n\n"
        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, value = await events.get()
                if kind == "delta":
                    yield chunk({"content": value})
                elif kind == "done":
                    yield chunk({}, value.finish_reason, srrag=trace(engine, value))
                    break
                else:
                    yield "data: " + json.dumps({"error": {"message": value, "type": "server_error"}}) + "\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream: its slot is freed at the next step
            if job.phase not in ("done", "error"):
                engine.cancel(job)

    @app.post("/v1/srrag")
    async def srrag(body: SRRAGRequest):
        queued, failed = intake(body.questions, body)
        if failed:
            return failed
        try:
            answers = [await finished(job, events) for job, events in queued]
        except RuntimeError as e:
            return error(500, str(e))
        finally:
            for job, _ in queued:
                if job.phase not in ("done", "error"):
                    engine.cancel(job)
        return {"model": model_name, "answers": [
            {"question": a.routed.question, "answer": a.routed.answer, "finish_reason": a.finish_reason,
             "srrag": trace(engine, a)} for a in answers]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "slots": engine.slots, "busy": engine.busy(), "queued": engine.queued()}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app
