"""One Flax NNX decoder for every family in `jaxrag.models.families` (Qwen2/Qwen2.5, Llama-2
and Llama-3 RoPE, Phi-3/3.5).

The families differ only in config: q/k/v bias (Qwen2), RoPE scaling (Llama-3, Phi-3 LongRoPE),
tied embeddings, sliding window. Fused checkpoint tensors (Phi-3's `qkv_proj` / `gate_up_proj`)
are split into q/k/v and gate/up at import (and fused back at export), so one layer layout serves
all families and tensor parallelism can shard heads without cutting across a fused matrix.

Every parameter carries logical axis names (`out_sharding` metadata); `jaxrag.sharding` maps them
to mesh axes by rules.

The layers are one stacked `Block` (every parameter has a leading `layers` axis) run by
`jax.lax.scan`, for every model size: XLA compiles one layer once, and under FSDP it gathers,
uses and frees one layer's weights at a time (and reduce-scatters that layer's gradients inside
the backward loop). `remat` wraps the scanned layer in `jax.checkpoint` (see `REMAT_POLICIES`).

Generation reads every weight and cache byte once per token, so it iterates the same layer
function differently: `unstack_layers` gives each layer's weights buffers of their own (an
`nnx.List` of Blocks), the KV cache is one `LayerCache` per layer, and a Python loop runs the
layers, so XLA sees each weight and cache as an argument it reads in place. Slicing a layer out
of the stacked arrays, statically or not, makes XLA copy it before use (~3x the bytes moved per
decode step). A stacked decoder given a cache runs the same loop over such slices: correct,
with those copies.

With `lora_rank` > 0 the projections named in `lora_targets` carry LoRA adapters (float32 A, B;
`jaxrag.models.lora` adds, trains and merges them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrag.models import families
from jaxrag.models.kv_cache import KVCache, LayerCache, cached_attention
from jaxrag.models.masks import attention_mask_4d
from jaxrag.models.projection import project
from jaxrag.models.rope import RopeConfig, apply_rope, rope_cos_sin

# What the backward pass keeps of each layer (`model.remat`): everything ("none"); only the
# layer's input, recomputing the layer ("block"); or the outputs of the matmuls against weights
# too ("dots": recomputes norms, activations and attention, not the projections; see `projection.project`).
REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_only_these_names("projection"),
}
# LoRA target name -> the weight it adapts and how many leading dims of that weight are inputs.
LORA_TARGETS = {"q": ("wq", 1), "k": ("wk", 1), "v": ("wv", 1), "o": ("wo", 2),
                "gate": ("w_gate", 1), "up": ("w_up", 1), "down": ("w_down", 1)}
_MASKED_LOGIT = -1e9  # finite, so 0 * log p stays 0 in losses


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Static architecture of a decoder (hashable: jitted functions close over it)."""

    family: str  # a key of `jaxrag.models.families.FAMILIES`
    vocab_size: int  # real vocabulary (HF `vocab_size`); logits beyond it are masked
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    vocab_multiple: int = 128  # pad the vocab so it shards evenly over any mesh axis
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # master weights
    # LoRA adapters (`jaxrag.models.lora`): W x + (alpha / rank) B A x on the `lora_targets`
    # projections (names in LORA_TARGETS); rank 0 = none.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m


