"""Greedy decoding throughput: `jaxrag.decode.sampler.generate` vs transformers `generate`, same weights.

    python -m benchmarks.decode --json OUT [--prompt 128] [--new 64] [--batches 1,16] [--repeats 3]

transformers makes random weights for one Qwen2 config (seeded) and `jaxrag.models.hf` converts
them, so both sides decode the same model. Prompts are random token ids with no EOS, so every row
runs all its new tokens. tok/s = batch x new tokens / wall time of one whole generate call (prefill
and host transfers included, compilation excluded: one warm-up call each); the two alternate and
the result is the median of `repeats` calls.

jaxrag decodes with the model as inference loads it (`for_inference`: each layer's weights in
buffers of their own). Per batch size, `step_bytes_accessed` is XLA's count of the bytes one
compiled decode step (append one token, pick the next) moves, `step_argument_bytes` the bytes of
its arguments (weights, KV cache, decode state), and `bytes_ratio` their ratio: 1 when every
byte is read once; copying weights or cache before use pushes it to ~3. The layer loop is a
Python loop, so XLA's count covers every layer (a scan body would be counted once).
`compile_s`: seconds to trace and compile the prefill and decode programs of the first call.

`identical`: every token jaxrag generated is transformers' argmax given the prompt and jaxrag's own
previous tokens, from one teacher-forced HF forward without a cache, up to `--tie-tol` below the
best logit (near-ties of random weights). HF's own cached `generate` can drift from its uncached
forward on such ties, so it is not the reference; how often it agrees is `hf_generate_same`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx
from tqdm.auto import tqdm

from benchmarks.common import (Parser, add_common_args, check_arch, environment, median, positive_int,
                               qwen2_config, write_json)
from jaxrag.decode import sampler, sampling
from jaxrag.decode import slots as slot_pool
from jaxrag.decode.sampler import generate
from jaxrag.models import hf
from jaxrag.models.decoder import Decoder, unstack_layers
from jaxrag.models.model import pad_vocab

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the peer runs where jaxrag does, if it can


def make_models(arch: dict, max_positions: int, seed: int = 0):
    """(transformers model, jaxrag Decoder) holding the same random float32 weights."""
    hf_cfg = qwen2_config(arch, max_positions)
    torch.manual_seed(seed)
    peer = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    cfg = hf.decoder_config(hf_cfg, dtype="float32", param_dtype="float32")
    tensors = {k: v.detach().numpy() for k, v in peer.state_dict().items()}
    peer = peer.to(DEVICE)
    params = pad_vocab(hf.hf_to_params(tensors, cfg, np.float32), cfg)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))  # shapes only, no init
    nnx.replace_by_pure_dict(state, params)
    return peer, unstack_layers(nnx.merge(graphdef, state))


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compile_decode_step(decoder: Decoder, batch: int, slots: int, pool: bool = False):
    """(compiled program, its abstract arguments): one decode step as `sampler.decode` runs it,
    append each row's token to a `slots`-long cache and pick the next (greedy), state donated.
    `pool`: one step of the server's slot pool instead (`decode.slots.step`: `batch` slots of a
    `slots`-column ring, with each row's sampling and phase program)."""
    graphdef, params = nnx.split(decoder)
    if pool:
        state = jax.eval_shape(lambda: slot_pool.init_pool(decoder, batch, slots))

        def step(p, st, stops, tail):
            new, tok, kind, _ = slot_pool.step(nnx.merge(graphdef, p), st, stops, stops, tail)
            return new, tok, kind

        args = (_abstract(params), state, jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
        return jax.jit(step, donate_argnums=1).lower(*args).compile(), args
    state = jax.eval_shape(lambda: sampler.init_state(decoder, batch, slots))

    def step(p, st, ids, mask):
        new, _ = sampler._extend(nnx.merge(graphdef, p), st, ids, mask)
        return new, sampling.sample_tokens(new.logits, jax.random.key(0), sampling.SamplingParams())

    args = (_abstract(params), state, jax.ShapeDtypeStruct((batch, 1), jnp.int32),
            jax.ShapeDtypeStruct((batch, 1), bool))
    return jax.jit(step, donate_argnums=1).lower(*args).compile(), args


def step_bytes(decoder: Decoder, batch: int, slots: int, pool: bool = False) -> dict:
    """XLA's bytes accessed by one compiled decode step (`compile_decode_step`), its arguments'
    bytes, and their ratio."""
    compiled, args = compile_decode_step(decoder, batch, slots, pool)
    accessed = float(compiled.cost_analysis()["bytes accessed"])
    argument = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args))
    return {"step_bytes_accessed": int(accessed), "step_argument_bytes": int(argument),
            "bytes_ratio": round(accessed / argument, 4)}


