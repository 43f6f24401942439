"""Run in a subprocess with 8 fake CPU devices (see test_decode_sharded.py): greedy generation
on meshes (8,1,1), (2,2,2) and (1,2,4), in training's stacked layout and in the inference
layout (`for_inference`), and routed inference on (2,2,2), equal the single-device results."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

import jaxrag  # noqa: E402
from jaxrag.decode.routing import RouteConfig, route  # noqa: E402
from jaxrag.models.model import add_special_tokens, for_inference  # noqa: E402
from jaxrag.policies.srrag import srrag_policy  # noqa: E402
from jaxrag.decode.sampler import generate, shard_decoder  # noqa: E402
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