def resolve_dtype(name: str):
    """`auto` = bfloat16 on accelerators, float32 on CPU."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(name)


def _param(rngs: nnx.Rngs, shape, axes, dtype, init=nnx.initializers.normal(0.02)):
    # Axis names are metadata only; placement happens in `jaxrag.sharding` by rules.
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


def add_lora_params(module: nnx.Module, cfg: DecoderConfig, rngs: nnx.Rngs) -> None:
    """For each LoRA target among `module`'s weights: A [inputs..., rank] (random, scaled by
    fan-in) and B [rank, outputs...] (zeros, so an untrained adapter changes nothing)."""
    for target in cfg.lora_targets:
        name, n_in = LORA_TARGETS[target]
        if hasattr(module, name):
            w = getattr(module, name)
            shape, axes = w[...].shape, w.out_sharding
            fan_in = math.prod(shape[:n_in])
            init_a = nnx.initializers.normal(1.0 / math.sqrt(fan_in))
            # float32 like master weights, whatever the frozen base's dtype (they are small)
            setattr(module, f"{name}_lora_a", _param(rngs, (*shape[:n_in], cfg.lora_rank),
                                                     (*axes[:n_in], "lora_rank"), jnp.float32, init_a))
            setattr(module, f"{name}_lora_b", _param(rngs, (cfg.lora_rank, *shape[n_in:]),
                                                     ("lora_rank", *axes[n_in:]), jnp.float32, nnx.initializers.zeros))


class LoraDropout(NamedTuple):
    """Training's dropout on the adapters' input (as PEFT's `lora_dropout`): `rate`, and a key
    that the layer loop folds the layer index into."""
    rate: float
    key: jax.Array


def lora_delta(module: nnx.Module, name: str, x: jax.Array, n_in: int,
               dropout: LoraDropout | None = None) -> jax.Array | float:
    """(alpha / rank) B A x for weight `name` contracting x's last `n_in` dims; 0 without an adapter."""
    if not hasattr(module, f"{name}_lora_a"):
        return 0.0
    a, b = getattr(module, f"{name}_lora_a")[...], getattr(module, f"{name}_lora_b")[...]
    cfg = module.cfg
    if dropout is not None and dropout.rate > 0:
        key = jax.random.fold_in(dropout.key, list(LORA_TARGETS.values()).index((name, n_in)))
        keep = jax.random.bernoulli(key, 1.0 - dropout.rate, x.shape)
        x = jnp.where(keep, x / (1.0 - dropout.rate), 0).astype(x.dtype)
    xa = jnp.tensordot(x, a.astype(x.dtype), axes=n_in)
    return (cfg.lora_alpha / cfg.lora_rank) * jnp.tensordot(xa, b.astype(x.dtype), axes=1)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
        self.scale = _param(rngs, (dim,), ("norm",), param_dtype, nnx.initializers.ones)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in float32 and cast back before the scale, as the reference does.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def attention_implementation(backend: str, dtype, head_dim: int, sliding_window: int | None,
                             query_len: int, key_len: int) -> str:
    """`jax.nn.dot_product_attention`'s implementation: cuDNN's fused (flash) kernel on GPUs for
    bf16/fp16 with a head dim it supports (<= 128, a multiple of 8; no sliding window), which
    never materialises the [b, heads, t, s] probabilities; XLA elsewhere (CPU, TPU, float32).
    cuDNN rejects odd lengths once a masked attention is differentiated (seen on an H100:
    "Unsupported sequence length Q 1"), and a one-token decode step has no [t, s] matrix worth
    fusing, so those take XLA too. Both get the same boolean mask (cuDNN as an additive bias)."""
    fused_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    fused_shape = head_dim <= 128 and head_dim % 8 == 0 and query_len > 1 and query_len % 2 == 0 and key_len % 2 == 0
    if backend == "gpu" and fused_dtype and fused_shape and sliding_window is None:
        return "cudnn"
    return "xla"


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        e, n, kv, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = resolve_dtype(cfg.param_dtype)
        self.wq = _param(rngs, (e, n, h), ("embed", "q_heads", "head_dim"), pd)
        self.wk = _param(rngs, (e, kv, h), ("embed", "kv_heads", "head_dim"), pd)
        self.wv = _param(rngs, (e, kv, h), ("embed", "kv_heads", "head_dim"), pd)
        self.wo = _param(rngs, (n, h, e), ("q_heads", "head_dim", "embed"), pd)
        zeros = nnx.initializers.zeros
        if cfg.qkv_bias:
            self.bq = _param(rngs, (n, h), ("q_heads", "head_dim"), pd, zeros)
            self.bk = _param(rngs, (kv, h), ("kv_heads", "head_dim"), pd, zeros)
            self.bv = _param(rngs, (kv, h), ("kv_heads", "head_dim"), pd, zeros)
        if cfg.o_bias:
            self.bo = _param(rngs, (e,), ("embed",), pd, zeros)
        self.cfg = cfg
        add_lora_params(self, cfg, rngs)

    def _project(self, x, name, bias_name, dropout):
        y = project(x, getattr(self, name)[...].astype(x.dtype)) + lora_delta(self, name, x, 1, dropout)
        if hasattr(self, bias_name):
            y = y + getattr(self, bias_name)[...].astype(x.dtype)
        return y

    def __call__(self, x, cos, sin, mask, cache: LayerCache | None, cache_index, dropout=None):
        """x [b, t, e]; mask [b, 1, t, s] bool; `cache` this layer's -> ([b, t, e], updated cache or None)."""
        q = apply_rope(self._project(x, "wq", "bq", dropout), cos, sin)
        k = apply_rope(self._project(x, "wk", "bk", dropout), cos, sin)
        v = self._project(x, "wv", "bv", dropout)
        key_len = k.shape[1] if cache is None else cache.k.shape[-2]
        impl = attention_implementation(jax.default_backend(), x.dtype, self.cfg.head_dim, self.cfg.sliding_window,
                                        q.shape[1], key_len)
        if cache is not None:
            # This chunk's slots, written in place at `cache_index`: [b, t, kv, h] -> [b, kv, t, h]
            # (one row: [kv, t, h], as its cache has no row axis).
            def write(buf, new):
                new = new.transpose(0, 2, 1, 3).reshape(buf.shape[:-2] + new.shape[1:2] + new.shape[3:])
                return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (0,) * (buf.ndim - 2) + (cache_index, 0))
            cache = LayerCache(write(cache.k, k), write(cache.v, v))
            if impl == "xla":
                out = cached_attention(q, cache, mask)
            else:  # a long prefill chunk on cuDNN's fused kernel, which reads [b, s, kv, h]: one
                # transposed copy of the cache per chunk, small beside the chunk's matmuls
                read = lambda buf: buf.reshape(q.shape[0], -1, *buf.shape[-2:]).transpose(0, 2, 1, 3).astype(x.dtype)
                out = jax.nn.dot_product_attention(q, read(cache.k), read(cache.v), mask=mask, implementation=impl)
        else:
            out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)  # grouped-query aware
        y = project(out, self.wo[...].astype(x.dtype), 2) + lora_delta(self, "wo", out, 2, dropout)
        if self.cfg.o_bias:
            y = y + self.bo[...].astype(x.dtype)
        return y, cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        e, f, pd = cfg.hidden_size, cfg.intermediate_size, resolve_dtype(cfg.param_dtype)
        self.w_gate = _param(rngs, (e, f), ("embed", "mlp"), pd)
        self.w_up = _param(rngs, (e, f), ("embed", "mlp"), pd)
        self.w_down = _param(rngs, (f, e), ("mlp", "embed"), pd)
        self.cfg = cfg
        add_lora_params(self, cfg, rngs)

    def _dense(self, x, name, dropout):
        return project(x, getattr(self, name)[...].astype(x.dtype)) + lora_delta(self, name, x, 1, dropout)

    def __call__(self, x, dropout=None):
        h = jax.nn.silu(self._dense(x, "w_gate", dropout)) * self._dense(x, "w_up", dropout)
        return self._dense(h, "w_down", dropout)


