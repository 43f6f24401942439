"""Device mesh and logical-axis rules: the only module that names mesh axes.

One mesh over all devices with axes (data, fsdp, tensor). Parameters carry logical axis names
(`out_sharding` metadata, see `jaxrag.models.decoder`); `LOGICAL_RULES` maps them to mesh axes:
weights are split over `fsdp` along the hidden dimension (ZeRO-3 style) and over `tensor`
along heads / MLP / vocab (Megatron style); batches are split over `data` x `fsdp`.
A dimension that an axis does not divide (4 KV heads on 8 tensor devices, say) is replicated
over that axis instead of failing, so any mesh shape runs any model.

Generation (construct, the datastore, eval, the server) places an inference model on a mesh of
each process's own devices (`generation_mesh`): the same rules, `fsdp` 1, the model split over
`tensor` only as far as it must be to fit (`generation_tensor`), the rest of the devices on
`data`, each data replica taking its share of the rows; the processes split the work between
them (`jaxrag.runtime.shares`). The KV cache is split by rows over `data` and by KV heads over
`tensor` (`cache_sharding`).

Multi-host: `jaxrag.runtime.join.initialize_distributed()` joins the job when launched on
several hosts; each host
then builds only the batch rows its own devices hold (`host_rows` / `global_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxrag.errors import JaxragError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the leading (batch) dimension of every input array
LOGICAL_RULES = (
    ("layers", None),  # the stacked layers' leading axis: every device holds its slice of each layer
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("lora_rank", None),  # LoRA adapters: split like the weight they adapt, never along the rank
)


def mesh_shape(spec: Mapping[str, int], n_devices: int) -> tuple[int, ...]:
    """(data, fsdp, tensor) sizes from config; one axis may be -1 = the remaining devices."""
    sizes = [int(spec[a]) for a in MESH_AXES]
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise JaxragError(f"config mesh {dict(zip(MESH_AXES, sizes))}: sizes must be positive, "
                          "with at most one -1 (= the remaining devices)")
    fixed = math.prod(s for s in sizes if s != -1)
    if free:
        if n_devices % fixed:
            raise JaxragError(f"config mesh {dict(zip(MESH_AXES, sizes))}: {n_devices} devices "
                              f"are not divisible by the fixed axes' product {fixed}")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes) != n_devices:
        raise JaxragError(f"config mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} "
                          f"devices, but {n_devices} are available")
    return tuple(sizes)


def make_mesh(spec: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all hosts)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(spec, len(devices))
    # Auto axes: the model code is unannotated, XLA propagates shardings from the inputs.
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


# Generation splits the model over `tensor` until its weights take at most this share of one
# device's usable memory: the rest holds the KV cache and the activations of a batch.
GENERATION_WEIGHT_SHARE = 0.5


def generation_tensor(requested: int, n_devices: int, weight_bytes: float, device_bytes: float) -> int:
    """The model-axis size for generation on `n_devices` devices of one process: `requested` when
    set (> 0), else the smallest power of two dividing `n_devices` at which each device's slice
    of the weights fits `GENERATION_WEIGHT_SHARE` of `device_bytes` (usable bytes per device;
    0 = unknown, as on CPU, whose devices share the host's memory: 1, the model whole)."""
    if requested > 0:
        if n_devices % requested:
            raise JaxragError(f"--config.generation.tensor={requested}: must divide this process's "
                              f"{n_devices} devices")
        return int(requested)
    tensor = 1
    while device_bytes > 0 and weight_bytes / tensor > GENERATION_WEIGHT_SHARE * device_bytes \
            and n_devices % (2 * tensor) == 0:
        tensor *= 2
    return tensor


def usable_device_bytes() -> float:
    """What this process's first device lets a program use: its allocator's limit less 10% (as
    `jaxrag.plan`'s fit check); 0 where the backend reports none (CPU)."""
    return 0.9 * (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit", 0)


def generation_mesh(tensor: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp=1, tensor) mesh over `devices` (default: this process's own devices) for
    generation: the model split over `tensor`, every data replica its share of the rows."""
    devices = list(jax.local_devices() if devices is None else devices)
    return make_mesh({"data": -1, "fsdp": 1, "tensor": int(tensor)}, devices)


def cache_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """A KV-cache buffer [batch, kv_heads, slots, head_dim] (one row: [kv_heads, slots, head_dim]):
    rows over the batch axes, heads over `tensor` (replicated where an axis does not divide them)."""
    spec = P(BATCH_AXES, "tensor") if len(shape) == 4 else P("tensor")
    return NamedSharding(mesh, _fit(spec, shape, mesh))


def _fit(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Drops mesh axes that do not divide their dimension (that dimension is replicated)."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = math.prod(mesh.shape[a] for a in names)
        out.append(axes if names and dim % size == 0 else None)
    return P(*out)


def param_shardings(mesh: Mesh, module: nnx.Module) -> dict:
    """Pure-dict tree (as `nnx.to_pure_dict`) of NamedSharding for the module's parameters.

    `module` may be abstract (`nnx.eval_shape`); only shapes and axis metadata are read."""
    state = nnx.state(module, nnx.Param)
    with nnx.logical_axis_rules(LOGICAL_RULES):
        specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shapes = nnx.to_pure_dict(state)
    return jax.tree.map(lambda spec, x: NamedSharding(mesh, _fit(spec, x.shape, mesh)), specs, shapes,
                        is_leaf=lambda x: isinstance(x, P))


def place(tree, shardings):
    """Host or single-device arrays -> global arrays; each device reads only its own slice."""
    def put(x, s):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global: reshard it
            return jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])
    return jax.tree.map(put, tree, shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension over data x fsdp; other dimensions replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def host_rows(mesh: Mesh, batch_size: int) -> np.ndarray:
    """Sorted global row indices of a [batch_size, ...] batch that this host's devices hold."""
    index_map = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    rows = np.zeros(batch_size, bool)
    for index in index_map.values():
        rows[index[0]] = True
    return np.flatnonzero(rows)


def global_batch(local: Mapping[str, np.ndarray], rows: np.ndarray, mesh: Mesh,
                 batch_size: int) -> dict[str, jax.Array]:
    """Host arrays for `rows` (as `host_rows`) -> global arrays sharded over the batch axes.

    Each host passes only its own rows; no host ever materialises the full batch."""
    where = np.full(batch_size, -1)
    where[rows] = np.arange(len(rows))
    sharding = batch_sharding(mesh)

    def make(x: np.ndarray) -> jax.Array:
        def shard(index):
            return x[where[np.arange(batch_size)[index[0]]]]
        return jax.make_array_from_callback((batch_size, *x.shape[1:]), sharding, shard)

    return {k: make(np.asarray(v)) for k, v in local.items()}
