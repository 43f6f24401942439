"""What each pipeline stage was built from, so that a workdir never reuses a stage built from
another config.

`STAGES` declares, per stage, the config field prefixes it reads and the stages whose artifacts
it reads. Every field counts unless `NEUTRAL` lists it (it cannot change a result). Before a
stage runs, `W/inputs/<stage>.json` records its inputs: the value of every field it reads and
the build id of each upstream stage. A build id is a hash of that record and a generation
counter, so a stage rebuilt from its upstream's new build is stale too, even at the same config.

`plan` compares the records with the config before anything runs:
- a finished stage whose inputs are unchanged is skipped; an unfinished one resumes;
- when the first stale stage is `eval` or `export`, both are redone;
- when it is an earlier stage, nothing is done: one error line names the stage, the fields
  that differ (old -> new) and how to go on (a fresh workdir, or `pipeline.rerun_from=STAGE`,
  which redoes STAGE and every later stage);
- a finished stage without a record (a workdir made before records existed) is unknown and
  refused the same way, unless `rerun_from` names a later stage: the earlier ones are then
  trusted (the user vouches for them) and recorded with the current config.

Each record also names the code that built the stage (`code_identity`: the git commit and
whether the tree was dirty, or the installed jaxrag version, plus the jax, flax and transformers
versions). It is recorded, never compared: a commit changes most files that cannot change a
stage's result (docs, tests, other stages), so keying on it would redo every stage after every
commit. `eval` copies each stage's code into `results.json`, and `python -m jaxrag.eval.seeds`
refuses to pool runs whose code differs.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import importlib.metadata
import json
import os
import subprocess
from pathlib import Path

from ml_collections import ConfigDict

from jaxrag.errors import JaxragError
from jaxrag.pipeline.config_check import flatten, under

INPUTS_DIR = "inputs"  # W/inputs/<stage>.json
AUTO_REDO = ("eval", "export")  # cheap, and read no training field of their own: redone when stale

# Fields that cannot change a result: progress, logging, checkpoint cadence, the run's own
# control (whether a base below the reading gate stops the run included: the base is the same
# either way), how a batch is split over devices, rematerialisation, the mesh shape and how
# generation is placed on the devices (the same results on any placement: tests/test_placement.py).
NEUTRAL = ("pipeline", "mesh", "generation", "model.remat", "*.per_device_batch_size", "*.checkpoint_every",
           "*.keep_checkpoints", "*.log_every", "*.progress", "world_probe.allow_failed_reading_gate")


@dataclasses.dataclass(frozen=True)
class Dep:
    """One stage: the config field prefixes it reads (`""` = every field; `{train}` expands to
    each name of `data.train`), those read only on the embedded world, prefixes excluded although
    under `reads`, the stages whose artifacts it reads, and the paths under W it writes."""
    reads: tuple[str, ...]
    upstream: tuple[str, ...]
    outputs: tuple[str, ...]
    embedded_reads: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()


_ROUTE = ("construct.verbalize_max_tokens", "inference.max_knowledge_tokens", "inference.max_answer_tokens",
          "inference.batch_size", "retrieval.n_passages", "model.datastore_layer")
_TRAIN_EXCLUDES = ("model.datastore_layer",)  # read after training only (datastore, eval, export)
STAGES: dict[str, Dep] = {
    "world": Dep(("world",), (), ("world",)),
    # real model: conversion; embedded: pretraining from seed, then the probe (metrics.json)
    "base": Dep(("model.family", "model.path", "model.sources", "model.dtype", "model.param_dtype"), ("world",),
                ("base", "base_train"),
                embedded_reads=("seed", "model", "pretrain", "world_probe", "construct.verbalize_max_tokens"),
                excludes=_TRAIN_EXCLUDES + ("model.lora", "model.base_dtype")),  # LoRA starts at stage 1
    # embedded: gold-passage recall at n_passages per evaluation set, beside the index
    "index": Dep(("retrieval.encoder", "retrieval.corpus", "retrieval.passage_embeddings"), ("world",),
                 ("index", "index.building"), embedded_reads=("retrieval.n_passages", "data.eval")),
    "construct": Dep(("seed", "model", "construct", "data.train", "data.paths.{train}", "data.train_sizes",
                      "data.validation_sizes", "retrieval.encoder"), ("world", "base", "index"), ("construct",),
                     excludes=_TRAIN_EXCLUDES),
    "stage1": Dep(("seed", "model", "stage1"), ("base", "construct"), ("stage1",), excludes=_TRAIN_EXCLUDES),
    "stage2": Dep(("seed", "model", "stage2"), ("stage1", "construct"), ("stage2",), excludes=_TRAIN_EXCLUDES),
    "datastore": Dep(("model",) + _ROUTE, ("stage2", "construct"), ("datastore", "datastore.shares")),
    # IK / SeaKR / CCSK settings are read by eval only; any other baselines.* field is training's
    "baselines": Dep(("seed", "model", "stage1", "stage2", "baselines") + _ROUTE, ("base", "construct", "stage1"),
                     ("baselines",), excludes=("baselines.ik_answer_tokens", "baselines.seakr_samples",
                                               "baselines.max_train_questions")),
    # results.json holds the whole config, and any field no stage above claims lands here
    "eval": Dep(("",), ("world", "base", "index", "construct", "stage1", "stage2", "datastore", "baselines"),
                ("results.json", ".results.json.tmp", "report.md", "plots", "eval_parts")),
    "export": Dep(("model", "inference", "retrieval", "construct.verbalize_max_tokens"),
                  ("eval", "stage2", "datastore", "index"), ("export",)),
}


def code_identity() -> dict:
    """The code running now: `commit` of the git checkout jaxrag runs from and `dirty` (a tracked
    file differs from it), both None when jaxrag is an installed package outside a checkout; the
    installed `jaxrag` version; and the `jax`, `flax` and `transformers` versions."""
    root = Path(__file__).resolve().parents[2]
    commit = dirty = None
    try:
        top = _git(root, "rev-parse", "--show-toplevel")
        if top is not None and Path(top).resolve() == root:  # not a checkout that merely holds a venv
            commit = _git(root, "rev-parse", "HEAD")
            status = _git(root, "status", "--porcelain", "--untracked-files=no")
            dirty = None if commit is None or status is None else bool(status)
    except OSError:  # no git on this machine
        pass
    return {"commit": commit, "dirty": dirty,
            **{name: _version(name) for name in ("jaxrag", "jax", "flax", "transformers")}}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # jaxrag imported from a source tree never installed
        return None


def _git(root: Path, *args: str) -> str | None:
    out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() if out.returncode == 0 else None


def stages_code(workdir: Path) -> dict:
    """{stage: the code that built it} from the workdir's records (None: a stage adopted by
    `rerun_from`, made before records named their code)."""
    return {name: rec.get("code") for name in STAGES if (rec := read_record(workdir, name)) is not None}


def is_neutral(field: str) -> bool:
    return any(fnmatch.fnmatchcase(field, p) or fnmatch.fnmatchcase(field, p + ".*") if "*" in p else under(field, p)
               for p in NEUTRAL)


def _prefixes(dep: Dep, cfg: ConfigDict, embedded: bool) -> list[str]:
    reads = dep.reads + (dep.embedded_reads if embedded else ())
    train = list(cfg.get("data", {}).get("train", []))
    return [p.replace("{train}", n) for p in reads for n in (train if "{train}" in p else [""])]


def stage_inputs(name: str, cfg: ConfigDict, embedded: bool) -> dict:
    """{field: value} of every non-neutral field stage `name` reads (JSON-normalised)."""
    dep, flat = STAGES[name], flatten(cfg)
    prefixes = _prefixes(dep, cfg, embedded)
    fields = {k: v for k, v in flat.items() if any(under(k, p) for p in prefixes)
              and not any(under(k, x) for x in dep.excludes) and not is_neutral(k)}
    return json.loads(json.dumps(dict(sorted(fields.items())), default=str))


def _build_id(inputs: dict, upstream: dict, generation: int) -> str:
    blob = json.dumps({"inputs": inputs, "upstream": upstream, "generation": generation}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def new_record(name: str, inputs: dict, upstream: dict, generation: int, code: dict | None) -> dict:
    return {"stage": name, "build": _build_id(inputs, upstream, generation), "generation": generation,
            "upstream": upstream, "inputs": inputs, "code": code}


def record_path(workdir: Path, name: str) -> Path:
    return Path(workdir) / INPUTS_DIR / f"{name}.json"


def read_record(workdir: Path, name: str) -> dict | None:
    path = record_path(workdir, name)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def write_record(workdir: Path, record: dict) -> None:
    path = record_path(workdir, record["stage"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _short(value) -> str:
    text = "(absent)" if value is _ABSENT else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


_ABSENT = object()


def differences(old: dict, inputs: dict, upstream: dict) -> list[str]:
    """What changed since `old` was recorded: "field old -> new" per field, then rebuilt upstreams."""
    before = old["inputs"]
    out = [f"{k} {_short(before.get(k, _ABSENT))} → {_short(inputs.get(k, _ABSENT))}"
           for k in sorted(set(before) | set(inputs)) if before.get(k, _ABSENT) != inputs.get(k, _ABSENT)]
    return out + [f"{u} was rebuilt since" for u in sorted(set(old["upstream"]) | set(upstream))
                  if old["upstream"].get(u) != upstream.get(u)]


@dataclasses.dataclass
class Step:
    name: str
    action: str  # "skip" | "run" (new or resuming) | "redo" (outputs removed first) | "adopt"
    record: dict
    why: list[str] = dataclasses.field(default_factory=list)


def _how_to_go_on(workdir: Path, stage: str) -> str:
    return (f"use a fresh --workdir, or add --config.pipeline.rerun_from={stage} to redo {stage} and every later "
            f"stage in {workdir}")


def plan(cfg: ConfigDict, workdir: Path, names: list[str], done: dict[str, bool], embedded: bool,
         rerun_from: str = "") -> list[Step]:
    """One `Step` per stage in `names` (in order), or a JaxragError before anything is done."""
    if rerun_from and rerun_from not in names:
        raise JaxragError(f"--config.pipeline.rerun_from={rerun_from!r}: not a stage of this run; stages: "
                          f"{', '.join(names)}")
    redo_at = names.index(rerun_from) if rerun_from else len(names)
    code = code_identity()
    builds, steps, stale = {}, [], None
    for i, name in enumerate(names):
        inputs = stage_inputs(name, cfg, embedded)
        upstream = {u: builds[u] for u in STAGES[name].upstream if u in builds}
        old = read_record(workdir, name)
        generation = old["generation"] + 1 if old else 0
        if i >= redo_at:
            step = Step(name, "redo", new_record(name, inputs, upstream, generation, code), ["rerun_from"])
        elif old is None:
            if not done[name]:
                step = Step(name, "redo", new_record(name, inputs, upstream, 0, code))  # partial leftovers are unknown
            elif rerun_from:
                step = Step(name, "adopt", new_record(name, inputs, upstream, 0, None))  # made by unknown code
            else:
                raise JaxragError(f"{workdir}: {name} was made before jaxrag recorded each stage's inputs (no "
                                  f"{record_path(workdir, name)}), so the config it was built from is unknown; "
                                  f"{_how_to_go_on(workdir, name)} (earlier stages are then trusted as built "
                                  "from this config)")
        elif why := differences(old, inputs, upstream):
            step = Step(name, "redo", new_record(name, inputs, upstream, generation, code), why)
            stale = stale or step
        elif done[name]:
            step = Step(name, "skip", old)
        else:  # resumed by the code running now; the code it started under is kept beside it
            started = old.get("code_started", old.get("code"))
            step = Step(name, "run", {**old, "code": code, **({"code_started": started} if started != code else {})})
        builds[name] = step.record["build"]
        steps.append(step)
    if stale and stale.name not in AUTO_REDO:
        shown = "; ".join(stale.why[:6]) + (f"; and {len(stale.why) - 6} more" if len(stale.why) > 6 else "")
        raise JaxragError(f"{workdir}: {stale.name} was built from another config ({shown}); reusing it would "
                          f"mix two configs' results, so nothing was run: {_how_to_go_on(workdir, stale.name)}")
    return steps
