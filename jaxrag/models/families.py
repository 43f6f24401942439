"""The decoder families jaxrag implements, one entry each: everything that differs between them.

One Flax decoder (`jaxrag.models.decoder`) and one Hugging Face mapping (`jaxrag.models.hf`) serve
every family; an entry says what its checkpoints hold (biases, sliding window, fused tensors),
what llama.cpp calls it, and the 7B model the paper recipe fine-tunes in it. Adding a family is
an entry here and its config file (`configs/<family>.py`); docs/extending.md has the recipe.

This module imports nothing of jaxrag, so the decoder, the HF import, the planner and the
pipeline's config can all read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# Phi-3's checkpoint layout: fused HF tensor (per layer) -> the llama-layout projections it holds,
# in row order. Import splits them, export joins them back.
FUSED_QKV_GATE_UP = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}


@dataclasses.dataclass(frozen=True)
class PaperModel:
    """The model the paper recipe (`jaxrag.pipeline.config.paper_config`) fine-tunes in a family."""

    hub: str  # Hugging Face hub name: the config's default `model.path`
    datastore_layer: int  # the policy datastore's key layer, 1-based
    tau: float  # the uniform routing threshold on p_M(<Wiki>) * p_D(<Wiki>)
    config: dict  # its published config.json, so `jaxrag.plan` needs no download
    # len(tokenizer) where it differs from config.vocab_size; the planner grows the vocab past it
    # by the SR-RAG tokens, for every model of the family
    tokenizer_len: int | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    """What one decoder family's checkpoints hold beyond what every family shares."""

    # DecoderConfig fields of the family's own, read from its HF config (the shared ones, such as
    # sizes, RoPE and tied embeddings, `hf.decoder_config` reads for every family).
    traits: Callable[[object], dict]
    paper: PaperModel
    fused: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # as FUSED_QKV_GATE_UP
    gguf: str | None = None  # llama.cpp's `general.architecture` for it (None: no GGUF import)


def _attention_bias(hf) -> dict:
    bias = bool(getattr(hf, "attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias)


FAMILIES: dict[str, Family] = {
    # Qwen2 / Qwen2.5: biases on q, k and v (not o).
    "qwen2": Family(
        traits=lambda hf: dict(qkv_bias=True),
        paper=PaperModel("Qwen/Qwen2.5-7B-Instruct", 11, 0.2, dict(
            model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=False), tokenizer_len=151665),
        gguf="qwen2",
    ),
    # Llama-2 / Llama-3: attention biases only where the config sets attention_bias.
    "llama": Family(
        traits=_attention_bias,
        paper=PaperModel("meta-llama/Llama-2-7b-chat-hf", 15, 0.1, dict(
            model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
            tie_word_embeddings=False)),
        gguf="llama",
    ),
    # Phi-3 / 3.5: a sliding window, and fused qkv / gate_up tensors. RoPE scaling factors do not
    # change shapes, so the planner's copy leaves LongRoPE's per-frequency factors at 1.
    "phi3": Family(
        traits=lambda hf: dict(sliding_window=getattr(hf, "sliding_window", None)),
        paper=PaperModel("microsoft/Phi-3.5-mini-instruct", 15, 0.2, dict(
            model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072,
            original_max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=262143,
            rope_scaling=dict(type="longrope", short_factor=[1.0] * 48, long_factor=[1.0] * 48),
            tie_word_embeddings=False), tokenizer_len=32011),
        fused=FUSED_QKV_GATE_UP,
        gguf="phi3",
    ),
}


def family(name: str) -> Family:
    """The entry for `name`, or a ValueError naming the supported families."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]
