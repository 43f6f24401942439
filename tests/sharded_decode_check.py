"""Run in a subprocess with 8 fake CPU devices (see test_decode_sharded.py): greedy generation
on meshes (8,1,1), (2,2,2) and (1,2,4), in training's stacked layout and in the inference
layout (`for_inference`), and routed inference on (2,2,2), equal the single-device results; the
generation placement with a model axis of 2 (data 4 x tensor 2) compiles a decode step in which
every device holds half of each weight matrix split over heads / MLP / vocab and half of the
cache's KV heads, and generates what one device does; the server's engine on that placement
answers what `SRRAG.ask` answers on one device, and compiles nothing once it serves."""

import os
import sys

# Every program here is compared with another of this process only, so all compile with the
# miniature pipeline's lower optimization level (tests/pipeline_fixtures.py: MINI_XLA_FLAGS).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

import jaxrag  # noqa: E402
from jaxrag.decode.routing import RouteConfig, route  # noqa: E402
from jaxrag.models.model import add_special_tokens, for_inference  # noqa: E402
from jaxrag.policies.srrag import srrag_policy  # noqa: E402
from flax import nnx  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from jaxrag.decode import engine, sampler, slots  # noqa: E402
from jaxrag.decode.sampler import generate, place_for_generation, shard_decoder  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxrag.sharding import make_mesh  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [99, 3, 120]]

