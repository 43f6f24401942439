"""A Decoder from a params dict and back: what loading, saving, LoRA and export share."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxrag.models.decoder import Decoder, DecoderConfig, stack_layers


@functools.lru_cache(maxsize=8)
def _abstract(cfg: DecoderConfig) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))


def abstract_decoder(cfg: DecoderConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of shapes) of a Decoder, the state a fresh copy the caller may fill in
    place. Traced once per config: a 30-layer model's abstract init is seconds of Python, and a
    run loads several models of one config (eval: five)."""
    graphdef, state = _abstract(cfg)
    return graphdef, jax.tree.map(lambda x: x, state)


def build_decoder(cfg: DecoderConfig, params: dict) -> Decoder:
    """A Decoder holding `params` (nested numpy/jax arrays), without a random init pass."""
    graphdef, state = abstract_decoder(cfg)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def host_params(decoder: Decoder) -> dict:
    """Params as host numpy arrays (training's stacked layout), gathered from every process when
    sharded across hosts."""
    def gather(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return jax.tree.map(gather, nnx.to_pure_dict(nnx.state(stack_layers(decoder))))
