"""Rotary position embeddings: default, linear, Llama-3 and Phi-3 LongRoPE ("su") scaling.

Frequencies are computed once in numpy from the (static) config, exactly as transformers'
`modeling_rope_utils` does, so logits match the PyTorch reference.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Static RoPE settings (hashable, so a jitted function can close over them)."""

    theta: float = 10000.0
    rotary_dim: int = 0  # head_dim * partial_rotary_factor; set by the decoder config
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, longrope
    max_position_embeddings: int = 0
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    attention_factor: float | None = None  # longrope: cos/sin scale


def _base_inv_freq(cfg: RopeConfig) -> np.ndarray:
    exponents = np.arange(0, cfg.rotary_dim, 2, dtype=np.int64).astype(np.float32) / cfg.rotary_dim
    return (1.0 / (cfg.theta**exponents)).astype(np.float32)


def _llama3_inv_freq(cfg: RopeConfig) -> np.ndarray:
    inv_freq = _base_inv_freq(cfg)
    old_len = cfg.original_max_position_embeddings
    low_wavelen = old_len / cfg.low_freq_factor
    high_wavelen = old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _longrope_attention_factor(cfg: RopeConfig) -> float:
    if cfg.attention_factor is not None:
        return cfg.attention_factor
    # Phi-3 derives the factor from the context extension ratio, not from `factor`.
    factor = cfg.max_position_embeddings / cfg.original_max_position_embeddings
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(cfg.original_max_position_embeddings))


def rope_frequencies(cfg: RopeConfig) -> tuple[np.ndarray, np.ndarray, float]:
    """Returns (inv_freq_short, inv_freq_long, attention_factor), each inv_freq [rotary_dim // 2].

    Only LongRoPE has distinct short/long frequencies; it switches to the long ones when the
    longest position in the batch exceeds the original context (as transformers does).
    """
    if cfg.rope_type == "default":
        inv = _base_inv_freq(cfg)
        return inv, inv, 1.0
    if cfg.rope_type == "linear":
        inv = _base_inv_freq(cfg) / cfg.factor
        return inv, inv, 1.0
    if cfg.rope_type == "llama3":
        inv = _llama3_inv_freq(cfg)
        return inv, inv, 1.0
    if cfg.rope_type == "longrope":
        base = _base_inv_freq(cfg)
        short = base / np.asarray(cfg.short_factor, np.float32)
        long = base / np.asarray(cfg.long_factor, np.float32)
        return short.astype(np.float32), long.astype(np.float32), _longrope_attention_factor(cfg)
    raise ValueError(f"unsupported rope type {cfg.rope_type!r}; supported: {ROPE_TYPES}")


def rope_cos_sin(cfg: RopeConfig, positions: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions [batch, seq] int -> (cos, sin) [batch, seq, rotary_dim] in `dtype`."""
    short, long, scale = rope_frequencies(cfg)
    inv_freq = jnp.asarray(short)
    if cfg.rope_type == "longrope":
        use_long = jnp.max(positions) + 1 > cfg.original_max_position_embeddings
        inv_freq = jnp.where(use_long, jnp.asarray(long), inv_freq)
    freqs = positions[..., None].astype(jnp.float32) * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [batch, seq, heads, head_dim]; cos/sin [batch, seq, rotary_dim] (rotate-half layout)."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
