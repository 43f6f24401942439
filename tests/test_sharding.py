"""Mesh construction and sharded == unsharded training on 8 fake CPU devices.

The multi-device checks run in a subprocess that sets XLA_FLAGS before importing jax (this
file run as a script); the rest of the suite keeps its single CPU device.
"""

import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrag import sharding
from jaxrag.runtime import join
from jaxrag.errors import JaxragError

REPO = Path(__file__).resolve().parents[1]
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]


def test_mesh_shape_fills_the_free_axis():
    assert sharding.mesh_shape({"data": -1, "fsdp": 1, "tensor": 1}, 8) == (8, 1, 1)
    assert sharding.mesh_shape({"data": 2, "fsdp": -1, "tensor": 2}, 8) == (2, 2, 2)
    assert sharding.mesh_shape({"data": 2, "fsdp": 4, "tensor": 1}, 8) == (2, 4, 1)
    for bad, n in (({"data": -1, "fsdp": -1, "tensor": 1}, 8), ({"data": 3, "fsdp": -1, "tensor": 1}, 8),
                   ({"data": 2, "fsdp": 2, "tensor": 1}, 8), ({"data": 0, "fsdp": 1, "tensor": 1}, 1)):
        with pytest.raises(JaxragError, match="config mesh"):
            sharding.mesh_shape(bad, n)


