"""KV-cache generation: chunked prefill (`extend`) and an on-device decode loop (`decode`).

The cache has a static shape [batch, slots]; every row writes the same slot at each step, and a
key mask records which slots hold a row's real tokens. So rows may skip steps (a finished row, a
row with nothing to add in a chunk) and the holes simply stay masked; position ids count each
row's real tokens, so left padding and holes never shift a row's positions. This is what lets
SR-RAG route rows of one batch to different sources and keep every prefix's cache.

Shapes are bucketed (`bucket`) so a run compiles a bounded number of programs. Every call takes
its `DecodeState` donated: the cache is updated in place, never copied, and the caller's state
is consumed (use the one returned). Generation reads the decoder best in its inference layout
(`jaxrag.models.model.for_inference`: LoRA merged, each layer's weights in buffers of their own).

JAX's persistent compilation cache is on (`JAX_COMPILATION_CACHE_DIR`, default
`~/.cache/jaxrag/xla`; empty = off), so the unrolled layer loops compile once per machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrag import sharding
from jaxrag.decode.sampling import SamplingParams, row_keys, sample_tokens
from jaxrag.models.decoder import Decoder, KVCache, init_cache
from jaxrag.models.kv_cache import LayerCache
from jaxrag.sharding import batch_sharding, data_parallel_size, place

NO_TOKEN = -1  # marks "no token generated at this step" in output buffers


def enable_compilation_cache() -> None:
    """Turns on JAX's persistent compilation cache at `~/.cache/jaxrag/xla` unless the process
    chose its own (`JAX_COMPILATION_CACHE_DIR`, set or empty, or `jax_compilation_cache_dir`)."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jaxrag", "xla"))


enable_compilation_cache()


class DecodeState(NamedTuple):
    cache: KVCache  # one LayerCache per layer: keys, values [batch, kv_heads, slots, head_dim]
    key_mask: jax.Array  # [batch, slots] bool: slots holding this row's real tokens
    next_pos: jax.Array  # [batch] int32: position id of each row's next token
    slot: jax.Array  # [] int32: next free cache slot, shared by all rows
    logits: jax.Array  # [batch, vocab] float32: next-token logits after the last real token


# Prompt columns per prefill pass: a long prompt is appended in chunks, so attention's
# temporaries (without a fused kernel: [rows, heads, chunk, cache] float32 scores, two live at
# once) stay bounded: at most PREFILL_CHUNK columns, fewer (down to 128) where the scores of a
# pass would exceed PREFILL_SCORES_BYTES (GenRead round 2 at 32 rows x 1,536 slots on a 9-head
# model: 0.9 GB of scores at 512 columns, 0.23 GB at 128).
PREFILL_CHUNK = 512
PREFILL_SCORES_BYTES = 256 << 20


def prefill_chunk(rows: int, heads: int, slots: int) -> int:
    """Columns per prefill pass for `rows` rows of a model with `heads` query heads over a cache
    of `slots` slots."""
    chunk = PREFILL_CHUNK
    while chunk > 128 and rows * heads * chunk * slots * 4 > PREFILL_SCORES_BYTES:
        chunk //= 2
    return chunk


