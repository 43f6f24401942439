"""`python -m jaxrag.serve EXPORT_DIR [--host 127.0.0.1] [--port 8000] [--slots 8] [--tensor 0]
[--max-queue 256] [--index DIR] [--max-question-tokens 256] [--max-body-bytes 1048576]`

Serves an SR-RAG export (model, policy datastore, tau, passage index: `srrag.json`, read as
`SRRAG.load` reads it) over HTTP with continuous batching (`jaxrag.serve.engine`, routes in
`jaxrag.serve.http`). Every program is compiled before the port opens; SIGTERM stops intake,
finishes the requests in flight (new ones get 503) and exits 0. A broken export or a missing index is refused at
start with one `error:` line. The model is placed on the host's devices as generation places it
in the pipeline (`--tensor`: the model axis; `jaxrag.sharding.generation_mesh`), the slots split
over the other devices.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from jaxrag.errors import JaxragError, run
from jaxrag.prompts import answer_prefix_ids


def question_limit(system, requested: int) -> int:
    """Prompt tokens a question may take: what the model's length leaves after the largest
    verbalization, knowledge and answer, capped at `requested` (which bounds the buckets compiled)."""
    cfg = system.route_cfg
    positions = getattr(system.model.hf_config, "max_position_embeddings", None)
    if positions is None:
        return requested
    tail = len(answer_prefix_ids(system.model.tokenizer))
    room = positions - 1 - cfg.max_verbal_tokens - cfg.max_knowledge_tokens - tail - cfg.max_answer_tokens
    if room < 8:
        raise JaxragError(f"the model's length ({positions} positions) leaves {room} tokens for a question "
                          "after the route's verbalization, knowledge and answer budgets")
    return min(requested, room)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxrag.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export_dir", help="an SR-RAG export (`W/export`, with srrag.json)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--slots", type=int, default=8,
                        help="decode slots (requests decoded at once), split over the devices' data axis")
    parser.add_argument("--tensor", type=int, default=0,
                        help="devices the model is split over (its model axis; 0 = only as many as it needs to "
                             "fit); the host's other devices are data replicas, each holding its share of the slots")
    parser.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 429")
    parser.add_argument("--index", default=None, help="passage index (default: the one srrag.json names)")
    parser.add_argument("--max-question-tokens", type=int, default=256,
                        help="longest question prompt served; prompt buckets up to it are compiled at start")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 beyond)")
    args = parser.parse_args(argv)

    def serve():
        for flag in ("slots", "max_queue", "max_question_tokens", "max_body_bytes"):
            if getattr(args, flag) < 1:
                raise JaxragError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
        if args.tensor < 0:
            raise JaxragError(f"--tensor {args.tensor}: must be 0 (as many devices as the model needs) or more")
        # jax, the model and the web stack load once the arguments are good: --help stays instant
        import uvicorn
        from jaxrag.serve import SERVING_FILE, SRRAG, read_serving_spec
        from jaxrag.serve.engine import Engine
        from jaxrag.serve.http import create_app

        export = Path(args.export_dir)
        index = args.index or read_serving_spec(export)["index"]
        if not Path(index).is_dir():  # refused before the model loads
            where = "--index" if args.index else f"{export / SERVING_FILE}: index"
            raise JaxragError(f"{where} {index}: no such index directory")
        start = time.perf_counter()
        try:
            system = SRRAG.load(export, index=args.index, tensor=args.tensor)
        except JaxragError:
            raise
        except Exception as e:  # a half-written or foreign directory: one line, not a traceback
            raise JaxragError(f"{export}: not a loadable SR-RAG export ({type(e).__name__}: {e})") from None
        engine = Engine(system, slots=args.slots, max_queue=args.max_queue,
                        max_question_tokens=question_limit(system, args.max_question_tokens))
        engine.warm_up()
        print(f"serving {export} on http://{args.host}:{args.port}: {args.slots} slots, queue {args.max_queue}, "
              f"{engine.metrics.counted['startup']} programs compiled in {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
        # uvicorn drains the connections on SIGTERM, then raises the signal again under the handler
        # it found: a no-op one lets the process end normally, exit code 0, once all is answered
        signal.signal(signal.SIGTERM, lambda *_: None)

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # the engine refuses new requests (503) while uvicorn drains
                engine.drain()
                super().handle_exit(sig, frame)

        app = create_app(engine, export.resolve().name, max_body_bytes=args.max_body_bytes)
        Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")).run()

    run(serve)


if __name__ == "__main__":
    main()
