"""Serving SR-RAG under open-loop load: `python -m jaxrag.serve` against static batches of `SRRAG.ask`.

    python -m benchmarks.serve --json OUT [--export DIR [--questions FILE ...]] [--max-tokens LO,HI]
        [--slots 8] [--requests 64] [--fractions 0.35,0.7,1,1.5]

Requests arrive as a Poisson process (open loop: arrivals never wait for answers), each a
distinct question with its own answer budget: `max_tokens` drawn uniformly from LO..HI (default
1..the export's `max_answer_tokens`), as vLLM's serving benchmark draws output lengths, so that
requests end at different steps as real traffic's do. `--questions` reads them from JSONL files
with a "question" per line (FlashRAG's format: a run's world files, W/world/datasets/*/test.jsonl,
for its export W/export); by default they are made up over the tiny corpus. Three systems answer
the same arrivals:

    static     `SRRAG.ask` in this process, in static batches of up to `slots` questions: whenever
               it is idle it takes the requests that have arrived (the rest queue), answers them
               in one batch (each row to its own max_tokens, the batch until its last row ends)
               and returns all of them together (no streaming: TTFT = latency)
    server     `python -m jaxrag.serve EXPORT --slots N` on 127.0.0.1, streamed chat completions
    retrieval  the same server with every request forced to `<Wiki>` (retrieval always on)

First each system's saturation throughput is measured with every request arriving at once; then
the rates are fractions of static batching's saturation rate. Per run: throughput (answers/s
from the first arrival to the last answer), p50/p99 latency and TTFT (s), and the busy-slot
fraction (time-averaged share of the slots holding a request); for the server, from its
`/metrics`, device calls per generated token and the host's mean wait per call of decode steps.
Goals on a CPU (issues 71 and 80): saturation throughput >= 1.5x static, and p99 latency at 0.7x
static's saturation rate <= 0.5x static's. Without --export it builds `tiny_export` (random
weights; about half the questions route to each source) in a temporary directory. Compilation is
excluded: the server compiles before its port opens, and static batching answers every question in
batches of each row count before it is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxrag.eval.harness import compile_events
from jaxrag.serve import SRRAG

from benchmarks.common import Parser, environment, positive_int, write_json
from benchmarks.serve_exports import smollm2_export, tiny_export, tiny_questions

def arrivals(n: int, rate: float, rng: random.Random) -> np.ndarray:
    """Poisson arrival times (s) of n requests at `rate` per second (inf: all at 0)."""
    if rate == float("inf"):
        return np.zeros(n)
    return np.cumsum([rng.expovariate(rate) for _ in range(n)])


def summary(arrived: np.ndarray, first: np.ndarray, done: np.ndarray, busy: float) -> dict:
    latency, ttft = done - arrived, first - arrived
    return {"throughput": round(len(done) / float(done.max() - arrived.min()), 3),
            "p50_s": round(float(np.percentile(latency, 50)), 4), "p99_s": round(float(np.percentile(latency, 99)), 4),
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4), "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
            "busy_fraction": round(busy, 3)}


def run_static(system: SRRAG, questions: list[str], budgets: list[int], times: np.ndarray, slots: int) -> dict:
    """Static batching: when idle, answer every arrived request (up to `slots`) in one `ask`. A
    batch whose row count and length buckets are new compiles its programs inside `ask` (seconds
    on a CPU), which static serving pays once per shape, not per request: the same arrivals are
    run once unmeasured first, then a run that compiled anything is run again (up to 3 times),
    and the run kept says how many compile events it had (`compiles`: 0 unless every try met a
    new shape; batches form by timing, so a rerun may meet a shape the first did not)."""
    _static_once(system, questions, budgets, times, slots)
    for _ in range(3):
        before = compile_events()
        result = _static_once(system, questions, budgets, times, slots)
        if compile_events() == before:
            break
    return {**result, "compiles": compile_events() - before}


def _static_once(system: SRRAG, questions: list[str], budgets: list[int], times: np.ndarray, slots: int) -> dict:
    pending, done, busy = list(range(len(questions))), np.zeros(len(questions)), 0.0
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        if times[pending[0]] > now:
            time.sleep(times[pending[0]] - now)
            now = time.perf_counter() - start
        batch = [i for i in pending if times[i] <= now][:slots]
        system.ask([questions[i] for i in batch], [budgets[i] for i in batch])
        end = time.perf_counter() - start
        busy += (end - now) * len(batch) / slots
        done[batch] = end
        pending = [i for i in pending if i not in batch]
    return summary(times, done, done, busy / float(done.max()))


async def _serve_load(url: str, questions: list[str], budgets: list[int], times: np.ndarray,
                      source: str | None) -> tuple:
    import httpx  # the benchmark's client, as the tests'

    first, done = np.zeros(len(questions)), np.zeros(len(questions))
    samples: list[float] = []
    start = time.perf_counter()

    async def one(client, i):
        await asyncio.sleep(max(0.0, times[i] - (time.perf_counter() - start)))
        body = {"messages": [{"role": "user", "content": questions[i]}], "stream": True, "max_tokens": budgets[i],
                **({"source": source} if source else {})}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not first[i] and '"content": "' in line and '"content": ""' not in line:
                    first[i] = time.perf_counter() - start
        done[i] = time.perf_counter() - start
        first[i] = first[i] or done[i]  # an empty answer: its first token is its end

    async def watch(client):
        while True:
            health = (await client.get("/health")).json()
            samples.append(health["busy"] / health["slots"])
            await asyncio.sleep(0.05)

    limits = httpx.Limits(max_connections=len(questions) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        watcher = asyncio.create_task(watch(client))
        await asyncio.gather(*(one(client, i) for i in range(len(questions))))
        watcher.cancel()
    return first, done, float(np.mean(samples)) if samples else 0.0


def engine_counts(url: str) -> dict[str, float]:
    """The server's counters this benchmark reads: device calls, tokens generated, and the host's
    wait on calls of decode steps (their sum and count)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in ("srrag_device_calls_total", "srrag_tokens_total", "srrag_step_seconds_sum",
                               "srrag_step_seconds_count"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def run_server(url: str, questions: list[str], budgets: list[int], times: np.ndarray,
               source: str | None = None) -> dict:
    before = engine_counts(url)
    first, done, busy = asyncio.run(_serve_load(url, questions, budgets, times, source))
    d = {k: v - before.get(k, 0.0) for k, v in engine_counts(url).items()}
    return {**summary(times, first, done, busy),
            "device_calls_per_token": round(d["srrag_device_calls_total"] / max(d["srrag_tokens_total"], 1), 4),
            "host_wait_per_step_ms": round(1000 * d["srrag_step_seconds_sum"]
                                           / max(d["srrag_step_seconds_count"], 1), 3)}


def start_server(export: Path, slots: int, queue: int, question_tokens: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxrag.serve", str(export), "--port", str(port), "--slots",
                             str(slots), "--max-queue", str(queue), "--max-question-tokens", str(question_tokens)],
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # one line once every program is compiled, just before the port opens
        if line.startswith("serving "):
            break
        if line.startswith("error:"):
            raise SystemExit(f"python -m benchmarks.serve: {line.strip()}")
    url = f"http://127.0.0.1:{port}"
    import httpx  # the benchmark's client, as the tests'

    for _ in range(600):
        try:
            httpx.get(f"{url}/health", timeout=1)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit("python -m benchmarks.serve: error: the server did not open its port")


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(prog="python -m benchmarks.serve", description=__doc__)
    parser.add_argument("--json", required=True, metavar="OUT", help="where to write the result (JSON)")
    parser.add_argument("--export", default=None, help="an SR-RAG export (default: --model's, built here)")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="the export built without --export: tiny_export or smollm2_export")
    parser.add_argument("--questions", nargs="+", default=None, metavar="FILE",
                        help='JSONL files with a "question" per line (default: made up over the tiny corpus)')
    parser.add_argument("--max-tokens", type=budget_range, default=None, metavar="LO,HI",
                        help="each request's max_tokens, uniform over LO..HI (default: 1..the export's "
                             "max_answer_tokens)")
    parser.add_argument("--max-question-tokens", type=positive_int, default=64, help="the server's flag")
    parser.add_argument("--slots", type=positive_int, default=8)
    parser.add_argument("--requests", type=positive_int, default=64, help="requests per run")
    parser.add_argument("--fractions", default="0.35,0.7,1,1.5",
                        help="arrival rates as fractions of static batching's saturation rate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not Path(args.json).parent.is_dir():
        parser.error(f"--json {args.json}: directory {Path(args.json).parent} does not exist")
    try:
        fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        parser.error(f"--fractions {args.fractions!r}: expected numbers separated by commas")
    if not fractions or min(fractions) <= 0:
        parser.error(f"--fractions {args.fractions!r}: expected positive numbers")
    try:
        questions = (tiny_questions(args.requests, args.seed + 100) if args.questions is None
                     else read_questions([Path(p) for p in args.questions], args.requests, args.seed + 100))
    except (OSError, ValueError) as e:
        parser.error(f"--questions: {e}")
    with tempfile.TemporaryDirectory(prefix="jaxrag-serve-bench-") as tmp:
        build = {"tiny": tiny_export, "smollm2": smollm2_export}[args.model]
        export = Path(args.export) if args.export else build(Path(tmp))
        return measure(args, export, fractions, questions)


def budget_range(text: str) -> tuple[int, int]:
    """`--max-tokens LO,HI` -> (LO, HI), 1 <= LO <= HI."""
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: expected two integers LO,HI") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text}: expected two integers 1 <= LO <= HI")
    return low, high


