"""Train-step throughput: jaxrag's trainer step vs transformers + torch AdamW, one Qwen2 config.

    python -m benchmarks.train --json OUT [--batch 32] [--seq 128] [--steps 2] [--rounds 3]

Both sides do the same work per step: a forward pass over batch x seq tokens, next-token
cross-entropy over every position, the backward pass, global-norm clipping at 1.0 and AdamW
(weight decay on matrices only). jaxrag runs `trainer.make_train_step` with the LM objective as
pretraining does (segment-id masks, donated state, one jitted program, compute dtype `auto`:
float32 on CPU, bfloat16 on accelerators); torch runs eager transformers (`sdpa` attention) and
`torch.optim.AdamW` (bfloat16 autocast on CUDA). The two alternate in rounds so both see the same
background load; a round's throughput is its mean and the result is the median round. Compilation
and a first torch step are warm-up, not timed.

`peak_fraction` = jaxrag's model FLOP/s (PaLM's count: 6 x matmul params + 12 x layers x heads x
head_dim x seq per token) / the device's peak: the spec sheet for known accelerators, else a
measured large matmul (CPU). On an accelerator `mfu_1b` adds the MFU of a ~1B-parameter config
(`--mfu` forces it elsewhere).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx
from tqdm.auto import tqdm

from benchmarks.common import (Parser, add_common_args, check_arch, environment, median, positive_int,
                               qwen2_config, write_json)
from jaxrag import sharding
from jaxrag.models.decoder import Decoder, DecoderConfig, resolve_dtype
from jaxrag.models.hf import decoder_config
from jaxrag.train import losses, trainer

LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0
# ~1B parameters (0.98B): TinyLlama-like widths, 18 layers; fits one 80 GB device without remat.
MFU_ARCH = dict(hidden=2048, layers=18, heads=16, kv_heads=8, intermediate=5632, vocab=32000)
MFU_BATCH, MFU_SEQ = 8, 1024
# Dense bf16 peak FLOP/s per device from the vendors' spec sheets; first substring match wins.
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L4", 121e12),
              ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12),
              ("TPU v6 lite", 918e12), ("TPU v6e", 918e12)]


def train_flops_per_token(cfg: DecoderConfig, seq: int) -> float:
    """PaLM's model FLOPs per trained token: 6 x matmul params + 12 x layers x heads x head_dim x seq
    (the embedding lookup is not a matmul; the LM head is, once even when tied)."""
    e, n, kv, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer = e * n * h + 2 * e * kv * h + n * h * e + 3 * e * cfg.intermediate_size
    params = cfg.num_layers * layer + e * cfg.padded_vocab_size
    return 6.0 * params + 12.0 * cfg.num_layers * n * h * seq


def device_peak_flops(dtype) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from)."""
    kind = jax.devices()[0].device_kind
    if jax.default_backend() != "cpu":
        for name, flops in PEAK_FLOPS:
            if name.lower() in kind.lower():
                return flops, f"spec sheet ({name}, dense bf16)"
    return measured_matmul_flops(dtype), f"measured ({jnp.dtype(dtype).name} 2048^3 matmul, best of 5)"


def measured_matmul_flops(dtype, n: int = 2048, repeats: int = 5) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def lm_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random ids, one document per row: the keys TextData.rows gives the LM objective."""
    ids = np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int32)
    return {"ids": ids, "mask": np.ones((batch, seq), np.int32), "loss_mask": np.ones((batch, seq), np.float32)}


def jaxrag_trainer(cfg: DecoderConfig, batch: dict[str, np.ndarray]):
    """A `run(n) -> seconds` that runs n train steps on `batch`, set up as `trainer.fit` does."""
    rows = len(batch["ids"])
    spec = trainer.TrainSpec("bench", batch_size=rows, lr=LR, total_steps=1_000_000, weight_decay=WEIGHT_DECAY,
                             grad_clip=CLIP)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    decoder = nnx.jit(lambda: Decoder(cfg, nnx.Rngs(0)))()  # one compiled init, not op-by-op
    graphdef, state = nnx.split(decoder)
    _, shardings = trainer.state_shardings(decoder, spec, mesh)
    params = sharding.place(nnx.to_pure_dict(state), shardings["params"])
    opt = jax.jit(trainer.make_optimizer(spec).init, out_shardings=shardings["opt"])(params)
    holder = {"state": {"params": params, "opt": opt, "step": sharding.place(np.int32(0), shardings["step"])}}
    step = trainer.make_train_step(graphdef, losses.lm_objective, spec, mesh, shardings,
                                   trainer.accumulation_steps(spec, mesh))
    host = sharding.host_rows(mesh, rows)
    device_batch = sharding.global_batch({k: v[host] for k, v in batch.items()}, host, mesh, rows)

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            holder["state"], metrics = step(holder["state"], device_batch, {})
        loss = float(metrics["loss"])  # waits for the last step
        if not np.isfinite(loss):
            raise RuntimeError(f"jaxrag train step: loss {loss}")
        return time.perf_counter() - start
    return run


def torch_trainer(hf_cfg: transformers.Qwen2Config, ids: np.ndarray):
    """The peer: eager transformers + torch AdamW, same optimizer settings; `run(n) -> seconds`."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(hf_cfg).to(device).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    tokens = torch.from_numpy(ids).long().to(device)

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the device
        if not np.isfinite(value):
            raise RuntimeError(f"torch train step: loss {value}")
        return time.perf_counter() - start
    return run, {"torch_device": device, "torch_attention": model.config._attn_implementation}


