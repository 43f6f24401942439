"""`python -m jaxrag.serve` as a real server process on 127.0.0.1, driven by real clients (httpx,
the `openai` client): answers and traces equal `SRRAG.ask([q])` alone under concurrent load, which
shares decode steps; a queue's worth of questions in one call; `usage` and `/v1/models`; bad
input, limits (413), a full queue (429; the HTTP app in this process), clients leaving mid-stream
and while waiting, a failed decode step, a failed or draining engine (503; in this process),
nothing compiled while serving, SIGTERM, and exports refused at start.

One server (4 slots) serves the whole module; its export is `benchmarks.serve_exports.tiny_export`
(random weights, a MiniLM passage index, a datastore whose kNN sends about half the questions
to each source)."""

import asyncio
import json
import random
import shutil
import signal
import time

import httpx
import numpy as np
import openai
import pytest

from benchmarks.serve_exports import tiny_questions
from serve_fixtures import (QUESTION_TOKENS, QUESTIONS, QUEUE, SLOTS, assert_same_route, device_calls,  # noqa: F401 - fixtures
                            export, free_port, metric, reference, server, shared_steps, start_server, url)


def test_concurrent_answers_equal_each_question_alone(url, reference):
    """64 clients at random arrival times, in random order, 4 slots: every answer and trace is
    `SRRAG.ask([q])`'s for that question alone, each question is answered exactly once, and the
    requests shared the pool's decode steps (an engine serving one at a time advances one row per call)."""
    system, alone = reference
    before, calls_before = shared_steps(url), device_calls(url)
    rng = random.Random(5)
    order = rng.sample(QUESTIONS, len(QUESTIONS))
    delays = np.cumsum([rng.expovariate(40.0) for _ in order])  # Poisson arrivals, 40/s

    async def ask(client, q, delay):
        await asyncio.sleep(delay)
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": q}]})
        assert r.status_code == 200, r.text
        return q, r.json()

    async def load():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*(ask(client, q, d) for q, d in zip(order, delays)))

    answered = asyncio.run(load())
    assert sorted(q for q, _ in answered) == sorted(QUESTIONS)
    ids = {body["id"] for _, body in answered}
    assert len(ids) == len(QUESTIONS)
    sources = system.model.sources
    for q, body in answered:
        (choice,) = body["choices"]
        assert_same_route(choice["srrag"], choice["message"]["content"], alone[q], sources)
        assert set(choice["srrag"]["latency"]) >= {"queue", "T_d", "T_g"}
        if choice["srrag"]["source"] == "wiki":
            assert "T_r" in choice["srrag"]["latency"] and len(choice["srrag"]["knowledge"]["passages"]) == 2
            titles = [p["title"] for p in choice["srrag"]["knowledge"]["passages"]]
            assert all(f"(Title: {t})" in choice["srrag"]["knowledge"]["text"] for t in titles)
        else:
            assert "T_v" in choice["srrag"]["latency"] and choice["srrag"]["knowledge"]["passages"] is None
    routes = [body["choices"][0]["srrag"]["source"] for _, body in answered]
    assert routes.count("wiki") >= 16 and routes.count("self") >= 16, routes
    assert metric(url, "srrag_busy_slots") == 0 and metric(url, "srrag_queue_depth") == 0
    calls, shared, rows = shared_steps(url) - before
    print(f"decode calls {calls:.0f}, shared by several requests {shared:.0f}, requests per call {rows / calls:.2f}")
    assert shared >= calls / 4 and rows / calls >= 1.5, (calls, shared, rows)  # one at a time: 0 and 1.0
    admit, enter, steps = device_calls(url) - calls_before
    # every call of steps dispatched was read (the one dispatched after the last answer's call may
    # still be in flight); each question is admitted and enters once, alone or sharing the call
    assert calls <= steps <= calls + 1 and 0 < admit <= len(QUESTIONS) and 0 < enter <= len(QUESTIONS), \
        (admit, enter, steps, calls)