def read_questions(paths: list[Path], n: int, seed: int) -> list[str]:
    """n distinct questions drawn (seeded) from JSONL files' "question" fields."""
    questions = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    question = json.loads(line)["question"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f'{path} line {number} is not a JSON object with a "question"') from None
                questions.append(str(question))
    questions = list(dict.fromkeys(questions))
    if len(questions) < n:
        raise ValueError(f"{len(questions)} distinct questions in {len(paths)} file(s), fewer than --requests {n}")
    return random.Random(seed).sample(questions, n)


def measure(args, export: Path, fractions: list[float], questions: list[str]) -> dict:
    env = environment()
    system = SRRAG.load(export)
    limit = system.route_cfg.max_answer_tokens
    low, high = args.max_tokens or (1, limit)
    if high > limit:
        raise SystemExit(f"python -m benchmarks.serve: error: --max-tokens {low},{high}: the export answers at most "
                         f"{limit} tokens (its max_answer_tokens)")
    draw = random.Random(args.seed + 200)
    budgets = [draw.randint(low, high) for _ in questions]
    # Static batching's programs, compiled first: every question in batches of each padded row count
    # (`ask` pads a batch to a power of two), so each prompt and knowledge length meets each.
    for n in sorted({min(1 << i, args.slots) for i in range(args.slots.bit_length() + 1)}):
        for start in range(0, len(questions), n):
            system.ask(questions[start:start + n], budgets[start:start + n])
    proc, url = start_server(export, args.slots, args.requests, args.max_question_tokens)
    rng = random.Random(args.seed)
    try:
        at_once = arrivals(len(questions), float("inf"), rng)
        saturation = {"static": run_static(system, questions, budgets, at_once, args.slots),
                      "server": run_server(url, questions, budgets, at_once),
                      "retrieval": run_server(url, questions, budgets, at_once, "wiki")}
        rate = saturation["static"]["throughput"]
        runs = []
        for f in fractions:
            times = arrivals(len(questions), f * rate, rng)
            runs.append({"fraction": f, "rate": round(f * rate, 3),
                         "static": run_static(system, questions, budgets, times, args.slots),
                         "server": run_server(url, questions, budgets, times),
                         "retrieval": run_server(url, questions, budgets, times, "wiki")})
    finally:
        proc.terminate()
        proc.wait()
    at70 = min(runs, key=lambda r: abs(r["fraction"] - 0.7))
    goals = {"saturation_ratio": round(saturation["server"]["throughput"] / saturation["static"]["throughput"], 3),
             "p99_ratio_at_0.7": round(at70["server"]["p99_s"] / at70["static"]["p99_s"], 3)}
    goals["met"] = goals["saturation_ratio"] >= 1.5 and goals["p99_ratio_at_0.7"] <= 0.5
    result = {"model": args.model if not args.export else str(export), "slots": args.slots,
              "requests": len(questions), "tau": system.tau, "environment": env,
              "workload": {"questions": args.questions or "tiny_questions",
                           "max_tokens": {"distribution": "uniform", "low": low, "high": high}},
              "saturation": saturation,
              "runs": runs, "goals": goals}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
