"""`python -m jaxrag.plan --config configs/qwen.py [--config.x=y ...] [--devices N]
[--device-memory-gb G] [--accelerator h100|a100|v4|v5e|v5p] [--devices-per-host H]
[--memory-fraction F] [--mfu M] [--json OUT]`

Proves a run fits before anyone rents the hardware: AOT-compiles every heavy program of the
pipeline (`jaxrag.plan.programs`) at the config's real shapes and target dtypes on N devices
(fake CPU devices when N real accelerators are absent), with abstract parameters, and prints per
program XLA's per-device peak memory (temporaries + arguments + outputs - donated aliases), FLOPs
and tokens per call, and the estimated time of each stage = calls x max(FLOPs / (peak FLOP/s x
MFU), bytes read / (HBM bandwidth x MFU)) (decode steps are bandwidth-bound). Training programs
run on all N devices (the config's mesh); generation programs as the run places them: the N
devices are hosts of H (the accelerator's devices per host), one process each, and every process
generates its share of the questions on its own H devices, the model split over `tensor` only as
far as it must be (`jaxrag.sharding.generation_tensor`; `--config.generation.tensor` sets it).
A program fits when its peak is within the usable memory (device memory x the fraction JAX may
allocate, 75% by default as JAX's preallocation) less `--headroom` (10%). Exits 2 with one line
per program that does not fit, naming settings that would make it fit. The pipeline runs the
same check (`check_fit`) before its first training or generation stage: against device memory
on accelerators, host memory on CPU.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # The documented spelling is --device-memory-gb / --memory-fraction; absl names are underscored.
    def _underscored(arg: str) -> str:
        name, eq, value = arg.partition("=")
        return "--" + name[2:].replace("-", "_") + eq + value if name.startswith("--") else arg
    sys.argv = [a if a.startswith("--config") else _underscored(a) for a in sys.argv]
    # the fake device count must be set before jax is imported
    _n = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), None)
    if _n is None and "--devices" in sys.argv[:-1]:
        _n = sys.argv[sys.argv.index("--devices") + 1]
    from jaxrag.pipeline.cli import jax_runs_on_cpu  # imports no jax
    from jaxrag.plan.fit import PLAN_XLA_FLAGS  # imports no jax

    # PLAN_XLA_FLAGS corrects for XLA-CPU only: on accelerators the plan compiles what the pipeline runs
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_n or 8} "
                               + (PLAN_XLA_FLAGS if jax_runs_on_cpu() else ""))

import dataclasses
import json
from pathlib import Path

from absl import app, flags

from jaxrag.errors import JaxragError, run
from jaxrag.pipeline.cli import ConfigFlag
from jaxrag.plan.fit import (ACCELERATORS, DEFAULT_FRACTION, DEFAULT_HEADROOM, DEFAULT_MFU, DEVICES_PER_HOST,
                             devices_per_process, failures, generation_placement, measure, plan_devices, table)

_CONFIG = ConfigFlag()  # config mistakes: one `error:` line, exit 2, as jaxrag.train
_DEVICES = flags.DEFINE_integer("devices", 8, "devices to plan for")
_MEMORY = flags.DEFINE_float("device_memory_gb", None, "memory per device, GB (default: the accelerator's)")
_ACCEL = flags.DEFINE_enum("accelerator", "h100", list(ACCELERATORS), "peak FLOP/s, bandwidth, memory")
_PER_HOST = flags.DEFINE_integer("devices_per_host", None, "devices per host, one process each "
                                 "(default: the accelerator's, DEVICES_PER_HOST)")
_FRACTION = flags.DEFINE_float("memory_fraction", DEFAULT_FRACTION, "share of device memory JAX may use "
                               "(its default preallocation; XLA_PYTHON_CLIENT_MEM_FRACTION)")
_HEADROOM = flags.DEFINE_float("headroom", DEFAULT_HEADROOM, "share of the usable memory kept free")
_MFU = flags.DEFINE_float("mfu", DEFAULT_MFU, "model FLOPs utilisation assumed for the time estimates")
_JSON = flags.DEFINE_string("json", None, "write the plan as JSON here")


def main(argv) -> None:
    if len(argv) > 1:
        print(f"error: unexpected argument {argv[1]!r} (flags are --name=value)", file=sys.stderr)
        raise SystemExit(2)
    def plan():
        cfg, n = _CONFIG.value, _DEVICES.value
        memory = _MEMORY.value or ACCELERATORS[_ACCEL.value][2]
        usable = memory * _FRACTION.value
        print(f"plan: {cfg.model.path} on {n} x {_ACCEL.value} ({memory:.0f} GB, JAX may use {_FRACTION.value:.0%} "
              f"= {usable:.1f} GB, {_HEADROOM.value:.0%} kept free), remat={cfg.model.get('remat', 'none')}, "
              f"MFU {_MFU.value:.0%}", flush=True)
        devices = plan_devices(n)
        per_process = devices_per_process(n, _PER_HOST.value or DEVICES_PER_HOST[_ACCEL.value])
        gen = generation_placement(cfg, devices[:per_process], n // per_process,
                                   usable * (1 - _HEADROOM.value) * 1e9)
        print(f"generation: {gen.processes} process(es) x {per_process} device(s), each process the model "
              f"({gen.weight_gb:.1f} GB) on its own devices as data {gen.data} x tensor {gen.tensor} "
              f"(generation.tensor={int(cfg.generation.tensor)}) and its own batches", flush=True)
        rows = measure(cfg, devices, _ACCEL.value, usable, _HEADROOM.value, _MFU.value,
                       stand_in=devices[0].platform == "cpu", generation=gen)
        print(table(rows))
        train = sum(r.hours or 0 for r in rows if r.name in ("stage1 step", "stage2 step", "DPO reference scoring"))
        construct = sum(r.hours or 0 for r in rows if r.name.startswith("construct"))
        print(f"stage 1 + stage 2 (with DPO reference scoring): {train:.1f} h on {n} x {_ACCEL.value} at "
              f"{_MFU.value:.0%} MFU (the paper: ~10 h on 8 x A800); construct: {construct:.1f} h")
        if _JSON.value:
            out = Path(_JSON.value)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(json.dumps({"devices": n, "accelerator": _ACCEL.value, "device_memory_gb": memory,
                                       "memory_fraction": _FRACTION.value, "headroom": _HEADROOM.value,
                                       "mfu": _MFU.value, "train_hours": train, "construct_hours": construct,
                                       "generation": gen.summary(),
                                       "programs": [dataclasses.asdict(r) for r in rows]}, indent=1) + "\n")
            tmp.replace(out)
        if bad := failures(rows, usable, _HEADROOM.value, n):
            raise JaxragError("does not fit:\n  " + "\n  ".join(bad))

    run(plan)


if __name__ == "__main__":
    app.run(main, flags_parser=_CONFIG.parse)