def test_batch_route_and_openai_client(url, reference, export):
    """/v1/srrag answers a list with the same traces, and a queue's worth of questions in one call;
    the openai client reads the extra field, streams the same answer, and forces a source."""
    system, alone = reference
    batch = QUESTIONS[:6]
    r = httpx.post(f"{url}/v1/srrag", json={"questions": batch}, timeout=120)
    assert r.status_code == 200, r.text
    assert [a["question"] for a in r.json()["answers"]] == batch
    for a in r.json()["answers"]:
        assert_same_route(a["srrag"], a["answer"], alone[a["question"]], system.model.sources)

    full = httpx.post(f"{url}/v1/srrag", json={"questions": tiny_questions(QUEUE, seed=12), "max_tokens": 8},
                      timeout=300)
    assert full.status_code == 200 and len(full.json()["answers"]) == QUEUE  # a whole queue's worth in one call

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    q = QUESTIONS[0]
    done = client.chat.completions.create(model="srrag", messages=[{"role": "user", "content": q}])
    assert done.choices[0].message.content == alone[q].answer
    assert done.choices[0].model_extra["srrag"]["source"] == alone[q].source
    chunks = list(client.chat.completions.create(model="srrag", messages=[{"role": "user", "content": q}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == alone[q].answer
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices[0].model_extra["srrag"]["source"] == alone[q].source
    other = "self" if alone[q].source == "wiki" else "wiki"
    forced = client.chat.completions.create(model="srrag", messages=[{"role": "user", "content": q}], max_tokens=5,
                                            temperature=0.7, top_p=0.9, extra_body={"source": other, "k": 3})
    trace = forced.choices[0].model_extra["srrag"]
    assert trace["source"] == other
    assert forced.usage.completion_tokens - forced.usage.completion_tokens_details.reasoning_tokens <= 5  # the answer's
    assert sum(trace["p_D"].values()) == pytest.approx(1.0) and all(round(p * 3, 6) % 1 == 0 for p in trace["p_D"].values())
    assert [m.id for m in client.models.list().data] == [export.resolve().name]  # the export's folder
    greedy = client.chat.completions.create(model="srrag", messages=[{"role": "user", "content": q}], top_p=0)
    assert greedy.choices[0].message.content == alone[q].answer  # top_p 0: the top token alone


def test_usage_counts_every_token_read_and_written(url, reference):
    """`usage`: the model read the question's prompt, the source token and the knowledge chunk
    (the passages, or `<EOK> Answer:` after a verbalization), and wrote the verbalization
    (`reasoning_tokens`) and the answer; a stream with `include_usage` ends with the same usage."""
    from jaxrag.prompts import prompt_ids

    system, _ = reference
    tok = system.model.tokenizer
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    q = QUESTIONS[4]
    question = len(prompt_ids(tok, [q])[0])
    ask = lambda source, **kw: client.chat.completions.create(  # noqa: E731
        model="srrag", messages=[{"role": "user", "content": q}], max_tokens=5, extra_body={"source": source}, **kw)
    wiki = ask("wiki")
    written = 5 if wiki.choices[0].finish_reason == "length" else None  # 5 answer tokens, else fewer (EOS)
    assert wiki.usage.completion_tokens_details.reasoning_tokens == 0
    assert wiki.usage.completion_tokens == written if written else 0 < wiki.usage.completion_tokens <= 5
    # the question, the source token, the passages (cut to the knowledge budget), and the few
    # tokens of their separators and `<EOK> Answer:`
    passages = wiki.choices[0].model_extra["srrag"]["knowledge"]["text"]
    read = question + 1 + min(len(tok(passages, add_special_tokens=False)["input_ids"]),
                              system.route_cfg.max_knowledge_tokens)
    assert read < wiki.usage.prompt_tokens <= read + 16, (wiki.usage, read)
    assert wiki.usage.total_tokens == wiki.usage.prompt_tokens + wiki.usage.completion_tokens
    own = ask("self")
    reasoning = own.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning <= system.route_cfg.max_verbal_tokens  # to <EOK>, or the verbalization budget
    answer = own.usage.completion_tokens - reasoning
    assert answer == 5 if own.choices[0].finish_reason == "length" else 0 < answer <= 5  # EOS included
    assert question + 1 < own.usage.prompt_tokens < read  # `<EOK> Answer:` after it, no passages
    chunks = list(ask("self", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == own.usage
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("body, field", [
    ('{"messages": [{"role": "user", "content": "Where', "malformed JSON"),
    ({"messages": "Where is the river of Peru?"}, "messages"),
    ({"messages": [{"role": "user", "content": "Where?"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "   "}]}, "empty"),
    ({"messages": [{"role": "user", "content": "river " * 200}]}, "at most 64"),
    ({"messages": [{"role": "user", "content": "Where?"}], "source": "web"}, "source 'web'"),
    ({"messages": [{"role": "user", "content": "Where?"}], "k": 0}, "k 0"),
    ({"messages": [{"role": "user", "content": "Where?"}], "top_p": 1.5}, "top_p 1.5: must be between 0 and 1"),
    ({"messages": [{"role": "user", "content": "Where?"}], "temperature": 2.5}, "temperature 2.5: must be between 0 and 2"),
    ({"messages": [{"role": "user", "content": "Where?"}], "max_tokens": 100000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "Where?"}], "max_tokens": 0}, "max_tokens 0"),
    ({"messages": [{"role": "user", "content": "Where?"}] * 257}, "messages: List should have at most 256 items"),
    ({"questions": []}, "questions"),
])
def test_bad_request_gets_one_clear_4xx_and_the_server_keeps_serving(url, body, field):
    route = "/v1/srrag" if "questions" in body else "/v1/chat/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + route, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert field in message and "\n" not in message, message
    ok = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Where?"}],
                                                         "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_a_full_queue_takes_its_last_request_and_refuses_one_more_with_429(reference):
    """The HTTP app over an engine whose loop is not started, so nothing leaves the queue: a batch
    of QUEUE - 1 questions and one chat request fill it to exactly its limit; one more request gets
    429 with Retry-After, and the queue keeps what it held (a request is queued whole or not at all)."""
    from jaxrag.serve.engine import Engine
    from jaxrag.serve.http import create_app

    system, _ = reference
    engine = Engine(system, slots=SLOTS, max_queue=QUEUE, max_question_tokens=QUESTION_TOKENS)
    chat = {"messages": [{"role": "user", "content": QUESTIONS[0]}]}

    async def filled(client, depth):
        deadline = time.monotonic() + 30
        while engine.queued() < depth:
            assert time.monotonic() < deadline, f"the queue holds {engine.queued()} of {depth}"
            await asyncio.sleep(0.01)

    async def scenario():
        # httpx's ASGI transport runs no lifespan: the engine thread never starts
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine, "srrag")),
                                     base_url="http://srrag") as client:
            batch = {"questions": tiny_questions(QUEUE - 1, seed=12)}
            waiting = [asyncio.create_task(client.post("/v1/srrag", json=batch))]
            await filled(client, QUEUE - 1)
            waiting.append(asyncio.create_task(client.post("/v1/chat/completions", json=chat)))
            await filled(client, QUEUE)
            try:
                return await asyncio.wait_for(client.post("/v1/chat/completions", json=chat), 30), engine.queued()
            finally:
                for task in waiting:
                    task.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)

    refused, depth = asyncio.run(scenario())
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1, refused.text
    assert f"the queue holds {QUEUE} of {QUEUE} requests" in refused.json()["error"]["message"]
    assert depth == QUEUE
    assert all(job.cancelled for job in engine.waiting)  # the waiting clients left: the loop drops them