def test_single_device_mesh_and_multihost_detection():
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert list(sharding.host_rows(mesh, 4)) == [0, 1, 2, 3]
    assert not join.is_multihost_launch({})
    assert not join.is_multihost_launch({"SLURM_NTASKS": "1", "TPU_WORKER_HOSTNAMES": "localhost"})
    assert join.is_multihost_launch({"SLURM_NTASKS": "4"})
    assert join.is_multihost_launch({"TPU_WORKER_HOSTNAMES": "w0,w1"})
    assert join.is_multihost_launch({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    assert join.is_multihost_launch({"JAXRAG_DISTRIBUTED": "1"})
    assert not join.initialize_distributed({})  # single host: nothing to join


def test_on_8_fake_cpu_devices():
    # Low XLA optimisation halves compile time; sharded and reference programs use the same flags.
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 " \
            "--xla_llvm_disable_expensive_passes=true"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert "all multi-device checks passed" in result.stdout


# --- run in the 8-device subprocess ---------------------------------------------------------

def assert_trees_close(got, want, rtol=1e-5, atol=0.0):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=max(atol, rtol * 0.1 * np.abs(w).max()), err_msg=str(path))


def check_sharded_equals_unsharded(model, batch_rows):
    from jaxrag.train import losses, trainer

    def objective(forward, batch):  # stage 1 and stage 2 terms in one program
        a, b = losses.stage1_objective(forward, batch), losses.stage2_objective(0.3)(forward, batch)
        return losses.LossTerms(a.total + b.total, a.count, {**a.parts, **b.parts})

    graphdef, state = nnx.split(model.decoder)
    params = nnx.to_pure_dict(state)

    def run(mesh):
        psh = sharding.param_shardings(mesh, model.decoder)
        rows = sharding.host_rows(mesh, 8)
        batch = sharding.global_batch({k: v[rows] for k, v in batch_rows.items()}, rows, mesh, 8)
        fn = jax.jit(functools.partial(trainer.loss_and_grads, graphdef, objective),
                     out_shardings=(sharding.replicated(mesh), psh))
        placed = sharding.place(params, psh)
        terms, grads = fn(placed, batch)
        return jax.device_get(terms), grads, placed, batch

    want_terms, want_grads, _, _ = run(sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1]))
    assert float(want_terms.parts["verb_dpo"]) > 0 and float(want_terms.parts["verb"]) > 0
    for shape in MESHES:
        mesh = sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape)))
        terms, grads, placed, batch = run(mesh)
        assert_trees_close(terms, want_terms)
        assert_trees_close(jax.device_get(grads), jax.device_get(want_grads))
        # really distributed: embed [vocab 512, embed 32] is split vocab/tensor, embed/fsdp
        _, fsdp, tensor = shape
        assert {s.data.shape for s in placed["embed"].addressable_shards} == {(512 // tensor, 32 // fsdp)}
        assert batch["ids"].sharding.shard_shape((8, 40)) == (8 // (shape[0] * fsdp), 40)
        print(f"mesh {shape}: loss and gradients equal the single-device ones")


def check_accumulation(model, batch_rows):
    from jaxrag.train import losses, trainer
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, state = nnx.split(model.decoder)
    psh = sharding.param_shardings(mesh, model.decoder)
    params = sharding.place(nnx.to_pure_dict(state), psh)
    rows = sharding.host_rows(mesh, 16)
    batch = sharding.global_batch({k: v[rows] for k, v in batch_rows.items()}, rows, mesh, 16)
    out = {}
    for per_device in (0, 1):  # 16 rows in one pass; 4 micro-batches of 4 rows (1 per data shard)
        spec = trainer.TrainSpec("stage1", batch_size=16, lr=1e-3, total_steps=1, per_device_batch_size=per_device)
        accum = trainer.accumulation_steps(spec, mesh)
        fn = jax.jit(functools.partial(trainer.accumulated_grads, graphdef, losses.stage1_objective,
                                       accum=accum, mesh=mesh, params_sh=psh))
        out[accum] = jax.device_get(fn(params, batch))
    assert sorted(out) == [1, 4]
    assert_trees_close(out[4], out[1])
    print("gradient-accumulated step (4 micro-batches) equals the full-batch step")


def check_restore_on_another_mesh(model, records):
    from train_fixtures import stopped_after, train_config
    from jaxrag.train import stages
    cfg = train_config(stage1=dict(batch_size=8, epochs=2, checkpoint_every=2, keep_checkpoints=3))
    root = Path(tempfile.mkdtemp())
    mesh_a = sharding.make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
    mesh_b = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    full = stages.train_stage1(model, records, cfg, root / "a", mesh=mesh_a)  # 4 steps
    with stopped_after(2):  # as if killed after step 2's checkpoint
        stages.train_stage1(model, records, cfg, root / "b", mesh=mesh_a)
    resumed = stages.train_stage1(model, records, cfg, root / "b", mesh=mesh_b)
    got = nnx.to_pure_dict(nnx.state(resumed.decoder))
    assert got["layers"]["mlp"]["w_up"].sharding.mesh.shape == mesh_b.shape
    # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by all
    # keys), so Adam turns float noise in it into steps of ~lr: weights agree to 1e-3 x lr.
    assert_trees_close(jax.device_get(got), jax.device_get(nnx.to_pure_dict(nnx.state(full.decoder))), atol=1e-6)
    print("checkpoint from mesh (8,1,1) resumed on mesh (2,2,2): same final parameters")


def check_lora_sharded_equals_unsharded(model, records):
    """LoRA stage 1 on mesh (2, 2, 2) ends where it ends on one device; the adapters are split
    like the weights they adapt (A along embed/fsdp, B along heads/tensor), never along the rank."""
    from train_fixtures import train_config
    from jaxrag.models.lora import add_lora
    from jaxrag.train import stages
    cfg = train_config(stage1=dict(batch_size=8, epochs=1))
    cfg.model.lora = dict(rank=4, alpha=8.0, targets=["q", "o", "up"])
    cfg.model.base_dtype = "float32"
    root = Path(tempfile.mkdtemp())
    one = stages.train_stage1(model, records, cfg, root / "one",
                              mesh=sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1]))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    eight = stages.train_stage1(model, records, cfg, root / "eight", mesh=mesh)
    specs = sharding.param_shardings(mesh, add_lora(model, 4, 8.0, ["q", "o", "up"]).decoder)["layers"]
    assert specs["attn"]["wq_lora_a"].spec == P(None, "fsdp", None)
    assert specs["attn"]["wq_lora_b"].spec == P(None, None, "tensor", None)
    assert specs["mlp"]["w_up_lora_b"].spec == P(None, None, "tensor")
    got = jax.device_get(nnx.to_pure_dict(nnx.state(eight.decoder)))
    assert_trees_close(got, jax.device_get(nnx.to_pure_dict(nnx.state(one.decoder))), atol=1e-6)
    print("LoRA stage 1 on mesh (2,2,2) equals the single-device run")


def check_indivisible_axes_are_replicated(model):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 8})
    specs = sharding.param_shardings(mesh, model.decoder)
    # The stacked layers' leading axis is never split: a device holds its slice of every layer.
    assert specs["layers"]["attn"]["wk"].spec == P(None, "fsdp", None, None)  # 2 KV heads on 8 devices
    assert specs["layers"]["mlp"]["w_up"].spec == P(None, "fsdp", "tensor")  # 64 / 8
    assert specs["embed"].spec == P("tensor", "fsdp")  # padded vocab 512 / 8


def main():
    from train_fixtures import tiny_model, toy_records
    from jaxrag.train.batches import RecordData, as_records
    assert jax.device_count() == 8, jax.devices()
    model, records = tiny_model(), toy_records(16)
    data = RecordData(as_records(records, model.sources), model.tokenizer, 40, 2.0, seed=0, pairs=True)
    data.ref = np.random.default_rng(0).normal(-30, 3, size=(len(data), 2)).astype(np.float32)
    check_indivisible_axes_are_replicated(model)
    for check, args in ((check_sharded_equals_unsharded, (model, data.rows(np.array([0, 1, 2, 3, 4, 5, 6, -1]), 0))),
                        (check_accumulation, (model, data.rows(np.arange(16), 0))),
                        (check_restore_on_another_mesh, (model, records)),
                        (check_lora_sharded_equals_unsharded, (model, records))):
        start = time.perf_counter()
        check(*args)
        print(f"  ({check.__name__}: {time.perf_counter() - start:.1f}s)")
    print("all multi-device checks passed")


if __name__ == "__main__":
    main()