def jaxrag_generate(decoder: Decoder, prompts: np.ndarray, new: int) -> np.ndarray:
    """prompts [batch, prompt] -> [batch, new] greedy tokens (no stop tokens)."""
    return np.asarray(generate(decoder, prompts.tolist(), new), np.int64)


@torch.no_grad()
def hf_generate(model, prompts: np.ndarray, new: int) -> np.ndarray:
    ids = torch.from_numpy(prompts).long().to(DEVICE)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)
    return out[:, prompts.shape[1]:].cpu().numpy()


@torch.no_grad()
def teacher_forced_match(model, prompts: np.ndarray, tokens: np.ndarray, tie_tol: float) -> np.ndarray:
    """[batch, new] bool: token t is within `tie_tol` of transformers' best logit given the prompt
    and tokens[:, :t] (one uncached forward over prompt + tokens)."""
    full = torch.from_numpy(np.concatenate([prompts, tokens], axis=1)).long().to(DEVICE)
    p = prompts.shape[1]
    logits = model(input_ids=full).logits[:, p - 1: -1].float().cpu()  # position i predicts token i + 1
    chosen = logits.gather(-1, torch.from_numpy(tokens).long()[..., None])[..., 0]
    return (chosen >= logits.max(-1).values - tie_tol).numpy()


def bench_batch(peer, decoder: Decoder, prompts: np.ndarray, new: int, repeats: int,
                tie_tol: float) -> tuple[dict, np.ndarray]:
    """One batch size: (result row, jaxrag's tokens [batch, new])."""
    start = time.perf_counter()
    ours = jaxrag_generate(decoder, prompts, new)  # warm-up: compiles the prefill and decode loop
    first_s = time.perf_counter() - start
    theirs = hf_generate(peer, prompts, new)
    ours_s, theirs_s = [], []
    for _ in tqdm(range(repeats), desc=f"batch {len(prompts)} (jaxrag, transformers)", unit="call"):
        start = time.perf_counter()
        again = jaxrag_generate(decoder, prompts, new)
        ours_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        hf_generate(peer, prompts, new)
        theirs_s.append(time.perf_counter() - start)
        if not np.array_equal(again, ours):
            raise RuntimeError("jaxrag greedy decoding is not deterministic across calls")
    match = teacher_forced_match(peer, prompts, ours, tie_tol)
    tokens = prompts.shape[0] * new
    row = {"batch": len(prompts), "jaxrag_tok_s": round(tokens / median(ours_s), 1),
           "hf_tok_s": round(tokens / median(theirs_s), 1), "identical": bool(match.all()),
           "teacher_forced_match": round(float(match.mean()), 4),
           "hf_generate_same": round(float(np.mean(theirs == ours)), 4),
           "compile_s": round(first_s - median(ours_s), 2)}
    row["speedup"] = round(row["jaxrag_tok_s"] / row["hf_tok_s"], 3)
    row.update(step_bytes(decoder, len(prompts), sampler.bucket(prompts.shape[1]) + sampler.bucket(new)))
    return row, ours


def batch_sizes(text: str) -> list[int]:
    import argparse

    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive batch sizes, got {text!r}")
    return sizes


def main(argv=None) -> dict:
    parser = Parser(prog="python -m benchmarks.decode", description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--prompt", type=positive_int, default=128, help="prompt tokens per row")
    parser.add_argument("--new", type=positive_int, default=64, help="new tokens per row")
    parser.add_argument("--batches", type=batch_sizes, default=[1, 16], help="comma-separated, e.g. 1,16")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--tie-tol", type=float, default=1e-3, help="logit gap that counts as a tie")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    arch = check_arch(parser, args)
    if args.tie_tol < 0:
        parser.error(f"--tie-tol must be >= 0, got {args.tie_tol}")
    peer, decoder = make_models(arch, args.prompt + args.new, args.seed)
    result = {**environment(), "arch": arch, "prompt": args.prompt, "new": args.new, "repeats": args.repeats,
              "tie_tol": args.tie_tol, "dtype": "float32", "hf_attention": peer.config._attn_implementation,
              "results": []}
    rng = np.random.default_rng(args.seed)
    for batch in args.batches:
        prompts = rng.integers(0, arch["vocab"], (batch, args.prompt))
        result["results"].append(bench_batch(peer, decoder, prompts, args.new, args.repeats, args.tie_tol)[0])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
