"""A Decoder from a params dict and back: what loading, saving, LoRA and export share."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxrag.models.decoder import Decoder, DecoderConfig, stack_layers


def build_decoder(cfg: DecoderConfig, params: dict) -> Decoder:
    """A Decoder holding `params` (nested numpy/jax arrays), without a random init pass."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
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
