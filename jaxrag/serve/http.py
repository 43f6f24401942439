"""SR-RAG's HTTP API on FastAPI: OpenAI-compatible chat completions (streamed or not), a batch
route for lists of questions, health and Prometheus metrics. Every answer carries its route.

    POST /v1/chat/completions   the last user message is the question; `stream: true` sends
                                server-sent events; each choice has `srrag` (the trace)
    POST /v1/srrag              {"questions": [...], options} -> {"answers": [{question, answer, srrag}]}
    GET  /v1/models             the served model, as OpenAI lists models
    GET  /health                {"status": "ok", slots, busy, queued}; 503 when the engine has
                                failed or the server is draining (SIGTERM)
    GET  /metrics               Prometheus text

Options (both POST routes): `source` (force a knowledge source), `k` (neighbours for p_D),
`max_tokens` (the answer's), `temperature` (0-2), `top_p` (0-1; 0 is greedy); the default is
greedy, as evaluated. `usage` counts every token the model read (the question's prompt, the
source token, the passages or `<EOK> Answer:`) and wrote (the verbalization, as
`completion_tokens_details.reasoning_tokens`, and the answer); a stream sends it last with
`stream_options: {"include_usage": true}`. A bad request gets one message in OpenAI's error
shape: 400, or 413 for a body over `max_body_bytes` or more questions than the queue holds; a
full queue 429 with Retry-After (retrying helps), a draining or failed engine 503. A client that
disconnects frees its slots, streamed or not.
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
from jaxrag.serve.jobs import Answer, Job, Options, QueueFull, Unavailable

RETRY_AFTER_S = 1
MAX_BODY_BYTES = 1 << 20  # default request body limit (413 beyond)
MAX_MESSAGES = 256  # messages in one chat request (400 beyond)
DISCONNECT_POLL_S = 0.05  # how often a waiting request checks that its client is still there


class OptionFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # OpenAI clients send fields SR-RAG has no use for

    source: str | None = None
    k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None

    def options(self) -> Options:
        greedy = self.top_p == 0  # a nucleus of the top token alone
        return Options(source=self.source, k=self.k, max_tokens=self.max_completion_tokens or self.max_tokens,
                       temperature=0.0 if self.temperature is None or greedy else self.temperature,
                       top_p=1.0 if self.top_p is None or greedy else self.top_p)


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class ChatRequest(OptionFields):
    model: str | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1


class SRRAGRequest(OptionFields):
    questions: list[str] = Field(min_length=1)


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind}}, status, headers=headers)


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, by its Content-Length or once
    that many bytes have arrived (a chunked body, read up to the limit, then handed on whole),
    before the app parses it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit():
            if int(declared) > self.limit:
                return await self.refuse(f"request body of {int(declared)} bytes", scope, receive, send)
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body, more = body + message.get("body", b""), message.get("more_body", False)
            if len(body) > self.limit:
                return await self.refuse(f"request body over {self.limit} bytes", scope, receive, send)
        handed = False

        async def replay():
            nonlocal handed
            if handed:
                return await receive()
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def refuse(self, what: str, scope, receive, send):
        await error(413, f"{what}: this server takes at most {self.limit} (--max-body-bytes)")(scope, receive, send)


def trace(engine: Engine, answer: Answer) -> dict:
    """The route of one answer: source, p_M, p_D, the knowledge, and the phase latencies (s)."""
    r = answer.routed
    named = lambda ps: None if ps is None else dict(zip(engine.sources, ps))
    return {"source": r.source, "p_M": named(r.p_model), "p_D": named(r.p_datastore), "score": r.score,
            "tau": engine.system.tau,
            "knowledge": {"text": r.knowledge, "passages": answer.passages, "truncated": r.knowledge_truncated},
            "latency": r.latency}


def create_app(engine: Engine, model_name: str, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)  # uvicorn has drained the connections: nothing is queued

    app = FastAPI(title="SR-RAG", lifespan=lifespan)
    created = int(time.time())

    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        e = exc.errors()[0]
        if e.get("type") == "json_invalid":
            return error(400, f"malformed JSON: {e.get('ctx', {}).get('error', e['msg'])}")
        where = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
        return error(400, f"{where}: {e['msg']}")

    def jobs(questions: list[str], fields: OptionFields, loop) -> list[tuple[Job, asyncio.Queue]]:
        """The questions' jobs, tokenized (on a worker thread: `intake`) and queued whole."""
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

    async def intake(questions, fields):
        """(jobs, None) or (None, the error response). Tokenizing runs off the event loop."""
        if len(questions) > engine.max_queue:  # no retry can make it fit: not a 429
            return None, error(413, f"questions: {len(questions)}; this server queues at most {engine.max_queue} "
                                    "(--max-queue): send them in several calls")
        try:
            return await asyncio.to_thread(jobs, questions, fields, asyncio.get_running_loop()), None
        except JaxragError as e:
            return None, error(400, str(e))
        except QueueFull as e:
            return None, error(429, f"{e}; retry later", {"Retry-After": str(RETRY_AFTER_S)})
        except Unavailable as e:
            return None, error(503, str(e), {"Retry-After": str(RETRY_AFTER_S)})

    async def answered(request: Request, queued) -> list[Answer] | None:
        """Every job's answer, or None when the client disconnects first (FastAPI does not cancel
        a handler whose client left: this watches for it)."""
        waiting = asyncio.ensure_future(asyncio.gather(*(finished(job, events) for job, events in queued)))

        async def gone():
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        watch = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({waiting, watch}, return_when=asyncio.FIRST_COMPLETED)
            return waiting.result() if waiting.done() else None
        finally:  # the handler cancelled too (its server stopping): neither task outlives it
            watch.cancel()
            waiting.cancel()

    async def settled(request: Request, queued) -> tuple[list[Answer] | None, Response | None]:
        """(every job's answer, None), or (None, the response): 500 naming a failed job, 499 when
        the client left. Jobs left unfinished are cancelled, freeing their slots."""
        try:
            answers = await answered(request, queued)
        except RuntimeError as e:
            return None, error(500, str(e))
        finally:
            for job, _ in queued:
                if job.phase not in ("done", "error"):
                    engine.cancel(job)
        return (answers, None) if answers is not None else (None, Response(status_code=499))  # nginx's: nobody reads it

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        users = [m.content for m in body.messages if m.role == "user"]
        if not users:
            return error(400, "messages: no user message (the last one is the question)")
        if body.n != 1:
            return error(400, f"n {body.n}: SR-RAG answers one choice per question")
        started, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        queued, failed = await intake([users[-1]], body)
        if failed:
            return failed
        job, events = queued[0]
        head = {"id": cid, "created": started, "model": body.model or model_name}
        if body.stream:
            with_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(job, events, head, with_usage), media_type="text/event-stream")
        answers, failed = await settled(request, queued)
        if failed:
            return failed
        answer = answers[0]
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.routed.answer},
                             "finish_reason": answer.finish_reason, "srrag": trace(engine, answer)}],
                "usage": usage(answer)}

    def usage(answer: Answer) -> dict:
        return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
                "total_tokens": answer.prompt_tokens + answer.completion_tokens,
                "completion_tokens_details": {"reasoning_tokens": answer.reasoning_tokens}}

    async def stream(job: Job, events: asyncio.Queue, head: dict, with_usage: bool):
        def chunk(delta, finish=None, **extra):
            body = {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
            return "data: " + json.dumps({**body, "usage": None} if with_usage else body) + "\n\n"
        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, value = await events.get()
                if kind == "delta":
                    yield chunk({"content": value})
                elif kind == "done":
                    yield chunk({}, value.finish_reason, srrag=trace(engine, value))
                    if with_usage:  # OpenAI's last chunk: no choices, the whole request's usage
                        yield "data: " + json.dumps({**head, "object": "chat.completion.chunk", "choices": [],
                                                     "usage": usage(value)}) + "\n\n"
                    break
                else:
                    yield "data: " + json.dumps({"error": {"message": value, "type": "server_error"}}) + "\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream: its slot is freed at the next step
            if job.phase not in ("done", "error"):
                engine.cancel(job)

    @app.post("/v1/srrag")
    async def srrag(body: SRRAGRequest, request: Request):
        queued, failed = await intake(body.questions, body)
        if failed:
            return failed
        answers, failed = await settled(request, queued)
        if failed:
            return failed
        return {"model": model_name, "answers": [
            {"question": a.routed.question, "answer": a.routed.answer, "finish_reason": a.finish_reason,
             "srrag": trace(engine, a), "usage": usage(a)} for a in answers]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jaxrag"}]}

    @app.get("/health")
    async def health():
        state = {"slots": engine.slots, "busy": engine.busy(), "queued": engine.queued()}
        if engine.failure is not None:
            return JSONResponse({"status": "failed", "error": engine.failure, **state}, 503)
        if engine.draining or engine.stopping:
            return JSONResponse({"status": "draining", **state}, 503)
        return {"status": "ok", **state}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app