def bucket(n: int, minimum: int = 8) -> int:
    """Padded length for n >= 1 tokens: the next power of two, or the next multiple of 128 where
    that is shorter (a 1,188-token prompt gets 1,280 slots, not 2,048): few compiled shapes, and
    little padding read per step. A prompt of such a length prefills in whole `PREFILL_CHUNK`
    chunks and one shorter last chunk."""
    n = max(int(n), minimum)
    return min(1 << (n - 1).bit_length(), -(-n // 128) * 128)


def _zero_state(decoder: Decoder, batch: int, slots: int) -> DecodeState:
    cfg = decoder.cfg
    return DecodeState(
        cache=init_cache(cfg, batch, slots),
        key_mask=jnp.zeros((batch, slots), bool),
        next_pos=jnp.zeros((batch,), jnp.int32),
        slot=jnp.zeros((), jnp.int32),
        logits=jnp.zeros((batch, cfg.padded_vocab_size), jnp.float32),
    )


def init_state(decoder: Decoder, batch: int, slots: int) -> DecodeState:
    """A zeroed state for `batch` rows of `slots` cache slots, placed as the decoder is
    (`placement`): rows over the mesh's batch axes, KV heads over `tensor`; created in place on
    the devices (no device holds the whole cache)."""
    where = state_shardings(decoder, batch, slots)
    if where is None:
        return _zero_state(decoder, batch, slots)
    return zeros_on(jax.eval_shape(lambda: _zero_state(decoder, batch, slots)), where)


def state_shardings(decoder: Decoder, batch: int, slots: int) -> DecodeState | None:
    """Where a state of `batch` rows and `slots` slots goes on the decoder's devices (None: on its
    one device): rows over the mesh's batch axes, KV heads over `tensor`."""
    mesh = placement(decoder)
    if mesh is None:
        return None
    shapes = jax.eval_shape(lambda: _zero_state(decoder, batch, slots))
    whole = sharding.replicated(mesh)
    rows = batch_sharding(mesh) if batch % data_parallel_size(mesh) == 0 else whole  # one row: on every device
    return DecodeState(cache_shardings(mesh, shapes.cache), rows, rows, whole, rows)


def cache_shardings(mesh, cache) -> tuple:
    """Where each layer's cache buffers (shapes of `cache`) go: `sharding.cache_sharding`."""
    layer = LayerCache(*(sharding.cache_sharding(mesh, x.shape) for x in cache[0]))
    return tuple(layer for _ in cache)


def zeros_on(shapes, shardings):
    """Zeros of each leaf's shape and dtype, created on its sharding's devices (nothing compiled,
    and no device holds more than its shard)."""
    return jax.tree.map(lambda x, where: jnp.zeros(x.shape, x.dtype, device=where), shapes, shardings)


def chunk_positions(state: DecodeState, mask):
    """A left-padded chunk's position ids [batch, t] (each row's real tokens counted on from its
    next position) and the key mask with the chunk's columns written at the shared slot."""
    positions = state.next_pos[:, None] + jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    return positions, jax.lax.dynamic_update_slice(state.key_mask, mask, (0, state.slot))


def _extend(decoder: Decoder, state: DecodeState, ids, mask, hidden_layer=None):
    mask = mask.astype(bool)
    positions, key_mask = chunk_positions(state, mask)
    last = jnp.full((ids.shape[0], 1), ids.shape[1] - 1, jnp.int32)
    out = decoder(ids, positions, key_mask, cache=state.cache, cache_index=state.slot,
                  hidden_layer=hidden_layer, logit_positions=last)
    # Chunks are left-padded, so the last column is each row's newest real token.
    has_tokens = mask.any(axis=1)
    logits = jnp.where(has_tokens[:, None], out.logits[:, 0], state.logits)
    new = DecodeState(out.cache, key_mask, state.next_pos + mask.sum(axis=1, dtype=jnp.int32),
                      state.slot + ids.shape[1], logits)
    return new, None if out.hidden is None else out.hidden[:, -1]


@partial(nnx.jit, static_argnames=("hidden_layer",), donate_argnums=1)
def extend(decoder: Decoder, state: DecodeState, ids, mask, hidden_layer: int | None = None):
    """Appends a left-padded chunk ids/mask [batch, t] to every row's cache (one forward pass).

    Returns the new state and, if `hidden_layer` is set, that layer's state at the last column
    [batch, hidden] (SR-RAG reads it at `<EOQ>`)."""
    return _extend(decoder, state, ids, mask, hidden_layer)


def prefill_last(decoder: Decoder, sequences: Sequence[Sequence[int]], hidden_layer: int, max_rows: int):
    """One left-padded prefill per chunk of `max_rows` sequences, nothing decoded after it: yields
    (rows in the chunk, the state, whose logits are at each row's last token, and `hidden_layer`'s
    state there). Shapes are bucketed, so a run compiles a few programs."""
    mesh = placement(decoder)
    for start in range(0, len(sequences), max_rows):
        chunk = sequences[start:start + max_rows]
        rows, length = batch_rows(bucket(len(chunk), 1), mesh), bucket(max(map(len, chunk)))
        ids, mask = left_pad(chunk, length, rows)
        state, hidden = extend(decoder, init_state(decoder, rows, length), on_mesh(ids, mesh), on_mesh(mask, mesh),
                               hidden_layer=hidden_layer)
        yield len(chunk), state, hidden


class Decoded(NamedTuple):
    state: DecodeState
    tokens: jax.Array  # [batch, max_new] int32, NO_TOKEN after a row stops
    count: jax.Array  # [batch] int32: tokens generated
    stopped: jax.Array  # [batch] bool: ended on a stop token rather than on its budget
    end_hidden: jax.Array | None  # [batch, hidden] float32: `hidden_layer`'s state at the last token written


@partial(nnx.jit, static_argnames=("max_new", "sampling", "hidden_layer"), donate_argnums=1)
def decode(decoder: Decoder, state: DecodeState, stop_ids, budget, rng, row_ids, max_new: int,
           sampling: SamplingParams = SamplingParams(), hidden_layer: int | None = None) -> Decoded:
    """Generates up to `max_new` tokens per row in a `lax.while_loop`.

    stop_ids [batch, n] (NO_TOKEN-padded): a row stops after emitting one of them (the stop token
    is kept, and written to the cache). budget [batch]: a row's own token limit (0 = idle row).
    row_ids [batch]: each row's draws use `row_keys(rng, row_ids)` folded with the step.
    `hidden_layer`: also keep that layer's state at each row's last written token (its stop
    token, or its last one when the budget ends it), as each step computes it: what a prefill of
    the prompt and the generation would read at its last column, without that prefill.
    """
    batch, keys = budget.shape[0], row_keys(rng, row_ids)

    def cond(carry):
        step, _, _, count, done, _, _ = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, st, tokens, count, done, stopped, end = carry
        tok = sample_tokens(st.logits, jax.vmap(jax.random.fold_in, (0, None))(keys, step), sampling)
        live = ~done
        tokens = tokens.at[:, step].set(jnp.where(live, tok, NO_TOKEN))
        st, hidden = _extend(decoder, st, jnp.where(live, tok, 0)[:, None], live[:, None], hidden_layer)
        if hidden is not None:
            end = jnp.where(live[:, None], hidden.astype(jnp.float32), end)
        count = count + live
        hit = live & jnp.any(tok[:, None] == stop_ids, axis=-1)
        return step + 1, st, tokens, count, done | hit | (count >= budget), stopped | hit, end

    end = None if hidden_layer is None else jnp.zeros((batch, decoder.cfg.hidden_size), jnp.float32)
    init = (jnp.zeros((), jnp.int32), state, jnp.full((batch, max_new), NO_TOKEN, jnp.int32),
            jnp.zeros((batch,), jnp.int32), budget <= 0, jnp.zeros((batch,), bool), end)
    _, state, tokens, count, _, stopped, end = jax.lax.while_loop(cond, body, init)
    return Decoded(state, tokens, count, stopped, end)


def repeat_rows(decoder: Decoder, state: DecodeState, samples: int) -> DecodeState:
    """Each row of a state `samples` times in a row (row i -> rows i*samples ... i*samples +
    samples - 1), its cache included: one prefill serves every sample of a prompt, or every
    source of a question. Placed as `init_state` places a state of that many rows (a device's
    rows stay on it: it holds a contiguous block of prompts, and their copies follow)."""
    if samples == 1:
        return state
    rows, slots = state.key_mask.shape
    return _repeat_rows(state, samples, state_shardings(decoder, rows * samples, slots))


@partial(jax.jit, static_argnames=("samples", "where"))
def _repeat_rows(state: DecodeState, samples: int, where) -> DecodeState:
    # one row's cache has no row axis (`LayerCache`): its copies gain one
    rows = lambda x: jnp.repeat(x if x.ndim == 4 else x[None], samples, axis=0)  # noqa: E731
    cache = tuple(LayerCache(rows(c.k), rows(c.v)) for c in state.cache)
    out = jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, samples, axis=0), state._replace(cache=()))
    out = out._replace(cache=cache)
    return out if where is None else jax.lax.with_sharding_constraint(out, where)