class Block(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        pd = resolve_dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, mask, cache, cache_index, dropout=None):
        h, cache = self.attn(self.attn_norm(x), cos, sin, mask, cache, cache_index, dropout)
        x = x + h
        return x + self.mlp(self.mlp_norm(x), dropout), cache


class DecoderOutput(NamedTuple):
    logits: jax.Array  # [batch, seq | k, padded_vocab] float32; padded ids masked
    hidden: jax.Array | None  # [batch, seq, hidden] output of the requested layer
    cache: KVCache | None


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def layer_views(layers, num_layers: int) -> list[Block]:
    """Per-layer Blocks: the unstacked decoder's own, or slices of the stacked arrays (which XLA
    copies before use: `unstack_layers` avoids that for generation)."""
    if not isinstance(layers, Block):
        return list(layers)
    graphdef, stacked = nnx.split(layers)
    return [nnx.merge(graphdef, jax.tree.map(lambda v: v.replace(v[...][i]), stacked, is_leaf=_is_variable))
            for i in range(num_layers)]


def unstack_layers(decoder: Decoder) -> Decoder:
    """The decoder with each layer's weights in buffers of their own (an `nnx.List` of Blocks,
    axis names without `layers`), the layout generation reads in place; `stack_layers` undoes
    it. Same weights, same outputs."""
    if not isinstance(decoder.layers, Block):
        return decoder
    graphdef, state = nnx.split(decoder)
    layers_def, stacked = nnx.split(decoder.layers)
    blocks = [nnx.merge(layers_def, jax.tree.map(lambda v: v.replace(v[...][i], out_sharding=v.out_sharding[1:]),
                                                 stacked, is_leaf=_is_variable))
              for i in range(decoder.cfg.num_layers)]
    out = nnx.merge(graphdef, state)
    out.layers = nnx.List(blocks)
    return out


