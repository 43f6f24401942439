"""The compiled decode step reads each weight and KV-cache byte once: XLA's bytes accessed stay
within 1.3x its arguments' bytes, and its HLO neither copies a weight or cache buffer nor updates
a cache that is not aliased to its input (float32 on CPU, a tiny Qwen2; `benchmarks.decode`
reports the same ratio at the benchmark's shape)."""

import re

import jax
import pytest
from flax import nnx

from benchmarks.decode import compile_decode_step, step_bytes
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
    big = {_core(x.shape) for x in jax.tree.leaves(params) if len(_core(x.shape)) >= 2}
    big |= {_core(x.shape) for x in jax.tree.leaves(state.cache)}
    text = compiled.as_text()
    problems = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* (copy|slice|dynamic-slice|transpose)\(", line)
        if m and _core(int(d) for d in m.group(2).split(",") if d) in big:
            problems.append(f"{m.group(3)} {m.group(1)} [{m.group(2)}]")
    header = text.splitlines()[0]  # HloModule ..., input_output_alias={ {out}: (param, {}, may-alias), ... }
    aliased = {int(p) for p in re.findall(r"\{[\d,]*\}: \((\d+), \{[\d,]*\}, (?:may|must)-alias\)", header)}
    caches = re.findall(r"%(st_cache\S*) = \S+ parameter\((\d+)\)", text)
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


def test_stacked_layers_are_caught_copying_weights():
    """The check can fail: slicing layers out of the stacked arrays copies every weight."""
    decoder = _decoder(unstacked=False)
    compiled, args = compile_decode_step(decoder, 1, SLOTS)
    problems = hlo_problems(compiled, args)
    assert any(p.startswith(("slice", "copy", "dynamic-slice")) for p in problems), problems
    assert step_bytes(decoder, 1, SLOTS)["bytes_ratio"] > MAX_RATIO
