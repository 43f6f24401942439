"""The pipeline's heavy programs at a config's real shapes, as abstract (nothing allocated)
jitted functions ready to lower and compile, with the FLOPs each call does by the model's count.

Shapes (the planner's stated assumptions where the data decides them):
- stage 1 / stage 2 steps: `stageN.batch_size` rows x `model.max_length` tokens, micro-batched by
  `per_device_batch_size`; scored targets per row = <s> + verbalization + <EOK> + answer
  (`construct.verbalize_max_tokens` + `inference.max_answer_tokens` + 2, rounded up to 8);
  stage 2 runs chosen and rejected rows in one pass of twice the rows.
- DPO reference scoring: one micro-batch of stage 2 through the frozen model (no gradient).
- construct: GenRead round-2 prompts of `demos_per_cluster` demonstrations + the question, each
  `verbalize_max_tokens` + 48 tokens (or `max_prompt_tokens` when set), bucketed like the sampler
  and prefilled in chunks of `sampler.prefill_chunk` columns (one chunk's pass is the program);
  likelihood scoring packed as `scoring.score` packs it (`scoring_shape`: each question's prefix
  once, then its rows' contexts and answers, in rows of up to `scoring.PACK_TOKENS`).
- routed decoding: `inference.batch_size` rows (padded as the router does), a cache for prompt,
  verbalization, knowledge and answer; the prefill appends the knowledge chunk.
- generation programs (construct's generation and likelihood scoring, routed decoding) read the
  model as inference loads it (`for_inference`: LoRA merged into the base, each layer's weights
  in buffers of their own), placed as the run places it: on one process's devices
  (`sharding.generation_mesh`), the weights by `param_shardings`, rows over `data`, the KV cache
  by `cache_sharding`; batch sizes are per process. Decode programs take their state donated, as
  the sampler does.
- calls per run (for the estimated hours): over the config's training mixture (`train_questions`);
  a generation program's calls are shared by the processes.
- retriever encoder: the config's `retrieval.encoder` (its config.json, where it is on this machine;
  else BERT-base, the DPR question encoder's shape), 64 rows x its maximum length (DPR: 256 tokens).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from collections.abc import Callable

import jax
import jax.numpy as jnp
import transformers
from flax import nnx

from jaxrag import sharding
from jaxrag.decode import sampler, sampling, scoring
from jaxrag.errors import JaxragError
from jaxrag.models import gguf, hf
from jaxrag.models.decoder import Decoder, DecoderConfig, init_cache, unstack_layers
from jaxrag.models.encoder import BertConfig, BertEncoder, pool
from jaxrag.models.encoder_io import encoder_config, max_length_of, resolve_encoder
from jaxrag.models.families import FAMILIES
from jaxrag.models.lora import Trainable, check_targets
from jaxrag.models.model import resolve_model_dir
from jaxrag.models.tokens import srrag_tokens
from jaxrag.train import losses, trainer

# Published config.json values of the paper's models (`families.PaperModel.config`), by hub
# name, so a plan needs no download.
PAPER_ARCHS = {f.paper.hub: f.paper.config for f in FAMILIES.values()}
# BERT-base: the paper's DPR encoders, planned when the config's encoder is not on this machine.
ENCODER = BertConfig(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)
# The programs `decoder_programs` + `encoder_program` make, in that order.
PROGRAMS = ("stage1 step", "stage2 step", "DPO reference scoring", "construct generation: prefill",
            "construct generation: decode step", "construct likelihood scoring", "routed decoding: knowledge prefill",
            "routed decoding: decode step", "retriever encoder")


@dataclasses.dataclass
class Program:
    name: str
    fn: Callable  # the jitted program
    args: tuple  # its abstract arguments (ShapeDtypeStructs with shardings)
    flops: float  # per call, by the model's count (XLA's cost analysis counts a scan body once)
    tokens: int  # per call
    calls: int  # per pipeline run (0 = per request, not estimated)
    read_bytes: float  # bytes one device reads per call: parameters, and a decode step's KV cache
    fixes: tuple[str, ...]  # settings that shrink it, for the "does not fit" line
    mesh: jax.sharding.Mesh  # what one call runs on
    per_process: bool = False  # generation: every process runs its own calls, `calls` shared by them
    # XLA-CPU has no bf16 matmul: it multiplies a float32 copy of each bf16 weight, and with the
    # generation programs' layers unrolled every layer's copy is live at once (26 GB for a 7B
    # model). An accelerator multiplies bf16 natively; compiled for fake CPU devices standing in
    # for one, the plan leaves out these bytes beyond one layer's copy (`fit.measure`).
    cpu_upcast_bytes: float = 0.0

    def lower(self) -> jax.stages.Lowered:
        return self.fn.lower(*self.args)


def bucket(n: int) -> int:
    return sampler.bucket(n)


def matmul_params(cfg: DecoderConfig) -> int:
    """Weights every token multiplies by in the layers (embedding lookup excluded)."""
    e, h = cfg.hidden_size, cfg.head_dim
    attn = e * (cfg.num_heads + 2 * cfg.num_kv_heads) * h + cfg.num_heads * h * e
    return cfg.num_layers * (attn + 3 * e * cfg.intermediate_size)


def forward_flops(cfg: DecoderConfig, rows: int, tokens: int, keys: int, scored: int) -> float:
    """One forward pass: 2 x weights per token, QK^T and PV over `keys` per query (as computed,
    masked or not), and the head at `scored` positions per row."""
    layers = 2 * matmul_params(cfg) * rows * tokens
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * rows * tokens * keys
    return layers + attention + 2 * cfg.hidden_size * cfg.padded_vocab_size * rows * scored


def train_flops(cfg: DecoderConfig, rows: int, length: int, scored: int, remat: str) -> float:
    """Forward + backward (2x forward; 1x under LoRA, which needs no frozen weight's gradient)
    + the forward recomputed under `block` remat."""
    passes = (2 if cfg.lora_rank else 3) + (remat == "block")
    return passes * forward_flops(cfg, rows, length, length, scored)


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _batch(mesh, **shapes):
    bs = sharding.batch_sharding(mesh)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=bs) for k, (shape, dtype) in shapes.items()}


def train_questions(cfg) -> int:
    """The training mixture's size: `data.train_sizes` over `data.train` (Table 5: 50,912)."""
    return sum(int(cfg.data.train_sizes[name]) for name in cfg.data.train)


def decoder_programs(cfg, dec_cfg: DecoderConfig, mesh, gen_mesh=None) -> list[Program]:
    """Every decoder program of the pipeline for config `cfg`: training's on `mesh`, generation's
    on `gen_mesh` (one process's generation mesh; default `mesh`)."""
    decoder = nnx.eval_shape(lambda: Decoder(dec_cfg, nnx.Rngs(0)))
    graphdef, _ = nnx.split(decoder)
    params_sh = sharding.param_shardings(mesh, decoder)
    # Under LoRA the SR-RAG tokens' rows train (any 4 rows have their shapes) and the frozen
    # base is what every program reads.
    trainable = Trainable(True, tuple(range(dec_cfg.vocab_size - 4, dec_cfg.vocab_size)),
                          dec_cfg.param_dtype) if dec_cfg.lora_rank else Trainable()
    params = jax.eval_shape(lambda p: trainable.join(*trainable.split(p)), nnx.to_pure_dict(nnx.state(decoder)))
    abstract_params = _abstract(params, params_sh)
    _, frozen_sh = trainable.shardings(params_sh, sharding.replicated(mesh))
    abstract_frozen = _abstract(jax.eval_shape(lambda p: trainable.split(p)[1], params), frozen_sh)
    dp = sharding.data_parallel_size(mesh)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / mesh.size
    remat, length = cfg.model.get("remat", "none"), int(cfg.model.max_length)
    questions = train_questions(cfg)
    scored = min(length, -(-(2 + int(cfg.construct.verbalize_max_tokens) + int(cfg.inference.max_answer_tokens)) // 8) * 8)
    i32, f32 = jnp.int32, jnp.float32
    programs = []

    def stage_batch(rows, pairs):
        keys = dict(ids=((rows, length), i32), mask=((rows, length), bool), targets=((rows, scored), i32),
                    src=((rows, length), f32), verb=((rows, length), f32), ans=((rows, length), f32),
                    valid=((rows,), f32), truncated=((rows,), f32))
        if pairs:
            keys.update(rej_ids=((rows, length), i32), rej_mask=((rows, length), bool),
                        rej_targets=((rows, scored), i32), rej_verb=((rows, length), f32),
                        dpo=((rows,), f32), ref_chosen=((rows,), f32), ref_rejected=((rows,), f32))
        return _batch(mesh, **keys)

    for name, objective, pairs in (("stage1", losses.stage1_objective, False),
                                   ("stage2", losses.stage2_objective(float(cfg.stage2.dpo_beta)), True)):
        section = cfg[name]
        spec = trainer.TrainSpec.from_section(name, section, 1, 0, remat)
        accum = trainer.accumulation_steps(spec, mesh)
        abstract, shardings = trainer.state_shardings(decoder, spec, mesh, trainable)
        step = trainer.make_train_step(graphdef, objective, spec, mesh, shardings, accum, trainable)
        batch = stage_batch(spec.batch_size, pairs)
        rows = spec.batch_size * (2 if pairs else 1)
        micro = spec.batch_size // accum // dp
        fixes = ([f"--config.{name}.per_device_batch_size={max(1, micro // 2)}"] if micro > 1 else []) + \
            ([] if remat == "block" else ["--config.model.remat=block"])
        steps = int(section.epochs) * math.ceil(questions / spec.batch_size)
        programs.append(Program(f"{name} step", step, (_abstract(abstract, shardings), batch, abstract_frozen),
                                train_flops(dec_cfg, rows, length, scored, remat), rows * length, steps,
                                param_bytes, tuple(fixes), mesh))
        if pairs:  # the frozen stage-1 model's log p(c_i+|q), log p(c_i-|q), one micro-batch at a time
            mrows = spec.batch_size // accum
            ref = jax.jit(lambda p, b: losses.verbalization_logprobs(trainer.forward_fn(graphdef, p), b),
                          out_shardings=sharding.replicated(mesh))
            programs.append(Program("DPO reference scoring", ref, (abstract_params, stage_batch(mrows, True)),
                                    forward_flops(dec_cfg, 2 * mrows, length, length, scored), 2 * mrows * length,
                                    math.ceil(questions / mrows), param_bytes, tuple(fixes[:1]), mesh))
    return programs + generation_programs(cfg, dec_cfg, gen_mesh or mesh, questions)


def inference_model(dec_cfg: DecoderConfig) -> tuple[DecoderConfig, Decoder]:
    """The model as generation loads it (`pipeline.workdir.load`, `models.model.for_inference`),
    abstract: adapters merged, weights in the compute dtype, layers unstacked."""
    inf_cfg = dataclasses.replace(dec_cfg, lora_rank=0, lora_alpha=0.0, lora_targets=(), param_dtype=dec_cfg.dtype)
    return inf_cfg, nnx.eval_shape(lambda: unstack_layers(Decoder(inf_cfg, nnx.Rngs(0))))


def inference_weight_bytes(dec_cfg: DecoderConfig) -> int:
    """Bytes of the inference model's weights, whole (what `generation_tensor` splits), counted
    as `sampler.place_for_generation` counts them."""
    _, model = inference_model(dec_cfg)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of abstract arrays with shardings (its shard of each)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def scoring_shape(cfg, dec_cfg: DecoderConfig, mesh, questions: int) -> tuple[int, int, int, int]:
    """Construct's packed scoring (`scoring.score`) at the config's sizes: (rows per call, packed
    length, target columns per row, calls). A question's unit is its prompt's shared prefix (48
    tokens: header and question), then its rows' rests: " Answer: a" (8 + answer tokens), and
    per context the context, its wrapping (16 tokens) and the answer, verbalizations of
    `verbalize_max_tokens` and passages of 192; units are cut at `PACK_TOKENS` and fill their rows."""
    c, answer = cfg.construct, int(cfg.inference.max_answer_tokens)
    n, verbal = int(c.n_contexts), int(c.verbalize_max_tokens)
    rests = [8 + answer] + [16 + verbal + answer] * n + [16 + 192 + answer] * n
    longest = 48 + max(rests)
    cap = max(min(scoring.PACK_TOKENS, dec_cfg.sliding_window or scoring.PACK_TOKENS), longest)
    # One question's rows (a shared 48-token prefix, then each rest) cut into units as `score` cuts them.
    rows = [[0] * 48 + [i + 1] * rest for i, rest in enumerate(rests)]
    units = [len(prefix) + sum(len(r) for _, r in unit) for prefix, unit in
             scoring.pack_units(rows, [list(range(len(rows)))], [len(r) - answer for r in rows], cap)]
    length = scoring.score_bucket(max(units))
    rows = sampler.batch_rows(max(1, int(c.score_batch_size) * scoring.score_bucket(longest) // length), mesh)
    targets = scoring.score_bucket(answer * len(rests) * length // sum(units))  # a packed row's answers
    calls = math.ceil(questions * sum(units) / length / rows)
    return rows, length, min(length, targets), calls


def generation_programs(cfg, dec_cfg: DecoderConfig, mesh, questions: int) -> list[Program]:
    """Construct's generation and likelihood scoring and routed decoding, each on `mesh` (one
    process's generation mesh) at the config's per-process batch sizes; `calls` over all processes."""
    inf_cfg, inf_decoder = inference_model(dec_cfg)
    inf_graphdef, inf_state = nnx.split(inf_decoder)
    inf_params = _abstract(nnx.to_pure_dict(inf_state), sharding.param_shardings(mesh, inf_decoder))
    inf_param_bytes = device_bytes(inf_params)
    # XLA-CPU's float32 copies of each layer's bf16 weights, beyond one layer's (`Program.cpu_upcast_bytes`)
    upcast = [4 * sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(layer)
                      if x.ndim >= 2 and x.dtype == jnp.bfloat16) for layer in inf_params["layers"].values()]
    upcast_bytes = sum(upcast) - max(upcast)
    tensor, per_process = mesh.shape["tensor"], mesh.size
    split = (f"--config.generation.tensor={2 * tensor}",) if per_process % (2 * tensor) == 0 else ()
    i32, f32 = jnp.int32, jnp.float32
    programs = []

    def extend_program(name, rows, chunk, slots, calls, fixes, hidden_layer=None):
        dtype = jnp.dtype(dec_cfg.dtype)
        # shapes only: a 7B KV cache (tens of GB) must never be allocated on the planning host
        state = jax.eval_shape(lambda: sampler.DecodeState(
            init_cache(inf_cfg, rows, slots, dtype), jnp.zeros((rows, slots), bool), jnp.zeros((rows,), i32),
            jnp.zeros((), i32), jnp.zeros((rows, dec_cfg.padded_vocab_size), f32)))
        bs, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
        cache_sh = jax.tree.map(lambda x: sharding.cache_sharding(mesh, x.shape), state.cache)
        state_sh = sampler.DecodeState(cache_sh, bs, bs, rep, bs)
        abstract_state = _abstract(state, state_sh)
        inputs = _batch(mesh, ids=((rows, chunk), i32), mask=((rows, chunk), bool))

        def run(p, st, ids, mask):
            new, hidden = sampler._extend(nnx.merge(inf_graphdef, p), st, ids, mask, hidden_layer)
            return new, hidden, sampling.sample_tokens(new.logits, jax.random.key(0), sampling.SamplingParams())

        fn = jax.jit(run, out_shardings=(state_sh, None, bs), donate_argnums=1)
        programs.append(Program(name, fn, (inf_params, abstract_state, inputs["ids"], inputs["mask"]),
                                forward_flops(dec_cfg, rows, chunk, slots, 1), rows * chunk, calls,
                                inf_param_bytes + device_bytes(abstract_state.cache), split + fixes, mesh, True,
                                upcast_bytes))

    c, inf = cfg.construct, cfg.inference
    verbal = int(c.verbalize_max_tokens)
    prompt = int(c.max_prompt_tokens) or (int(c.demos_per_cluster) + 1) * (verbal + 48)
    gen_rows = sampler.batch_rows(int(c.generate_batch_size), mesh, int(c.generate_batch_size))
    gen_slots = bucket(prompt) + bucket(verbal)
    gen_calls = math.ceil(questions * int(c.n_contexts) / gen_rows)
    gen_fix = (f"--config.construct.generate_batch_size={max(1, gen_rows // 2)}",)
    chunk = min(bucket(prompt), sampler.prefill_chunk(gen_rows, dec_cfg.num_heads, gen_slots))  # as generate()
    extend_program("construct generation: prefill", gen_rows, chunk, gen_slots,
                   gen_calls * -(-bucket(prompt) // chunk), gen_fix)
    extend_program("construct generation: decode step", gen_rows, 1, gen_slots, gen_calls * verbal, gen_fix)
    score_rows, length, answer, score_calls = scoring_shape(cfg, dec_cfg, mesh, questions)
    fn = jax.jit(lambda p, ids, pos, seg, branch, at: losses.target_logprobs(nnx.merge(inf_graphdef, p)(
        ids, pos, seg > 0, segment_ids=seg, branch_ids=branch, logit_positions=jnp.maximum(at - 1, 0)).logits, ids, at))
    b = _batch(mesh, ids=((score_rows, length), i32), pos=((score_rows, length), i32),
               seg=((score_rows, length), i32), branch=((score_rows, length), i32), at=((score_rows, answer), i32))
    programs.append(Program("construct likelihood scoring", fn,
                            (inf_params, b["ids"], b["pos"], b["seg"], b["branch"], b["at"]),
                            forward_flops(dec_cfg, score_rows, length, length, answer), score_rows * length,
                            score_calls, inf_param_bytes,
                            split + (f"--config.construct.score_batch_size={max(1, int(c.score_batch_size) // 2)}",),
                            mesh, True, upcast_bytes))
    route_rows = sampler.batch_rows(int(inf.batch_size), mesh, int(inf.batch_size))  # as the eval's loops
    knowledge = bucket(int(inf.max_knowledge_tokens) + 8)
    route_slots = 128 + 1 + bucket(verbal) + knowledge + bucket(int(inf.max_answer_tokens))
    route_fix = (f"--config.inference.batch_size={max(1, route_rows // 2)}",)
    extend_program("routed decoding: knowledge prefill", route_rows, knowledge, route_slots, 0, route_fix,
                   int(cfg.model.datastore_layer))
    extend_program("routed decoding: decode step", route_rows, 1, route_slots, 0, route_fix)
    return programs


def encoder_architecture(name: str) -> tuple[BertConfig, int]:
    """(architecture, tokens per text) of the retriever encoder `name` (an alias, a directory or a
    cached hub id), read from its config.json; BERT-base at DPR's 256 tokens when it is not on
    this machine (the paper's DPR encoders are BERT-base)."""
    try:
        path, _ = resolve_encoder(name)
        hf_config = encoder_config(path)
        return BertConfig.from_hf(hf_config), max_length_of(path, hf_config)
    except JaxragError:
        return ENCODER, 256


def encoder_program(cfg, mesh, rows: int = 64) -> Program:
    """The retriever's query/passage encoder (`encoder_architecture`), replicated weights,
    batch-sharded rows."""
    arch, length = encoder_architecture(str(cfg.retrieval.encoder))
    model = nnx.eval_shape(lambda: BertEncoder(arch, nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    rep = sharding.replicated(mesh)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
    b = _batch(mesh, ids=((rows, length), jnp.int32), mask=((rows, length), jnp.int32))
    fn = jax.jit(lambda s, ids, mask: pool(nnx.merge(graphdef, s), nnx.merge(graphdef, s)(ids, mask), mask, "cls", False))
    e, f = arch.hidden_size, arch.intermediate_size
    flops = 2 * arch.num_layers * (4 * e * e + 2 * e * f) * rows * length + 4 * arch.num_layers * e * rows * length**2
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    return Program("retriever encoder", fn, (abstract, b["ids"], b["mask"]), flops, rows * length, 0,
                   n_bytes, (), mesh)


def pipeline_programs(cfg, mesh, gen_mesh=None) -> list[Program]:
    """Every heavy program of the pipeline for config `cfg`, in `PROGRAMS` order: training's on
    `mesh`, generation's on `gen_mesh` (default `mesh`)."""
    return decoder_programs(cfg, plan_decoder_config(cfg), mesh, gen_mesh) + [encoder_program(cfg, mesh)]


def plan_decoder_config(cfg) -> DecoderConfig:
    """The config's model architecture at its target dtypes: `auto` compute = bfloat16 (what the
    accelerators run), even when the plan compiles on CPU. A local HF directory is read; the
    paper's hub names use `PAPER_ARCHS`. The vocab grows by the SR-RAG tokens if it must."""
    path = str(cfg.model.path)
    if (gguf_file := gguf.find_gguf(path)) is not None:  # its metadata, without reading the weights
        hf_config = gguf.plain_config(transformers.AutoConfig.from_pretrained(str(gguf_file.parent),
                                                                               gguf_file=gguf_file.name))
    elif path and Path(path).is_dir():
        hf_config = hf.read_hf_config(Path(path))
    elif path in PAPER_ARCHS:
        hf_config = transformers.AutoConfig.for_model(**PAPER_ARCHS[path])
    else:
        try:
            hf_config = hf.read_hf_config(resolve_model_dir(path))
        except JaxragError as e:
            raise JaxragError(f"config model.path={path!r}: the plan needs a local Hugging Face directory "
                              f"(config.json) or one of the paper's models ({', '.join(PAPER_ARCHS)}): {e}") from None
    dtype = "bfloat16" if cfg.model.dtype == "auto" else str(cfg.model.dtype)
    lora = cfg.model.get("lora")
    if lora and int(lora.rank):  # the frozen base in base_dtype (`auto`: bfloat16, as on accelerators)
        base = str(cfg.model.get("base_dtype", "auto"))
        dec_cfg = hf.decoder_config(hf_config, dtype=dtype, param_dtype="bfloat16" if base == "auto" else base)
        dec_cfg = dataclasses.replace(dec_cfg, lora_rank=int(lora.rank), lora_alpha=float(lora.alpha),
                                      lora_targets=check_targets(list(lora.targets)))
    else:
        dec_cfg = hf.decoder_config(hf_config, dtype=dtype, param_dtype=str(cfg.model.param_dtype))
    tokenizer_len = FAMILIES[dec_cfg.family].paper.tokenizer_len or dec_cfg.vocab_size
    new_tokens = len(srrag_tokens(tuple(cfg.model.sources)))
    return dataclasses.replace(dec_cfg, vocab_size=max(dec_cfg.vocab_size, tokenizer_len + new_tokens))
