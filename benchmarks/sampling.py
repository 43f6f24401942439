"""One sampled decode step's token draw: jaxrag's `sample_tokens` against transformers' warpers.

    python -m benchmarks.sampling --json OUT [--rows 128] [--vocab 49152] [--repeats 5]

The draws the pipeline samples: SeaKR's (temperature 1.0, top-k 50, top-p 0.9; a batch of
questions x samples rows) and GenRead round 2's (temperature 0.7, top-p 0.9, no top-k), plus
plain temperature as the floor both stand on. Same logits on both sides (a real model's spread:
normal x 3); the peer is transformers' `generate` path, TopK then TopP warpers (a full sort of
the vocabulary) and `torch.multinomial`. Each case also checks that jaxrag keeps exactly the
tokens the warpers keep (`same_kept_tokens`). Milliseconds per draw of all rows, median of
`--repeats`, compile excluded.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks.common import Parser, environment, median, positive_int, write_json
from jaxrag.decode.sampling import SamplingParams, candidates, sample_tokens

CASES = {"seakr": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
         "genread": SamplingParams(temperature=0.7, top_p=0.9),
         "temperature": SamplingParams(temperature=1.0)}


def hf_warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    scores = TemperatureLogitsWarper(params.temperature)(None, logits)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores


def kept_by_jaxrag(logits: jax.Array, params: SamplingParams) -> np.ndarray:
    """[rows, vocab] bool: the tokens `sample_tokens` can draw (its `candidates`)."""
    values, ids = candidates(logits, params)
    if ids is None:
        return np.asarray(jnp.isfinite(values))
    keep = np.zeros(logits.shape, bool)
    np.put_along_axis(keep, np.asarray(ids), np.asarray(jnp.isfinite(values)), axis=-1)
    return keep


def timed(run, repeats: int) -> float:
    run()  # compile / warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(1e3 * median(times), 3)


def main(argv=None) -> dict:
    parser = Parser(prog="python -m benchmarks.sampling", description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, metavar="OUT", help="where to write the result (JSON)")
    parser.add_argument("--rows", type=positive_int, default=128, help="rows drawn at once (SeaKR: 128)")
    parser.add_argument("--vocab", type=positive_int, default=49152, help="vocabulary (SmolLM2: 49,152)")
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args(argv)
    env = environment()
    logits = np.asarray(jax.random.normal(jax.random.key(0), (args.rows, args.vocab))) * 3.0
    ours_in, theirs_in = jnp.asarray(logits), torch.tensor(logits)
    results = []
    for name, params in CASES.items():
        draw = jax.jit(lambda x, key, p=params: sample_tokens(x, key, p))
        keys = jax.random.split(jax.random.key(1), args.rows)  # one key per row
        ours = timed(lambda: draw(ours_in, keys).block_until_ready(), args.repeats)
        theirs = timed(lambda: torch.multinomial(torch.softmax(hf_warped(theirs_in, params), -1), 1), args.repeats)
        kept = torch.isfinite(hf_warped(theirs_in, params)).numpy()
        results.append({"case": name, "params": dataclasses.asdict(params),
                        "jaxrag_ms": ours, "hf_ms": theirs, "speedup": round(theirs / ours, 2),
                        "same_kept_tokens": bool((kept_by_jaxrag(ours_in, params) == kept).all()),
                        "mean_kept_tokens": float(kept.sum(-1).mean())})
    result = {"benchmark": "sampling", "rows": args.rows, "vocab": args.vocab, "repeats": args.repeats,
              "environment": env, "results": results}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