def left_pad(rows: Sequence[Sequence[int]], length: int, batch: int, pad_id: int = 0):
    """Token lists -> (ids, mask) int32 [batch, length], left-padded; extra rows are empty."""
    ids = np.full((batch, length), pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    for i, row in enumerate(rows):
        if len(row) > length:
            raise ValueError(f"row {i} has {len(row)} tokens, more than the chunk length {length}")
        if len(row):
            ids[i, length - len(row):] = row
            mask[i, length - len(row):] = True
    return ids, mask


def stop_matrix(stops: Sequence[Sequence[int]], batch: int) -> np.ndarray:
    """[batch, width] stop ids: row i stops on `stops[i]`; rows past len(stops) never stop."""
    width = max([1, *(len(s) for s in stops)])
    out = np.full((batch, width), NO_TOKEN, np.int32)
    for i, s in enumerate(stops):
        out[i, : len(s)] = s
    return out


def shard_decoder(decoder: Decoder, mesh) -> Decoder:
    """The decoder with its parameters placed on `mesh` by the logical-axis rules. Generation
    reads the placement from the decoder (`placement`): rows go over the mesh's batch axes."""
    graphdef, state = nnx.split(decoder)
    placed = sharding.place(nnx.to_pure_dict(state), sharding.param_shardings(mesh, decoder))
    nnx.replace_by_pure_dict(state, placed)
    return nnx.merge(graphdef, state)


def place_for_generation(decoder: Decoder, tensor: int = 0) -> tuple[Decoder, dict]:
    """The decoder on this process's devices for generation (`sharding.generation_mesh`): split
    over `tensor` devices (0 = only as far as it must be to fit, `sharding.generation_tensor`),
    replicated over the others, which each take their share of a batch's rows. Returns it and the
    placement (processes, devices per process, data and tensor sizes) for the run's records."""
    n = jax.local_device_count()
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(decoder, nnx.Param)))
    t = sharding.generation_tensor(int(tensor), n, weights, sharding.usable_device_bytes())
    where = {"processes": jax.process_count(), "devices_per_process": n, "data": n // t, "tensor": t}
    return (decoder if n == 1 else shard_decoder(decoder, sharding.generation_mesh(t))), where


def placement(decoder: Decoder):
    """The mesh of this process's devices the decoder's parameters are placed on (`shard_decoder`,
    `place_for_generation`), whose batch axes split a batch's rows. None when they are on one
    device, or on a mesh that spans processes (the training mesh, which the embedded base's probe
    generates with): the inputs are then whole on every process, and so are the outputs.

    A decoder whose arrays are host arrays or uncommitted (`load_model`'s, a fresh init) has them
    committed to this process's first device here, in place: the first jitted call would write
    committed arrays back into it, so every program it ran would compile again on the next call."""
    leaf = jax.tree.leaves(nnx.state(decoder, nnx.Param))[0]
    concrete = isinstance(leaf, np.ndarray) or (isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer))
    if concrete and not getattr(leaf, "committed", False):  # not when tracing or given shapes only
        nnx.update(decoder, jax.device_put(nnx.state(decoder), jax.local_devices()[0]))
        leaf = jax.tree.leaves(nnx.state(decoder, nnx.Param))[0]
    where = getattr(leaf, "sharding", None)
    local = isinstance(where, NamedSharding) and where.is_fully_addressable and where.mesh.size > 1
    return where.mesh if local else None


