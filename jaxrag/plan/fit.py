"""Sizing the pipeline's programs: compile, read XLA's memory analysis, estimate time, and the
fit check the pipeline runs before its decoder stages (`check_fit`). The CLI is `jaxrag.plan`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from ml_collections import ConfigDict

from jaxrag.errors import JaxragError

# Dense bf16 peak FLOP/s, HBM bandwidth (bytes/s) and memory (GB) per device (the vendors' figures).
ACCELERATORS = {
    "h100": (989e12, 3.35e12, 80.0),
    "a100": (312e12, 2.0e12, 80.0),
    "v4": (275e12, 1.2e12, 32.0),
    "v5e": (197e12, 0.82e12, 16.0),
    "v5p": (459e12, 2.76e12, 95.0),
}
# Devices per host, one process each: 8-GPU servers; TPU VMs of 4 chips (v4-8, a v5litepod-16's
# 4 hosts, v5p). A process places the generation model on its own devices.
DEVICES_PER_HOST = {"h100": 8, "a100": 8, "v4": 4, "v5e": 4, "v5p": 4}
DEFAULT_FRACTION, DEFAULT_MFU, DEFAULT_HEADROOM = 0.75, 0.5, 0.10
# Compiling for fake CPU devices, XLA's CPU backend runs bf16 matmuls in float32 and its
# while-loop invariant code motion hoists a float32 copy of every layer's bf16 weights out of the
# layer scan (~28 GB for a 7B model) that an accelerator, with native bf16 matmuls, never makes.
# The plan compiles without that pass (`python -m jaxrag.plan` sets it before jax starts). It never
# runs what it compiles, so LLVM's optimizations of the CPU code are skipped too: the peaks, FLOPs
# and bytes it reads are the HLO's, the same at any backend optimization level, and each program
# compiles in about two thirds of the time.
PLAN_XLA_FLAGS = "--xla_disable_hlo_passes=while-loop-invariant-code-motion --xla_backend_optimization_level=0"


@dataclasses.dataclass
class Row:
    name: str
    peak_gb: float
    flops: float
    tokens: int
    calls: int
    hours: float | None
    compile_s: float
    fits: bool
    fixes: tuple[str, ...]
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)  # what one call runs on
    per_process: bool = False  # a generation program: on one process's devices, calls shared by the processes


@dataclasses.dataclass
class Generation:
    """Where each process places the generation model (`sharding.generation_mesh`)."""
    processes: int
    devices_per_process: int
    data: int
    tensor: int
    weight_gb: float  # the inference model's weights, whole
    mesh: object = dataclasses.field(repr=False, compare=False)  # over the first process's devices

    def summary(self) -> dict:
        """Its fields but the mesh (the plan's JSON)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mesh"}


def plan_devices(n: int):
    """n real accelerators when there are that many, else n (fake) CPU devices."""
    import jax  # not on import: see `measure`

    if jax.default_backend() != "cpu" and jax.device_count() >= n:
        return jax.devices()[:n]
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise JaxragError(f"--devices={n}: only {len(cpus)} CPU devices; run `python -m jaxrag.plan` "
                          "itself (it sets XLA_FLAGS=--xla_force_host_platform_device_count before jax starts)")
    return cpus[:n]


def devices_per_process(n_devices: int, per_host: int) -> int:
    """Devices of one process when `n_devices` are hosts of `per_host` (fewer: one host)."""
    per_process = min(per_host, n_devices)
    if n_devices % per_process:
        raise JaxragError(f"--devices={n_devices}: not a whole number of hosts of {per_process} devices "
                          "(--devices-per-host)")
    return per_process


def generation_placement(cfg, process_devices, processes: int, device_bytes: float) -> Generation:
    """The run's generation placement: each of `processes` processes places the inference model
    on a mesh of its own devices (`process_devices` stand for any one's), split over `tensor` as
    `sharding.generation_tensor` picks it for the model's weights and `device_bytes` usable per
    device (0: CPU devices, which share the host's memory: the model whole)."""
    from jaxrag import sharding  # not on import: see `measure`
    from jaxrag.plan.programs import inference_weight_bytes, plan_decoder_config  # as `measure`'s

    weights = inference_weight_bytes(plan_decoder_config(cfg))
    tensor = sharding.generation_tensor(int(cfg.generation.tensor), len(process_devices), weights, device_bytes)
    mesh = sharding.generation_mesh(tensor, process_devices)
    return Generation(processes, len(process_devices), mesh.shape["data"], tensor, weights / 1e9, mesh)


def measure(cfg, devices, accelerator: str, usable_gb: float, headroom: float, mfu: float,
            log=print, only: tuple[str, ...] = (), stand_in: bool = False,
            generation: Generation | None = None) -> list[Row]:
    """Compiles every program (or those named in `only`) and sizes it: training's on a mesh over
    `devices` (the config's mesh shape), generation's on one process's generation mesh
    (`generation`; default: `DEVICES_PER_HOST` of the accelerator to a process, the tensor split
    for its usable memory). `stand_in`: `devices` are CPU devices standing in for `accelerator`,
    so the float32 weight copies only XLA-CPU makes are left out (`Program.cpu_upcast_bytes`)."""
    # jax loads here, not on import: `python -m jaxrag.plan` reads PLAN_XLA_FLAGS before jax starts
    from jaxrag import sharding
    from jaxrag.plan.programs import pipeline_programs

    peak_flops, bandwidth, _ = ACCELERATORS[accelerator]
    rows, limit = [], usable_gb * (1 - headroom)
    if generation is None:
        on_device = stand_in or devices[0].platform != "cpu"
        per_process = devices_per_process(len(devices), DEVICES_PER_HOST[accelerator])
        generation = generation_placement(cfg, devices[:per_process], len(devices) // per_process,
                                          limit * 1e9 if on_device else 0)
    programs = [p for p in pipeline_programs(cfg, sharding.make_mesh(cfg.mesh, devices), generation.mesh)
                if not only or p.name in only]
    for p in programs:
        start = time.perf_counter()
        m = p.lower().compile().memory_analysis()
        seconds = time.perf_counter() - start
        temp = m.temp_size_in_bytes - (p.cpu_upcast_bytes if stand_in else 0)
        peak = (temp + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes) / 1e9
        per_call = max(p.flops / (peak_flops * p.mesh.size * mfu), p.read_bytes / (bandwidth * mfu))
        calls = p.calls / generation.processes if p.per_process else p.calls  # each process its share
        hours = calls * per_call / 3600 if p.calls else None
        rows.append(Row(p.name, peak, p.flops, p.tokens, p.calls, hours, seconds, peak <= limit, p.fixes,
                        dict(p.mesh.shape), p.per_process))
        log(f"  compiled {p.name}: {peak:.1f} GB per device ({seconds:.0f}s)")
    return rows


def failures(rows: list[Row], usable_gb: float, headroom: float, n_devices: int) -> list[str]:
    """One line per program that does not fit, naming what would make it fit: a generation
    program runs on one process's devices, which more processes do not change."""
    limit = usable_gb * (1 - headroom)
    lines = []
    for r in rows:
        if not r.fits:
            more = [] if r.per_process else [f"--devices={2 * n_devices} (more FSDP devices)"]
            where = f" (data {r.mesh['data']} x tensor {r.mesh['tensor']})" if r.per_process else ""
            lines.append(f"{r.name}: {r.peak_gb:.1f} GB per device{where} > {limit:.1f} GB usable; try "
                         + ", ".join([*r.fixes, *more]))
    return lines


def table(rows: list[Row]) -> str:
    lines = ["| program | mesh (data x fsdp x tensor) | peak GB / device | TFLOPs / call | tokens / call | calls | "
             "est. hours | compile s | fits |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        hours = f"{r.hours:.2f}" if r.hours is not None else "-"
        mesh = " x ".join(str(r.mesh.get(a, "?")) for a in ("data", "fsdp", "tensor"))
        lines.append(f"| {r.name} | {mesh}{' per process' if r.per_process else ''} | {r.peak_gb:.1f} "
                     f"| {r.flops / 1e12:.1f} | {r.tokens} | {r.calls or '-'} | {hours} | {r.compile_s:.0f} "
                     f"| {'yes' if r.fits else 'NO'} |")
    return "\n".join(lines)


def accelerator_of(device) -> str:
    """The `ACCELERATORS` entry whose peak and bandwidth stand for this device (H100 otherwise)."""
    kind = device.device_kind.lower()
    if "a100" in kind:
        return "a100"
    if "v5 lite" in kind or "v5e" in kind:
        return "v5e"
    return "v5p" if "v5" in kind else "v4" if "v4" in kind else "h100"


def host_memory_gb() -> float:
    """Physical memory of this host (what a CPU backend allocates from)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9


def fit_key(cfg) -> str:
    """What `check_fit`'s verdict depends on, hashed: the config (less `pipeline`, which decides
    only what runs), this machine's devices and memory, jax's version and jaxrag's own source."""
    import jax  # not on import: see `measure`

    package = Path(__file__).resolve().parent.parent
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(str(path.relative_to(package)).encode() + path.read_bytes())
    fields = {k: v for k, v in cfg.to_dict().items() if k != "pipeline"}
    devices = [d.device_kind for d in jax.devices()]
    what = [fields, devices, jax.default_backend(), round(host_memory_gb(), 1), jax.__version__, source.hexdigest()]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def device_memory_gb() -> float:
    """The allocator limit of this process's first device, GB (0.0 where the backend reports none).
    A device of this process: JAX reads the memory statistics of addressable devices only, so on
    any process but 0 `jax.devices()[0]` raises."""
    import jax  # not on import: see `measure`

    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit", 0) / 1e9


def check_fit(cfg) -> None:
    """The pipeline's preflight: compiles the programs on the devices it will run on (training's
    on every device, generation's on this process's own, placed as the run places them) and
    raises one line per program that would run out of memory. Accelerators: against their
    allocator limit. CPU: against host memory, at the dtypes the CPU runs (`auto` = float32)."""
    import jax  # not on import: see `measure`

    from jaxrag import sharding  # imports jax: as above

    devices = jax.devices()
    if jax.default_backend() == "cpu":
        cfg = ConfigDict(cfg.to_dict())
        for field in ("dtype", "base_dtype"):
            if cfg.model.get(field) == "auto":
                cfg.model[field] = "float32"
        usable, where = host_memory_gb(), "host memory"
    else:
        usable, where = device_memory_gb(), "device memory"
        if not usable:
            return
    # the split `sampler.place_for_generation` will choose: the same bytes per device (0 on CPU)
    generation = generation_placement(cfg, jax.local_devices(), jax.process_count(), sharding.usable_device_bytes())
    rows = measure(cfg, devices, accelerator_of(devices[0]), usable, DEFAULT_HEADROOM, DEFAULT_MFU, log=lambda *_: None,
                   generation=generation)
    if bad := failures(rows, usable, DEFAULT_HEADROOM, len(devices)):
        raise JaxragError(f"these programs would run out of {where} (jaxrag.plan):\n  " + "\n  ".join(bad))