def stack_layers(decoder: Decoder) -> Decoder:
    """The decoder in training's layout: one stacked Block (undoes `unstack_layers`)."""
    if isinstance(decoder.layers, Block):
        return decoder
    graphdef, state = nnx.split(decoder)
    out = nnx.merge(graphdef, state)
    out.layers = stack_blocks(list(decoder.layers))
    return out


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose every parameter stacks the given blocks' along a new leading `layers`
    axis (built from per-layer blocks, so a seed gives the same weights as a layer-by-layer init)."""
    graphdef, _ = nnx.split(blocks[0])
    stack = lambda *vs: vs[0].replace(jnp.stack([v[...] for v in vs]), out_sharding=("layers", *vs[0].out_sharding))
    states = [nnx.state(b) for b in blocks]
    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))


class Decoder(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        families.family(cfg.family)  # a clear error for a family the table does not have
        pd = resolve_dtype(cfg.param_dtype)
        v, e = cfg.padded_vocab_size, cfg.hidden_size
        self.embed = _param(rngs, (v, e), ("vocab", "embed"), pd)
        self.layers = stack_blocks([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(e, cfg.rms_norm_eps, pd, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (e, v), ("embed", "vocab"), pd)
        self.cfg = cfg

    def __call__(
        self,
        input_ids: jax.Array,  # [batch, seq] int
        positions: jax.Array,  # [batch, seq] int
        key_mask: jax.Array,  # [batch, keys] bool: keys = seq, or cache length with a cache
        *,
        cache: KVCache | None = None,
        cache_index: jax.Array | int = 0,
        hidden_layer: int | None = None,
        segment_ids: jax.Array | None = None,  # [batch, seq] int: packed documents (no cache)
        branch_ids: jax.Array | None = None,  # [batch, seq] int: with segment_ids, prefix (0) and branches
        logit_positions: jax.Array | None = None,  # [batch, k] int
        remat: str = "none",  # a REMAT_POLICIES key: what training's backward pass keeps
        batch_sharding: jax.sharding.Sharding | None = None,  # of [batch, ...] activations
        lora_dropout: LoraDropout | None = None,  # training only
    ) -> DecoderOutput:
        """`hidden_layer` l returns transformers' `hidden_states[l]`: 0 = embeddings, l = output
        of decoder layer l (1-based), num_layers = after the final norm. With `segment_ids`, a
        token attends only within its own packed document; with `branch_ids` too, a branch token
        attends to its document's prefix and its own branch (`masks.attention_mask_4d`).
        `logit_positions`: logits [batch, k, v] at those positions only. A prefill needs one
        column and a loss only its targets; the head over every position is a third of a small
        model's compute and [t, vocab] floats per row on a big one. `cache` (from `init_cache`) is returned updated. `batch_sharding`
        pins each layer's input and output to it: inside the scan XLA would otherwise follow the
        FSDP-sharded weights and keep the (saved) activations unsplit over the batch."""
        cfg, dtype = self.cfg, resolve_dtype(self.cfg.dtype)
        x = jnp.take(self.embed[...], input_ids, axis=0).astype(dtype)
        cos, sin = rope_cos_sin(cfg.rope, positions, dtype)
        mask = attention_mask_4d(key_mask, input_ids.shape[1], cache_index, cfg.sliding_window, segment_ids, branch_ids)
        # A middle layer's output rides along in the carry, picked by the layer index.
        carry_hidden = hidden_layer is not None and 0 < hidden_layer < cfg.num_layers

        def pin(x):
            return x if batch_sharding is None else jax.lax.with_sharding_constraint(x, batch_sharding)

        def layer(carry, xs):
            x, hidden = carry
            i, block, kv = xs
            drop = None if lora_dropout is None else lora_dropout._replace(key=jax.random.fold_in(lora_dropout.key, i))
            x, kv = block(pin(x), cos, sin, mask, kv, cache_index, drop)
            x = pin(x)
            if carry_hidden:
                hidden = jnp.where(i + 1 == hidden_layer, x, hidden)
            return (x, hidden), kv

        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat {remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
        carry = (x, x if hidden_layer == 0 or carry_hidden else None)
        new_cache = None
        if isinstance(self.layers, Block) and cache is None:  # training, scoring: the scanned stack
            graphdef, stacked = nnx.split(self.layers)
            scanned = lambda c, xs: layer(c, (xs[0], nnx.merge(graphdef, xs[1]), None))
            if remat != "none":
                scanned = jax.checkpoint(scanned, policy=REMAT_POLICIES[remat], prevent_cse=False)
            carry, _ = jax.lax.scan(scanned, carry, (jnp.arange(cfg.num_layers), stacked))
        else:  # a cache, or the inference layout: each layer's own weights (and cache), no remat
            new_cache = []
            for i, block in enumerate(layer_views(self.layers, cfg.num_layers)):
                carry, kv = layer(carry, (i, block, None if cache is None else cache[i]))
                new_cache.append(kv)
            new_cache = None if cache is None else tuple(new_cache)
        x, hidden = carry
        if logit_positions is not None:
            x = jnp.take_along_axis(x, logit_positions[..., None], axis=1)
        x = self.final_norm(x)
        if hidden_layer == cfg.num_layers:
            hidden = x
        head = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
        logits = jnp.einsum("bte,ev->btv", x, head.astype(dtype), preferred_element_type=jnp.float32)
        real = jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size
        return DecoderOutput(jnp.where(real, logits, _MASKED_LOGIT), hidden, new_cache)


def init_cache(cfg: DecoderConfig, batch: int, length: int, dtype=None) -> KVCache:
    """Zeroed static-shape KV cache: one `LayerCache` per layer, `length` slots ([batch, kv_heads,
    length, head_dim]; one row: [kv_heads, length, head_dim], see `LayerCache`)."""
    dtype = dtype or resolve_dtype(cfg.dtype)
    shape = (cfg.num_kv_heads, length, cfg.head_dim) if batch == 1 else (batch, cfg.num_kv_heads, length, cfg.head_dim)
    return tuple(LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))
