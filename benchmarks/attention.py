"""Fused attention vs XLA attention: the decoder's attention path checked for numbers and timed.

    python -m benchmarks.attention --json OUT [--seq 512] [--batch 4] [--repeats 10]

`jaxrag.models.decoder.attention_implementation` gives cuDNN's fused kernel on GPUs (bf16/fp16,
head dim <= 128, even lengths, no sliding window; a one-token decode step takes XLA) and XLA
elsewhere; each case records the `implementation` it got. Here both paths see the decoder's own
masks (`attention_mask_4d`): a training batch with left padding, packed documents, a prefill
chunk written after earlier chunks, and a one-token decode step over a KV cache. Per case, in
bfloat16, the output and dq/dk/dv (of a weighted sum over the real, non-padding query rows)
of each path are compared with a float32 XLA reference: `rel_err` = max |path - ref| / max |ref|
(outputs over live rows, gradients over all rows).
The fused path passes when its error is within `--factor` x XLA-bf16's own error plus `--atol`,
and nothing is NaN, padding rows included (a NaN there would poison the gradients of a batch).
Then the whole bf16 decoder with the fused path vs XLA forced: logits and LM-loss gradient of a
left-padded batch (pass: relative error < 0.05), and greedy tokens through `generate`.
Timings: forward + backward of each path at `--seq`, median of `--repeats`. On a device with no
fused path (CPU, TPU) both sides are XLA and only the bf16-vs-float32 errors say anything.
"""

from __future__ import annotations

import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import (Parser, add_common_args, check_arch, environment, median, positive_int,
                               qwen2_config, write_json)
from jaxrag.models import decoder as decoder_module
from jaxrag.models import masks
from jaxrag.models.hf import decoder_config


