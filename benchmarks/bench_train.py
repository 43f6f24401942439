"""Train-step throughput (tokens/s) of the embedded default's tiny model (`configs/<family>.py:tiny`)
for the LM, stage-1 and stage-2 objectives, on all local devices. Prints one JSON object.

    python benchmarks/bench_train.py [--family qwen2] [--steps 10] [--batch 16] [--seq 256]

Batches are synthetic (random ids, stage-1 segments at fixed positions): the step's cost does not
depend on the token values. Times exclude compilation (reported separately).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
import transformers
from flax import nnx

from jaxrag import sharding
from jaxrag.config import tiny_config
from jaxrag.data.world import WorldConfig
from jaxrag.models.decoder import Decoder
from jaxrag.models.hf import decoder_config
from jaxrag.models.tokens import srrag_tokens
from jaxrag.train import losses, trainer

VOCAB = WorldConfig().vocab_size + len(srrag_tokens())  # the world tokenizer's vocabulary


HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads"}


def tiny_decoder(family: str) -> Decoder:
    cfg = tiny_config(family)
    arch = {HF_NAMES.get(k, k): v for k, v in cfg.model.arch.to_dict().items()}
    hf = transformers.AutoConfig.for_model(family, vocab_size=VOCAB, tie_word_embeddings=True, **arch)
    dec_cfg = decoder_config(hf, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    return jax.jit(lambda: Decoder(dec_cfg, nnx.Rngs(0)))()  # one compiled init, not op-by-op


def target_positions(masks: np.ndarray, width: int) -> np.ndarray:
    """[batch, seq] 0/1 -> [batch, width] positions of the ones (0-padded), as the featurizer's `targets`."""
    rows = [np.flatnonzero(m) for m in masks]
    out = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out


def synthetic_batch(batch: int, seq: int, pairs: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    ids = rng.integers(0, VOCAB, size=(batch, seq), dtype=np.int32)
    out = {"ids": ids, "mask": np.ones((batch, seq), bool), "loss_mask": np.ones((batch, seq), np.float32),
           "valid": np.ones(batch, np.float32), "truncated": np.zeros(batch, np.float32)}
    seg = {k: np.zeros((batch, seq), np.float32) for k in ("src", "verb", "ans")}
    seg["src"][:, seq // 4] = 1
    seg["verb"][::3, seq // 4 + 1: 3 * seq // 4] = 1  # every third example verbalizes
    seg["ans"][:, -seq // 8:] = 1
    out.update(seg)
    targets = seg["src"] + seg["verb"] + seg["ans"]
    width = int(targets.sum(1).max())
    out["targets"] = target_positions(targets, width)
    if pairs:
        out.update(rej_ids=rng.integers(0, VOCAB, size=(batch, seq), dtype=np.int32), rej_mask=out["mask"],
                   rej_verb=seg["verb"], rej_targets=target_positions(seg["verb"], width), dpo=(np.arange(batch) % 3 == 0).astype(np.float32),
                   ref_chosen=np.full(batch, -50.0, np.float32), ref_rejected=np.full(batch, -60.0, np.float32))
    return out


def bench(name: str, objective, decoder: Decoder, args, mesh) -> dict:
    spec = trainer.TrainSpec(name, batch_size=args.batch, lr=1e-4, total_steps=args.steps + 1,
                             per_device_batch_size=args.per_device_batch)
    accum = trainer.accumulation_steps(spec, mesh)
    graphdef, state = nnx.split(decoder)
    _, shardings = trainer.state_shardings(decoder, spec, mesh)
    params = sharding.place(nnx.to_pure_dict(state), shardings["params"])
    opt = jax.jit(trainer.make_optimizer(spec).init, out_shardings=shardings["opt"])(params)
    train_state = {"params": params, "opt": opt, "step": sharding.place(np.int32(0), shardings["step"])}
    step = trainer.make_train_step(graphdef, objective, spec, mesh, shardings, accum)
    rows = sharding.host_rows(mesh, args.batch)
    local = synthetic_batch(args.batch, args.seq, name == "stage2", np.random.default_rng(0))
    batch = sharding.global_batch({k: v[rows] for k, v in local.items()}, rows, mesh, args.batch)
    start = time.perf_counter()
    train_state, metrics = step(train_state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        train_state, metrics = step(train_state, batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.batch * args.seq * (2 if name == "stage2" else 1)  # stage 2 also runs the rejected side
    return {"step_ms": round(seconds * 1e3, 1), "tokens_per_s": round(tokens / seconds, 1),
            "compile_s": round(compile_s, 1), "accumulation_steps": accum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2", choices=["qwen2", "llama", "phi3"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="global batch (tiny config: 16)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (tiny config: 256)")
    parser.add_argument("--per-device-batch", type=int, default=0, help="micro-batch rows per data shard (0: all)")
    args = parser.parse_args()
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    decoder = tiny_decoder(args.family)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(decoder)))
    objectives = {"lm": losses.lm_objective, "stage1": losses.stage1_objective,
                  "stage2": losses.stage2_objective(0.3)}
    result = {"device": str(jax.devices()[0].device_kind), "devices": jax.device_count(),
              "family": args.family, "params": int(n_params), "batch": args.batch, "seq": args.seq,
              "dtype": decoder.cfg.dtype, "steps": args.steps}
    for name, objective in objectives.items():
        result[name] = bench(name, objective, decoder, args, mesh)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