def measure_mfu(arch: dict, batch: int, seq: int, steps: int) -> dict:
    """jaxrag's train-step throughput and MFU for `arch` at batch x seq tokens per step."""
    cfg = decoder_config(qwen2_config(arch, seq), dtype="auto", param_dtype="float32")
    run = jaxrag_trainer(cfg, lm_batch(batch, seq, arch["vocab"]))
    start = time.perf_counter()
    run(1)
    compile_s = time.perf_counter() - start
    tok_s = batch * seq * steps / run(steps)
    peak, source = device_peak_flops(resolve_dtype(cfg.dtype))
    flops = train_flops_per_token(cfg, seq)
    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: nnx.state(Decoder(cfg, nnx.Rngs(0))))))
    return {"arch": arch, "params": int(n_params), "batch": batch, "seq": seq, "steps": steps,
            "compile_s": round(compile_s, 1), "tok_s": round(tok_s, 1), "flops_per_token": flops,
            "peak_flops": peak, "peak_source": source, "mfu": tok_s * flops / peak}


def main(argv=None) -> dict:
    parser = Parser(prog="python -m benchmarks.train", description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--batch", type=positive_int, default=32)
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument("--steps", type=positive_int, default=2, help="timed steps per side per round")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--mfu", action="store_true", help="measure the ~1B config's MFU on CPU too (slow)")
    parser.add_argument("--mfu-steps", type=positive_int, default=5)
    args = parser.parse_args(argv)
    arch = check_arch(parser, args)
    result = {**environment(), "arch": arch, "batch": args.batch, "seq": args.seq, "steps": args.steps,
              "rounds": args.rounds}
    hf_cfg = qwen2_config(arch, args.seq)
    cfg = decoder_config(hf_cfg, dtype="auto", param_dtype="float32")
    batch = lm_batch(args.batch, args.seq, arch["vocab"])
    ours = jaxrag_trainer(cfg, batch)
    start = time.perf_counter()
    ours(1)
    result["jaxrag_compile_s"] = round(time.perf_counter() - start, 1)
    peer, info = torch_trainer(hf_cfg, batch["ids"])
    result.update(info)
    peer(1)  # warm-up: allocator, oneDNN kernels
    tokens = args.batch * args.seq * args.steps
    ours_tok_s, peer_tok_s = [], []
    for _ in tqdm(range(args.rounds), desc="rounds (jaxrag, torch)", unit="round"):
        ours_tok_s.append(tokens / ours(args.steps))
        peer_tok_s.append(tokens / peer(args.steps))
    result["jaxrag_tok_s"] = round(median(ours_tok_s), 1)
    result["torch_tok_s"] = round(median(peer_tok_s), 1)
    result["rounds_tok_s"] = {"jaxrag": [round(x, 1) for x in ours_tok_s], "torch": [round(x, 1) for x in peer_tok_s]}
    result["speedup"] = round(result["jaxrag_tok_s"] / result["torch_tok_s"], 3)
    peak, result["peak_source"] = device_peak_flops(resolve_dtype(cfg.dtype))
    result["flops_per_token"] = train_flops_per_token(cfg, args.seq)
    result["peak_flops"] = peak
    result["peak_fraction"] = round(result["jaxrag_tok_s"] * result["flops_per_token"] / peak, 4)
    if jax.default_backend() != "cpu" or args.mfu:
        result["mfu_1b"] = measure_mfu(MFU_ARCH, MFU_BATCH, MFU_SEQ, args.mfu_steps)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