def test_questions_admitted_together_share_one_datastore_search(reference, monkeypatch):
    """An admission call's questions, asking different k, get one search of the policy datastore
    (over the call's padded rows, at the largest k served) and each its own decision: the source,
    p_M and p_D `SRRAG.ask` gives it alone with its k. One search per question fails this."""
    import dataclasses

    from jaxrag.decode.sampler import bucket
    from jaxrag.serve.engine import Engine
    from jaxrag.serve.jobs import Job, Options

    system, alone = reference
    engine = Engine(system, slots=SLOTS, max_queue=QUEUE, max_question_tokens=QUESTION_TOKENS)
    length = bucket(len(engine.prompt(QUESTIONS[0])))
    questions = [q for q in QUESTIONS if bucket(len(engine.prompt(q))) == length][:SLOTS]
    ks = [None, 1] * (len(questions) // 2) + [None] * (len(questions) % 2)
    with_k1 = dataclasses.replace(system, k=1)
    want = [alone[q] if k is None else with_k1.ask([q])[0] for q, k in zip(questions, ks)]
    searches, search = [], system.datastore.neighbour_labels
    monkeypatch.setattr(system.datastore, "neighbour_labels",
                        lambda keys, k: searches.append((len(keys), k)) or search(keys, k))
    jobs = [Job(q, engine.prompt(q), Options(k=k), lambda *a: None) for q, k in zip(questions, ks)]
    for i, job in enumerate(jobs):
        job.park, engine.parked[i] = i, job
    engine._admit(jobs)
    assert len(questions) == SLOTS and searches == [(SLOTS, engine.max_k)]
    for job, ref in zip(jobs, want):
        assert (job.source, job.p_datastore) == (ref.source, ref.p_datastore)
        np.testing.assert_allclose(job.p_model, ref.p_model, rtol=1e-5)
    assert {len(job.p_datastore) for job in jobs} == {len(system.model.sources)}


def test_limits_that_retrying_cannot_fix_get_413(url):
    """A body over the server's limit (1 MiB), by Content-Length or chunked, and more questions
    in one call than the queue can ever hold get 413 naming the setting, never 429."""
    big = json.dumps({"messages": [{"role": "user", "content": "Where? " + "x" * (1 << 20)}]}).encode()
    r = httpx.post(f"{url}/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"], r.text
    chunked = httpx.post(f"{url}/v1/chat/completions", content=iter([big[:1000], big[1000:]]),
                         headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and "over 1048576 bytes" in chunked.json()["error"]["message"], chunked.text
    many = httpx.post(f"{url}/v1/srrag", json={"questions": ["Where?"] * (QUEUE + 1)})
    assert many.status_code == 413 and f"at most {QUEUE} (--max-queue)" in many.json()["error"]["message"], many.text
    small = httpx.post(f"{url}/v1/chat/completions", content=iter([b'{"messages": [{"role": "user", ',
                                                                    b'"content": "Where?"}], "max_tokens": 2}']),
                       headers={"content-type": "application/json"}, timeout=60)
    assert small.status_code == 200, small.text  # a chunked body under the limit is read whole


def test_a_client_leaving_a_waiting_request_frees_its_slots(url):
    """FastAPI does not cancel a handler whose client left: a chat request queued behind a batch
    that all but fills the queue, then the batch itself, are cancelled when their clients disconnect."""
    outcome = lambda o: metric(url, f'srrag_requests_total{{outcome="{o}"}}')  # noqa: E731
    done, cancelled, n = outcome("done"), outcome("cancelled"), QUEUE - 1
    batch = {"questions": tiny_questions(n, seed=13), "source": "self"}
    chat = {"messages": [{"role": "user", "content": QUESTIONS[5]}], "source": "self"}

    async def until(predicate, what):
        deadline = time.monotonic() + 60
        while not predicate():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=300) as a, httpx.AsyncClient(base_url=url, timeout=300) as b:
            first = asyncio.create_task(a.post("/v1/srrag", json=batch))
            await until(lambda: metric(url, "srrag_queue_depth") > 0, "the batch never queued")
            leaving = asyncio.create_task(b.post("/v1/chat/completions", json=chat))
            await asyncio.sleep(0.2)  # queued behind the batch
            leaving.cancel()  # the client closes its connection
            await asyncio.gather(leaving, return_exceptions=True)
            await until(lambda: outcome("cancelled") == cancelled + 1, "the chat request was not cancelled")
            r = await first
            assert r.status_code == 200 and len(r.json()["answers"]) == n
            assert (outcome("done"), outcome("cancelled")) == (done + n, cancelled + 1)
            second = asyncio.create_task(a.post("/v1/srrag", json=batch))
            await until(lambda: metric(url, "srrag_busy_slots") == SLOTS, "the slots never filled")
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
            await until(lambda: metric(url, "srrag_busy_slots") == 0 and metric(url, "srrag_queue_depth") == 0,
                        "the batch's slots were not freed")
        return outcome("done") - done - n, outcome("cancelled") - cancelled - 1

    answered, left = asyncio.run(scenario())
    assert left >= 1 and answered + left == n, (answered, left)


def test_a_failed_step_rebuilds_the_pool_and_a_failed_engine_or_a_draining_one_is_503(reference):
    """The HTTP app in this process over an engine whose decode steps fail once: the requests in
    the pool fail (500, one message), a fresh pool answers the next as `SRRAG.ask` does; an
    engine whose loop died reports it on /health (503) and refuses requests with 503, as does a
    draining one (SIGTERM), which still reports its state."""
    from jaxrag.serve.engine import Engine
    from jaxrag.serve.http import create_app

    system, alone = reference
    engine = Engine(system, slots=SLOTS, max_queue=QUEUE, max_question_tokens=QUESTION_TOKENS)
    steps, calls = engine.device._steps, []

    def fails_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the device went away")
        return steps(*args, **kw)

    engine.device._steps = fails_once
    q = QUESTIONS[6]
    chat = lambda q: {"messages": [{"role": "user", "content": q}]}  # noqa: E731

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine, "srrag")),
                                     base_url="http://srrag", timeout=300) as client:
            failed = await client.post("/v1/chat/completions", json=chat(q))
            ok = await client.post("/v1/chat/completions", json=chat(q))
            healthy = await client.get("/health")
            engine._work = lambda: 1 / 0  # the loop's own code fails: the engine thread ends
            engine.submit([])  # wakes it
            deadline = time.monotonic() + 30
            while engine.failure is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return failed, ok, healthy, await client.get("/health"), await client.post("/v1/chat/completions",
                                                                                         json=chat(q))

    engine.start()  # httpx's ASGI transport runs no lifespan
    failed, ok, healthy, sick, refused = asyncio.run(scenario())
    assert failed.status_code == 500 and "the device went away" in failed.json()["error"]["message"], failed.text
    assert engine.rebuilds == 1 and healthy.status_code == 200, healthy.text
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == alone[q].answer
    assert sick.status_code == 503 and "ZeroDivisionError" in sick.json()["error"], sick.text
    assert refused.status_code == 503 and "has failed" in refused.json()["error"]["message"], refused.text

    draining = Engine(system, slots=SLOTS, max_queue=QUEUE, max_question_tokens=QUESTION_TOKENS)
    draining.drain()

    async def drained():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(draining, "srrag")),
                                     base_url="http://srrag") as client:
            return await client.get("/health"), await client.post("/v1/srrag", json={"questions": [q]})

    health, refused = asyncio.run(drained())
    assert health.status_code == 503 and health.json()["status"] == "draining" and health.json()["slots"] == SLOTS
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert int(refused.headers["Retry-After"]) >= 1