def cases(batch: int, seq: int) -> dict[str, tuple[jax.Array, int, np.ndarray]]:
    """name -> (mask [b, 1, t, s] as the decoder builds it, query length t, real queries [b, t])."""
    rng = np.random.default_rng(0)
    pad = rng.integers(0, seq // 2, batch)
    left_padded = np.arange(seq)[None] >= pad[:, None]  # [b, s]
    segments = np.minimum(np.arange(seq)[None] // (seq // 3) + 1, 3).repeat(batch, 0)
    segments[:, seq - seq // 8:] = 0  # padding after the packed documents
    twice = jnp.asarray(np.concatenate([left_padded, left_padded], 1))
    mask_4d = masks.attention_mask_4d
    return {
        "train_left_padded": (mask_4d(jnp.asarray(left_padded), seq, 0, None), seq, left_padded),
        "train_packed": (mask_4d(jnp.asarray(segments > 0), seq, 0, None, jnp.asarray(segments)), seq, segments > 0),
        "prefill_chunk": (mask_4d(twice, seq, seq, None), seq, left_padded),
        "decode_step": (mask_4d(twice, 1, 2 * seq - 1, None), 1, np.ones((batch, 1), bool)),
    }


def attend(impl: str, dtype):
    def f(q, k, v, mask, weight):
        out = jax.nn.dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), mask=mask,
                                           implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * weight), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


def rel_err(x, ref, rows) -> float:
    x, ref = (np.asarray(a, np.float32)[rows] for a in (x, ref))
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def check_case(mask, t: int, live: np.ndarray, batch: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    s = mask.shape[-1]
    fused = decoder_module.attention_implementation(jax.default_backend(), jnp.bfloat16, head_dim, None, t, s)
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (batch, t, heads, head_dim))
    k, v = (jax.random.normal(key, (batch, s, kv_heads, head_dim)) for key in keys[1:3])
    weight = jax.random.normal(keys[3], (batch, t, heads, head_dim)) * jnp.asarray(live)[..., None, None]
    (_, ref_out), ref_grads = attend("xla", jnp.float32)(q, k, v, mask, weight)
    row = {"t": t, "s": s, "live_rows": int(live.sum()), "implementation": fused}
    for name, impl in (("xla", "xla"), ("fused", fused)):
        (_, out), grads = attend(impl, jnp.bfloat16)(q, k, v, mask, weight)
        finite = bool(jnp.isfinite(out).all()) and all(bool(jnp.isfinite(g).all()) for g in grads)
        # Outputs on live rows only (a padding row's output is never used); gradients everywhere,
        # since a weight gradient sums over every row (the reference has exact zeros off the live ones).
        errs = [rel_err(out, ref_out, live)] + [rel_err(g, r, slice(None)) for g, r in zip(grads, ref_grads)]
        row[name] = {"finite": finite, "rel_err": dict(zip(("out", "dq", "dk", "dv"), errs))}
    return row


def passes(row: dict, factor: float, atol: float) -> bool:
    xla, fused = row["xla"]["rel_err"], row["fused"]["rel_err"]
    return row["fused"]["finite"] and all(fused[k] <= factor * xla[k] + atol for k in xla)


def time_paths(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    mask, t, _ = cases(batch, seq)["train_left_padded"]
    fused = decoder_module.attention_implementation(jax.default_backend(), jnp.bfloat16, head_dim, None, t, seq)
    keys = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(keys[0], (batch, t, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim), jnp.bfloat16) for key in keys[1:])
    weight = jnp.ones(q.shape, jnp.float32)
    out = {}
    for name, impl in (("xla", "xla"), ("fused", fused)):
        f = attend(impl, jnp.bfloat16)
        jax.block_until_ready(f(q, k, v, mask, weight))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(f(q, k, v, mask, weight))
            times.append(time.perf_counter() - start)
        out[f"{name}_ms"] = round(1e3 * median(times), 3)
    return out


def decoder_check(arch: dict, batch: int, seq: int, new: int = 16) -> dict:
    """The bf16 decoder with the fused path vs XLA forced, on a left-padded batch: logits and the
    gradient of the LM loss (relative errors on real rows), and greedy tokens through `generate`
    (fused prefill, XLA decode steps) vs all-XLA (fraction equal; bf16 near-ties may differ)."""
    from jaxrag.decode.sampler import generate

    cfg = decoder_config(qwen2_config(arch, 2 * seq), dtype="bfloat16", param_dtype="float32")
    model = nnx.jit(lambda: decoder_module.Decoder(cfg, nnx.Rngs(0)))()
    pad = np.random.default_rng(0).integers(0, seq // 2, batch)
    key_mask = jnp.asarray(np.arange(seq)[None] >= pad[:, None])
    ids = jax.random.randint(jax.random.key(3), (batch, seq), 0, arch["vocab"])
    positions = masks.positions_from_mask(key_mask)

    def loss(m):
        logits = m(ids, positions, key_mask).logits[:, :-1, :arch["vocab"]]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * key_mask[:, 1:]) / jnp.sum(key_mask[:, 1:]), logits

    prompts = [row[p:].tolist() for row, p in zip(np.asarray(ids), pad)]
    outs = {}
    for name in ("fused", "xla"):
        jax.clear_caches()  # the implementation is read at trace time: no compiled program may be reused
        run = nnx.jit(lambda m: nnx.grad(loss, has_aux=True)(m))
        with mock.patch.object(decoder_module, "attention_implementation",
                               decoder_module.attention_implementation if name == "fused" else lambda *_: "xla"):
            grads, logits = run(model)
            tokens = np.asarray(generate(model, prompts, new))
        outs[name] = (np.concatenate([np.ravel(g) for g in jax.tree.leaves(nnx.to_pure_dict(grads))]), logits, tokens)
    (g_f, l_f, t_f), (g_x, l_x, t_x) = outs["fused"], outs["xla"]
    return {"logits_rel_err": rel_err(l_f, l_x, np.asarray(key_mask[:, :-1])),
            "grad_rel_err": float(np.linalg.norm(g_f - g_x) / np.linalg.norm(g_x)),
            "generate_same": float(np.mean(t_f == t_x))}


def main(argv=None) -> dict:
    parser = Parser(prog="python -m benchmarks.attention", description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, default=512)
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--factor", type=float, default=2.0, help="fused error allowed, in units of XLA-bf16's")
    parser.add_argument("--atol", type=float, default=2e-3, help="plus this much relative error")
    args = parser.parse_args(argv)
    arch = check_arch(parser, args)
    heads, kv_heads, head_dim = arch["heads"], arch["kv_heads"], arch["hidden"] // arch["heads"]
    result = {**environment(), "arch": arch, "batch": args.batch, "seq": args.seq,
              "factor": args.factor, "atol": args.atol, "cases": {}}
    for dim in sorted({head_dim, 128}):  # the benchmark model's, and the 7B models' head dim
        for name, (mask, t, live) in cases(args.batch, args.seq).items():
            row = check_case(mask, t, live, args.batch, heads, kv_heads, dim)
            row["pass"] = passes(row, args.factor, args.atol)
            result["cases"][f"{name}_head{dim}"] = row
    result["decoder"] = decoder_check(arch, args.batch, args.seq)
    result["timing"] = {f"head{dim}": time_paths(args.batch, args.seq, heads, kv_heads, dim, args.repeats)
                        for dim in sorted({head_dim, 128})}
    result["pass"] = all(row["pass"] for row in result["cases"].values()) and result["decoder"]["logits_rel_err"] < 0.05 \
        and result["decoder"]["grad_rel_err"] < 0.05
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