if __name__ == "__main__":
    assert len(jax.devices()) == 8
    model = jaxrag.load_model(sys.argv[1])
    want = generate(model.decoder, PROMPTS, 10)
    for shape in ((8, 1, 1), (2, 2, 2), (1, 2, 4)):
        mesh = make_mesh(dict(zip(("data", "fsdp", "tensor"), shape)))
        for decoder in (model.decoder, for_inference(model).decoder):
            got = generate(shard_decoder(decoder, mesh), PROMPTS, 10)
            assert got == want, (shape, got, want)
    print("sharded generation ok")
    # The generation engine's pool (construct's GenRead), rows over the data axis, heads over tensor.
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    got = engine.generate(shard_decoder(for_inference(model).decoder, mesh), PROMPTS * 3, 10, slots=2)
    assert got == want * 3, got
    print("sharded engine ok")

    # Routed inference: Self and Wiki rows in one batch, split over the mesh.
    routed_model = add_special_tokens(model)
    cfg = RouteConfig(hidden_layer=2, max_verbal_tokens=5, max_knowledge_tokens=64, max_answer_tokens=4)
    policy = srrag_policy(lambda h: (np.arange(len(h))[:, None] % 2).repeat(3, axis=1), tau=0.0)
    questions = ["who wrote the novel?", "where is the fox?", "who is lazy?"]
    retrieve = lambda qs: [[f"About {q}."] for q in qs]  # noqa: E731
    want = route(routed_model, questions, policy, retrieve, cfg)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = dataclasses.replace(routed_model, decoder=shard_decoder(routed_model.decoder, mesh))
    got = route(sharded, questions, policy, retrieve, cfg)
    assert [(r.source, r.knowledge, r.answer) for r in got] == [(r.source, r.knowledge, r.answer) for r in want]
    assert {r.source for r in got} == {"wiki", "self"}
    print("sharded routing ok")

    # Generation's placement, model axis 2: the compiled decode step's own input shardings.
    decoder, where = place_for_generation(for_inference(model).decoder, tensor=2)
    assert where == {"processes": 1, "devices_per_process": 8, "data": 4, "tensor": 2}, where
    state = sampler.init_state(decoder, 8, 32)
    graphdef, params = nnx.split(decoder)

    def step(p, st, ids, mask):
        return sampler._extend(nnx.merge(graphdef, p), st, ids, mask)[0]

    ids = sampler.on_mesh(np.ones((8, 1), np.int32), sampler.placement(decoder))
    compiled = jax.jit(step, donate_argnums=1).lower(params, state, ids, ids > 0).compile()
    (p_sh, st_sh, _, _), _ = compiled.input_shardings
    halves = {}
    for (path, x), sh in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(p_sh)):
        name = jax.tree_util.keystr(path)
        halves[name] = sh.shard_shape(x.shape) != x.shape
        if halves[name]:  # split over the model axis only: exactly half of it on each device
            assert np.prod(sh.shard_shape(x.shape)) * 2 == x.size, (name, x.shape, sh)
    for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        split = [n for n, h in halves.items() if f"'{w}'" in n]
        assert split and all(halves[n] for n in split), (w, {n: halves[n] for n in split})
    cache = state.cache[0].k
    kv_sh = jax.tree.leaves(st_sh)[0]
    assert cache.shape[:2] == (8, 2) and kv_sh.shard_shape(cache.shape) == (2, 1, *cache.shape[2:]), \
        (cache.shape, kv_sh)
    assert generate(decoder, PROMPTS, 10) == generate(model.decoder, PROMPTS, 10)
    print("generation placement ok")

    # The server's slot pool on that placement: slots over data, heads over tensor; a prompt
    # admitted to a slot and decoded there gives what one device gives.
    def serve_one(dec):
        pool, parking = slots.init_pool(dec, 8, 32), slots.init_parking(dec, 8, 16)
        ids, mask = sampler.left_pad([PROMPTS[1][:-1]], 16, 1)
        parking, _, _ = slots.admit(dec, parking, jnp.array([5]), jnp.asarray(ids), jnp.asarray(mask), length=32,
                                    hidden_layer=1)
        pool = slots.enter(dec, pool, parking, jnp.array([5]), jnp.array([5]), jnp.array([PROMPTS[1][-1]]),
                           jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 0), bool), jnp.array([slots.ANSWER]),
                           jnp.array([[1, 10]]), jnp.zeros(1), jnp.ones(1), slots.stage_keys(jax.random.key(0), jnp.zeros(1, jnp.uint32)))
        none = jnp.array([sampler.NO_TOKEN])
        pool, tokens, _, _ = slots.steps(dec, pool, jnp.zeros(8, bool), none, none, jnp.array([0, 0]), max_steps=10)
        return pool, np.asarray(tokens)[5].tolist()

    pool, got = serve_one(decoder)
    assert got == serve_one(for_inference(model).decoder)[1] == generate(model.decoder, PROMPTS[1:2], 10)[0], got
    k = pool.state.cache[0].k
    assert k.sharding.shard_shape(k.shape)[:2] == (2, 1), k.sharding
    print("slot pool placement ok")

    # The server's engine (`jaxrag.serve`) with the model placed on data 4 x tensor 2: each
    # answer is what one device routes, and nothing compiles once it serves.
    import tempfile
    import threading
    from pathlib import Path

    from benchmarks.serve_exports import tiny_export, tiny_questions
    from jaxrag.serve import SRRAG
    from jaxrag.serve.engine import Engine
    from jaxrag.serve.jobs import Job, Options

    export = tiny_export(Path(tempfile.mkdtemp()))
    system = SRRAG.load(export, tensor=2)
    engine = Engine(system, slots=4, max_queue=16, max_question_tokens=64)
    engine.warm_up()
    engine.start()
    questions, answers, all_done = tiny_questions(6, 5), {}, threading.Event()

    def listener(i):
        def heard(kind, value):
            if kind in ("done", "error"):
                answers[i] = (kind, value)
                if len(answers) == len(questions):
                    all_done.set()
        return heard

    engine.submit([Job(q, engine.prompt(q), Options(), listener(i)) for i, q in enumerate(questions)])
    assert all_done.wait(600)
    engine.stop()
    assert engine.metrics.counted["serving"] == 0, engine.metrics.counted
    k = engine.device.pool.state.cache[0].k
    assert k.sharding.spec == P("data", "tensor"), k.sharding
    alone = dataclasses.replace(system, model=jaxrag.load_model(export, inference=True)).ask(questions)
    assert all(kind == "done" for kind, _ in answers.values()), answers
    assert [(answers[i][1].routed.source, answers[i][1].routed.answer) for i in range(len(questions))] == \
        [(r.source, r.answer) for r in alone]
    print("served placement ok")
