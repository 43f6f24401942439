"""Decoding throughput of the tiny (embedded-default-sized) decoder: prefill, decode, scoring.

    python benchmarks/bench_decode.py [--batch 16] [--prompt 64] [--new 128]   -> JSON on stdout
"""

import argparse
import json
import time

import jax
import numpy as np
from flax import nnx

from jaxrag.decode.sampler import generate
from jaxrag.decode.scoring import score
from jaxrag.models.decoder import Decoder, DecoderConfig
from jaxrag.models.rope import RopeConfig


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    cfg = DecoderConfig(family="qwen2", vocab_size=4096, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                        num_layers=args.layers, num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4,
                        qkv_bias=True, rope=RopeConfig(theta=10000.0, rotary_dim=args.hidden // 4))
    decoder = Decoder(cfg, nnx.Rngs(0))
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, 4096, args.prompt).tolist() for _ in range(args.batch)]

    def timed(fn, repeats=3):
        fn()  # compile
        start = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(fn())
        return (time.perf_counter() - start) / repeats

    t_gen = timed(lambda: generate(decoder, prompts, args.new))
    t_prefill = timed(lambda: generate(decoder, prompts, 1))
    targets = [rs.randint(0, 4096, 16).tolist() for _ in range(args.batch)]
    t_score = timed(lambda: score(decoder, prompts, targets, batch_size=args.batch).total)
    print(json.dumps({
        "device": str(jax.devices()[0]), "params": sum(x.size for x in jax.tree.leaves(nnx.state(decoder))),
        "batch": args.batch, "prompt_tokens": args.prompt, "new_tokens": args.new,
        "prefill_tokens_per_s": args.batch * args.prompt / t_prefill,
        "decode_tokens_per_s": args.batch * args.new / max(t_gen - t_prefill, 1e-9),
        "generate_seconds": t_gen,
        "score_pairs_per_s": args.batch / t_score,
    }, indent=1))


if __name__ == "__main__":
    main()
