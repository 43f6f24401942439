"""The plan, run for real: each heavy program of the pipeline on the devices present.

    python -m benchmarks.fit --config configs/qwen.py [--config.x=y ...] --json OUT [--only NAME,NAME] [--steps 2]

`python -m jaxrag.plan` sizes the programs from XLA's analysis of an AOT compile; this runs them.
Every program of `jaxrag.plan.programs` (or those in `--only`) is compiled on the real devices
(the config's mesh over all of them) and called on random weights and inputs of its real shapes
and dtypes (nothing downloaded): one warm-up call, then `--steps` timed calls, fresh arguments
for each (a train step donates its state). Each program runs in a process of its own, so the
allocator's peak (`memory_stats()["peak_bytes_in_use"]`, the most any device held: arguments,
temporaries and outputs) is that program's alone. Per program: XLA's estimate on this backend,
the measured peak, the allocator's limit, seconds per call (median), tokens/s, the MFU by
the model's FLOP count (the plan's) against the device's dense bf16 peak (`jaxrag.plan.fit.ACCELERATORS`),
and the bytes one device reads per call (the plan's: the weights, and a decode step's KV cache)
over those seconds, as TB/s and as a fraction of the device's HBM bandwidth (a decode step is
bound by it: `hbm_fraction` is how close it comes).
A program that runs out of device memory is recorded as such. CPUs have no allocator statistics
(measured peak null); there it checks that the programs run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

from jaxrag.errors import JaxragError, run
from jaxrag.pipeline.cli import ConfigFlag

_CONFIG = ConfigFlag()
_JSON = flags.DEFINE_string("json", None, "write the result here (JSON)", required=True)
_ONLY = flags.DEFINE_list("only", [], "programs to run (names as jaxrag.plan prints them); default all")
_STEPS = flags.DEFINE_integer("steps", 2, "timed calls per program (after one warm-up)", lower_bound=1)


def materialize(args, seed: int):
    """Concrete arrays for abstract arguments, made on their devices with their shardings:
    floats 0.02 sin(a phase per element, leaf and seed) in their own dtype, masks all true
    (every position computed), integer ids and positions 0 (valid for any vocabulary or cache)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(args)

    def make():  # one program for all (a jit per leaf compiles dozens); sin, not threefry: cheap to compile
        out = []
        for i, x in enumerate(leaves):
            if jnp.issubdtype(x.dtype, jnp.floating):
                phase = jax.lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1) * 0.618 + seed + i
                for axis in range(x.ndim - 1):
                    phase = phase + jax.lax.broadcasted_iota(jnp.float32, x.shape, axis) * (1.414 + axis)
                out.append((0.02 * jnp.sin(phase)).astype(x.dtype))
            else:
                out.append(jnp.ones(x.shape, bool) if x.dtype == jnp.bool_ else jnp.zeros(x.shape, x.dtype))
        return out

    return jax.tree.unflatten(treedef, jax.jit(make, out_shardings=[x.sharding for x in leaves])())


def run_program(cfg, name: str, steps: int) -> dict:
    """Compiles and runs program `name` on all devices; its sizes and speed (see the module doc)."""
    import jax

    from jaxrag import sharding
    from jaxrag.plan.fit import ACCELERATORS, accelerator_of, generation_placement
    from jaxrag.plan.programs import pipeline_programs

    devices = jax.devices()  # generation's programs on this process's devices, placed as the run places them
    gen = generation_placement(cfg, jax.local_devices(), jax.process_count(), sharding.usable_device_bytes())
    found = {p.name: p for p in pipeline_programs(cfg, sharding.make_mesh(cfg.mesh, devices), gen.mesh)}
    if name not in found:
        raise JaxragError(f"--only: no program {name!r}; programs: {', '.join(found)}")
    p = found[name]
    start = time.perf_counter()
    compiled = p.lower().compile()
    compile_s = time.perf_counter() - start
    m = compiled.memory_analysis()
    row = dict(name=name, xla_peak_gb=(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
                                       - m.alias_size_in_bytes) / 1e9,
               compile_s=compile_s, flops=p.flops, tokens=p.tokens, read_bytes=p.read_bytes)
    seconds = []
    try:
        for i in range(steps + 1):
            args = materialize(p.args, seed=i)
            jax.block_until_ready(args)
            start = time.perf_counter()
            out = jax.block_until_ready(compiled(*args))
            seconds.append(time.perf_counter() - start)
            for x in jax.tree.leaves((args, out)):  # free before the next call's arguments exist
                if not x.is_deleted():
                    x.delete()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        row["out_of_memory"] = str(e).splitlines()[0][:300]
    stats = [d.memory_stats() or {} for d in devices]
    peak = max(s.get("peak_bytes_in_use", 0) for s in stats)
    limit = min(s.get("bytes_limit", 0) for s in stats)
    row.update(measured_peak_gb=peak / 1e9 if peak else None, bytes_limit_gb=limit / 1e9 if limit else None)
    if len(seconds) > 1:
        timed = sorted(seconds[1:])[len(seconds[1:]) // 2]
        peak_flops, bandwidth, _ = ACCELERATORS[accelerator_of(devices[0])]
        on_device = jax.default_backend() != "cpu"
        row.update(seconds=timed, tokens_per_s=p.tokens / timed, tflops_per_s=p.flops / timed / 1e12,
                   mfu=p.flops / timed / (peak_flops * len(devices)) if on_device else None,
                   read_tb_s=p.read_bytes / timed / 1e12,
                   hbm_fraction=p.read_bytes / timed / bandwidth if on_device else None)
    return row


def _child_command(name: str, out: Path) -> list[str]:
    """This command for one program: the config flags as given, --only and --json replaced."""
    args, skip = [], False
    for a in sys.argv[1:]:
        if skip or a.startswith(("--only=", "--json=")):
            skip = False
        elif a in ("--only", "--json"):
            skip = True
        else:
            args.append(a)
    return [sys.executable, "-m", "benchmarks.fit", *args, f"--only={name}", f"--json={out}"]


def main(argv) -> None:
    if len(argv) > 1:
        print(f"error: unexpected argument {argv[1]!r} (flags are --name=value)", file=sys.stderr)
        raise SystemExit(2)
    run(lambda: fit(_CONFIG.value, Path(_JSON.value), _ONLY.value, _STEPS.value))


def fit(cfg, out: Path, only: list[str], steps: int) -> None:
    from benchmarks.common import write_json

    if not out.parent.is_dir():
        raise JaxragError(f"--json {out}: directory {out.parent} does not exist")
    if len(only) == 1:  # one program: run it here
        import jax

        write_json(out, {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                         "devices": jax.device_count(), "jax": jax.__version__,
                         "programs": [run_program(cfg, only[0], steps)]})
        return
    from jaxrag.plan.programs import PROGRAMS

    result = {"config": cfg.model.path, "lora_rank": int(cfg.model.get("lora", {}).get("rank", 0)),
              "remat": cfg.model.get("remat", "none"), "steps": steps, "programs": []}
    for name in only or PROGRAMS:
        with tempfile.TemporaryDirectory() as tmp:
            child = Path(tmp) / "one.json"
            proc = subprocess.run(_child_command(name, child), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                  text=True)
            if proc.returncode:
                result["programs"].append(dict(name=name, error=proc.stderr.strip().splitlines()[-1][:500]))
            else:
                one = json.loads(child.read_text())
                result.update({k: one[k] for k in ("backend", "device", "devices", "jax")})
                result["programs"] += one["programs"]
        write_json(out, result)  # after each program: what ran is kept if the rest is cut off
        print(f"{name}: done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=_CONFIG.parse)