def batch_rows(n: int, mesh=None, size: int | None = None) -> int:
    """Padded batch size for n rows: `size` when given (the batch size of a loop, so that its
    last, shorter batch runs the full batches' programs instead of compiling its own, and a
    batch of the paper's 10 questions runs 10 rows, not 16), else the next power of two (few
    compiled shapes for batches of any size); a multiple of the mesh's data-parallel size."""
    if size is not None and n > size:
        raise ValueError(f"{n} rows do not fit a batch of {size}")
    rows = int(size) if size is not None else 1 << max(0, int(n) - 1).bit_length()
    if mesh is None:
        return rows
    dp = data_parallel_size(mesh)
    return -(-rows // dp) * dp


def on_mesh(array, mesh):
    """Host array -> device array, split over the mesh's batch axes when there is a mesh."""
    if mesh is None:
        return jnp.asarray(array)
    return place(np.asarray(array), batch_sharding(mesh))


def generate(decoder: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             stop_ids: Sequence[int] | Sequence[Sequence[int]] = (),
             sampling: SamplingParams = SamplingParams(), rng: jax.Array | None = None,
             rows: int | None = None, row_ids: Sequence[int] | None = None) -> list[list[int]]:
    """Generates a continuation for each prompt (token ids); stop tokens are kept in the output.

    `stop_ids`: one list for all rows, or one list per row (e.g. EOS, `<EOK>`, source tokens).
    `row_ids`: each prompt's id for its sampling key (`row_keys`; default its index in `prompts`):
    a prompt sampled with the same rng and id draws the same text in any batch, on any device.
    Rows are split over the batch axes of the decoder's mesh (`placement`, `shard_decoder`).
    `rows`: the batch size of the caller's loop, which every batch is padded to (`batch_rows`).
    """
    out, _ = generate_samples(decoder, prompts, max_new_tokens, stop_ids=stop_ids, sampling=sampling, rng=rng,
                              rows=rows, row_ids=row_ids)
    return [o[0] for o in out]


def generate_samples(decoder: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, samples: int = 1,
                     stop_ids: Sequence[int] | Sequence[Sequence[int]] = (),
                     sampling: SamplingParams = SamplingParams(), rng: jax.Array | None = None,
                     rows: int | None = None, row_ids: Sequence[int] | None = None,
                     hidden_layer: int | None = None) -> tuple[list[list[list[int]]], np.ndarray | None]:
    """`samples` continuations of each prompt -> ([prompt][sample] token ids, stop tokens kept,
    and with `hidden_layer` that layer's state at each one's last token [prompts, samples,
    hidden] float32, else None). Each prompt is prefilled once; its cache is copied to its
    samples' rows (`repeat_rows`), which then decode together. `row_ids` (default 0, 1, ...):
    one id per sample, prompt by prompt (`row_keys`), so a sample draws the same text in any
    batch. `rows` pads the prompts as in `generate`; the decode batch is `samples` times it."""
    mesh = placement(decoder)
    if not prompts:
        raise ValueError("generate: empty batch")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    n = len(prompts)
    per_row = bool(stop_ids) and isinstance(stop_ids[0], (list, tuple, np.ndarray))
    stops = [s for s in (list(stop_ids) if per_row else [list(stop_ids)] * n) for _ in range(samples)]
    batch, length, steps = batch_rows(n, mesh, rows), bucket(max(len(p) for p in prompts)), bucket(max_new_tokens)
    state = init_state(decoder, batch, length + steps)
    ids, mask = left_pad(prompts, length, batch)
    chunk = prefill_chunk(batch, decoder.cfg.num_heads, length + steps)
    for start in range(0, length, chunk):  # whole chunks, the last one maybe shorter
        cols = slice(start, start + chunk)
        state, _ = extend(decoder, state, on_mesh(ids[:, cols], mesh), on_mesh(mask[:, cols], mesh))
    if samples > 1:
        state = repeat_rows(decoder, state, samples)
    total = batch * samples
    budget = np.zeros(total, np.int32)
    budget[:n * samples] = max_new_tokens
    rng = jax.random.key(0) if rng is None else rng
    ids = np.arange(total, dtype=np.uint32)  # padding rows: ids past the prompts'
    if row_ids is not None:
        if len(row_ids) != n * samples:
            raise ValueError(f"generate: {len(row_ids)} row ids for {n} prompts x {samples} samples")
        ids[:n * samples] = row_ids
    out = decode(decoder, state, on_mesh(stop_matrix(stops, total), mesh), on_mesh(budget, mesh), rng,
                 on_mesh(ids, mesh), max_new=steps, sampling=sampling, hidden_layer=hidden_layer)
    tokens, count = np.asarray(out.tokens), np.asarray(out.count)
    texts = [[tokens[i * samples + j, : count[i * samples + j]].tolist() for j in range(samples)] for i in range(n)]
    if hidden_layer is None:
        return texts, None
    return texts, np.asarray(out.end_hidden)[:n * samples].reshape(n, samples, -1)
