"""The compiled decode step reads each weight and KV-cache byte once: XLA's bytes accessed stay
within 1.3x its arguments' bytes, and its HLO neither copies a weight or cache buffer nor updates
a cache that is not aliased to its input (float32 on CPU, a tiny Qwen2; `benchmarks.decode`
reports the same ratio at the benchmark's shape). So does the slot pool's step (`decode.slots`),
whose rows write one shared ring column: a `dynamic_update_slice`, no scatter."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from benchmarks.decode import _abstract, compile_decode_step, step_bytes
from jaxrag.decode import sampler, slots
from jaxrag.models.decoder import Decoder, DecoderConfig, unstack_layers

CFG = DecoderConfig(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=64, qkv_bias=True)
SLOTS = 128
MAX_RATIO = 1.3


def _decoder(unstacked: bool) -> Decoder:
    build = lambda: Decoder(CFG, nnx.Rngs(0))
    return nnx.eval_shape(lambda: unstack_layers(build()) if unstacked else build())  # shapes only


def _core(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def hlo_problems(compiled, args) -> list[str]:
    """Instructions of the compiled step that copy a weight or cache buffer (a copy, slice or
    transpose whose result has a weight's or a cache's shape), and cache parameters whose
    buffer is not aliased to an output (updated in a new buffer)."""
    params, state = args[0], args[1]
    cache = state.state.cache if hasattr(state, "stage") else state.cache  # a slot pool or a decode state
    big = {_core(x.shape) for x in jax.tree.leaves(params) if len(_core(x.shape)) >= 2}
    big |= {_core(x.shape) for x in jax.tree.leaves(cache)}
    text = compiled.as_text()
    problems = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* (copy|slice|dynamic-slice|transpose|scatter)\(", line)
        if m and _core(int(d) for d in m.group(2).split(",") if d) in big:
            problems.append(f"{m.group(3)} {m.group(1)} [{m.group(2)}]")
    header = text.splitlines()[0]  # HloModule ..., input_output_alias={ {out}: (param, {}, may-alias), ... }
    aliased = {int(p) for p in re.findall(r"\{[\d,]*\}: \((\d+), \{[\d,]*\}, (?:may|must)-alias\)", header)}
    caches = re.findall(r"%(st_(?:state_)?cache\S*) = \S+ parameter\((\d+)\)", text)
    if len(caches) != 2 * CFG.num_layers:
        problems.append(f"expected {2 * CFG.num_layers} cache parameters, found {len(caches)}")
    problems += [f"cache parameter {name} not aliased to an output" for name, i in caches if int(i) not in aliased]
    return problems


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_step_reads_weights_and_cache_once(batch):
    decoder = _decoder(unstacked=True)
    compiled, args = compile_decode_step(decoder, batch, SLOTS)
    assert hlo_problems(compiled, args) == []
    ratio = step_bytes(decoder, batch, SLOTS)["bytes_ratio"]
    assert ratio <= MAX_RATIO, f"decode step moves {ratio}x its arguments' bytes"


def test_slot_pool_step_reads_weights_and_cache_once():
    """The pool's step writes its column in place (aliased, no scatter or copy of a cache) and moves
    at most 1.3x its arguments' bytes, sampling and phase program included."""
    decoder = _decoder(unstacked=True)
    compiled, args = compile_decode_step(decoder, 8, SLOTS, pool=True)
    assert hlo_problems(compiled, args) == []
    assert "dynamic-update-slice" in compiled.as_text()
    ratio = step_bytes(decoder, 8, SLOTS, pool=True)["bytes_ratio"]
    assert ratio <= MAX_RATIO, f"the slot pool's step moves {ratio}x its arguments' bytes"


def test_a_write_column_per_row_is_caught_as_a_scatter():
    """The check can fail: a pool whose rows each write their own column (a batch-1 extend mapped
    over the slots) updates every cache with a scatter."""
    decoder = _decoder(unstacked=True)
    graphdef, params = nnx.split(decoder)
    pool = jax.eval_shape(lambda: slots.init_pool(decoder, 8, SLOTS))

    def step(p, st, stops, tail):
        rows = sampler.DecodeState(st.state.cache, st.state.key_mask[:, None], st.state.next_pos[:, None], st.count,
                                   st.state.logits[:, None])
        extend = lambda row, i, m: sampler._extend(nnx.merge(graphdef, p), row, i, m)[0]  # noqa: E731
        new = jax.vmap(extend)(rows, jnp.zeros((8, 1, 1), jnp.int32), jnp.ones((8, 1, 1), bool))
        return st._replace(state=st.state._replace(cache=new.cache))

    args = (_abstract(params), pool, jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
    problems = hlo_problems(jax.jit(step, donate_argnums=1).lower(*args).compile(), args)
    assert len([p for p in problems if p.startswith("scatter")]) == 2 * CFG.num_layers, problems


def test_stacked_layers_are_caught_copying_weights():
    """The check can fail: slicing layers out of the stacked arrays copies every weight."""
    decoder = _decoder(unstacked=False)
    compiled, args = compile_decode_step(decoder, 1, SLOTS)
    problems = hlo_problems(compiled, args)
    assert any(p.startswith(("slice", "copy", "dynamic-slice")) for p in problems), problems
    assert step_bytes(decoder, 1, SLOTS)["bytes_ratio"] > MAX_RATIO