def test_a_client_leaving_mid_stream_frees_its_slot(url):
    done, cancelled = metric(url, 'srrag_requests_total{outcome="done"}'), metric(url, 'srrag_requests_total{outcome="cancelled"}')
    body = {"messages": [{"role": "user", "content": QUESTIONS[1]}], "stream": True, "source": "self"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the stream's first chunk, sent before the request is admitted: leave
    deadline = time.monotonic() + 30
    while metric(url, 'srrag_requests_total{outcome="cancelled"}') == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(url, 'srrag_requests_total{outcome="cancelled"}') == cancelled + 1
    assert metric(url, 'srrag_requests_total{outcome="done"}') == done
    assert metric(url, "srrag_busy_slots") == 0


def test_nothing_compiles_while_serving(url, reference):
    """Its own traffic, at once, every kind a request can be: both sources (forced and routed), a
    stream, sampling, k, max_tokens, a batch and single questions (so prefills of 1 to 4 rows), and
    prompts from one word to the longest served; every program it ran was compiled before the
    port opened."""
    from jaxrag.prompts import prompt_ids

    longest = " ".join(["Which river flows"] * 40)
    while len(prompt_ids(reference[0].model.tokenizer, [longest])[0]) > QUESTION_TOKENS:
        longest = longest.rsplit(" ", 1)[0]  # the longest question the server takes
    questions = ["Where?", QUESTIONS[2], QUESTIONS[3], longest]
    bodies = [("/v1/srrag", {"questions": questions}),
              ("/v1/srrag", {"questions": questions[:3], "source": "self", "max_tokens": 3}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": questions[1]}], "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": questions[3]}], "source": "wiki",
                                        "k": 2, "temperature": 0.8, "top_p": 0.5}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": questions[0]}], "temperature": 1.5})]

    async def traffic():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*(client.post(route, json=body) for route, body in bodies))

    assert [r.status_code for r in asyncio.run(traffic())] == [200] * len(bodies)
    assert metric(url, 'srrag_compiles_total{when="startup"}') > 0
    assert metric(url, 'srrag_compiles_total{when="serving"}') == 0


def test_sigterm_finishes_requests_in_flight_and_exits_0(url, server):
    _, proc = server

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            # three times the slots: the slots stay full while the queue drains into them
            flying = [asyncio.create_task(client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": q}]})) for q in QUESTIONS[:3 * SLOTS]]
            deadline = time.monotonic() + 60
            while metric(url, "srrag_busy_slots") < SLOTS:
                assert time.monotonic() < deadline, "the slots never filled"
                await asyncio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            with pytest.raises(httpx.TransportError):
                await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Where?"}]})
            return await asyncio.gather(*flying)

    answers = asyncio.run(scenario())
    assert [r.status_code for r in answers] == [200] * 3 * SLOTS
    assert all(r.json()["choices"][0]["message"]["content"] for r in answers)
    assert proc.wait(timeout=60) == 0


def test_broken_export_or_missing_index_is_refused_at_start(export, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(export, broken)
    (broken / "srrag.json").write_text("{not json", encoding="utf-8")
    no_index = tmp_path / "no_index"
    shutil.copytree(export, no_index)
    spec = json.loads((no_index / "srrag.json").read_text())
    spec["index"] = str(tmp_path / "gone")
    (no_index / "srrag.json").write_text(json.dumps(spec))
    procs = [start_server(broken, free_port()), start_server(no_index, free_port()),
             start_server(export, free_port(), "--index", str(tmp_path / "nowhere"))]
    for proc, names in zip(procs, (["srrag.json", "not valid JSON"], ["srrag.json: index", "gone"], ["--index", "nowhere"])):
        _, err = proc.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
        assert all(n in lines[0] for n in names), lines[0]
