"""The pipeline's runner: the stage table, in the order the stages run, and `run`.

    world (embedded default only) -> base -> index -> construct -> stage1 -> stage2 -> datastore
      -> baselines -> eval -> export

Each stage is `(config, workdir) -> artifact`, one module of this package, cached in
`workdir/<stage>`. A stage is skipped when its completion marker exists (its artifact renamed
into place, a trained model's `model/`, construct's `stats.json`, `results.json`) and it was
built from the same inputs (`jaxrag.pipeline.provenance`: `W/inputs/<stage>.json`); an
interrupted stage is redone from its own checkpoints or shards.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import jax
from ml_collections import ConfigDict

from jaxrag.runtime import host_memory, multihost
from jaxrag.data.check import check_data
from jaxrag.errors import JaxragError
from jaxrag.models.model import resolve_model_dir
from jaxrag.pipeline import (base, baselines, construct, datastore, eval, export, finetune, index, lanes, provenance,
                             world)
from jaxrag.pipeline.config_check import check_config
from jaxrag.pipeline.workdir import PLACEMENT, is_embedded
from jaxrag.plan.fit import check_fit, fit_key


def _stages():
    def exists(name):
        return lambda w: (w / name).exists()

    return [  # (name, stage, done(workdir))
        ("world", world.world_stage, exists("world")),
        ("base", base.base_stage, exists("base")),
        ("index", index.index_stage, exists("index")),
        ("construct", construct.construct_stage, construct.done),
        ("stage1", finetune.stage1_stage, exists("stage1/model")),
        ("stage2", finetune.stage2_stage, exists("stage2/model")),
        ("datastore", datastore.datastore_stage, exists("datastore")),
        ("baselines", baselines.baselines_stage, baselines.baselines_done),
        ("eval", eval.eval_stage, exists("results.json")),
        ("export", export.export_stage, exists("export")),
    ]


def stage_done(name: str, workdir: Path) -> bool:
    """Whether stage `name`'s completion marker is in `workdir`."""
    return next(done for n, _, done in _stages() if n == name)(Path(workdir))


def preflight(cfg: ConfigDict) -> None:
    """Real-model configs stop at once, before any work, when the weights are not at hand or a
    dataset file is wrong or smaller than the mixture's counts (`data.check`)."""
    if is_embedded(cfg):
        return
    try:
        resolve_model_dir(cfg.model.path)
    except JaxragError as e:
        raise JaxragError(f"{e}. Download the weights and pass --config.model.path=/path/to/hf_model_dir "
                          "(plus --config.retrieval.corpus=/path/psgs_w100.tsv and --config.data.paths.NAME=/path per dataset)") from None
    check_data(cfg)  # every row of every dataset, and Table 5's counts against the files: before `base`


# Stages that run the decoder's programs (`jaxrag.plan.programs`): before the first of them runs,
# every program must fit in device (accelerators) or host (CPU) memory.
DECODER_STAGES = ("construct", "stage1", "stage2", "datastore", "baselines", "eval")
FIT_FILE = "fit.json"  # W/fit.json: the fit verdict and its key (`check_fit_before`)


def check_fit_before(cfg: ConfigDict, workdir: Path, names, steps) -> None:
    """Every program fits, or stop now with the setting to change (`jaxrag.plan`). The verdict is
    kept in `W/fit.json` under a key of everything it depends on (`fit_key`), so a rerun of the
    same workdir (after an interruption, or a later stage) does not compile the programs again.
    Process 0 alone checks and keeps the record: every process's programs are the same shapes on
    the same kind of devices (`multihost.leader_check`)."""
    if is_embedded(cfg) or all(s.action in ("skip", "adopt") for n, s in zip(names, steps) if n in DECODER_STAGES):
        return
    multihost.leader_check("fit", lambda: _check_fit_once(cfg, workdir))


def _check_fit_once(cfg: ConfigDict, workdir: Path) -> None:
    record = workdir / FIT_FILE
    key = fit_key(cfg)
    try:
        if json.loads(record.read_text()).get("key") == key:
            return
    except (OSError, ValueError, AttributeError):  # none yet, or not a record: check
        pass
    check_fit(cfg)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(f".{FIT_FILE}.tmp")
    tmp.write_text(json.dumps({"key": key, "verdict": "every program fits (jaxrag.plan)"}) + "\n")
    os.replace(tmp, record)


# Stages that run on process 0 alone in a multi-process run (the others wait at the barrier after
# it): the world is generated once from its seed (no model), and the index encodes the corpus
# into one ScaNN index written whole. Every other stage runs on every process: training on the
# mesh of all processes' devices; generation (construct, the datastore, the baselines' datastores,
# eval) on each process's own devices, each process its share of the questions; process 0
# writes what is not a process's own shard.
LEADER_STAGES = ("world", "index")


def input_files(cfg: ConfigDict) -> dict[str, str]:
    """Digest of every local data file the config reads (`multihost.file_digest`), by field."""
    fields = {f"data.paths.{name}": path for name, path in cfg.data.paths.items()}
    fields["retrieval.corpus"] = cfg.retrieval.corpus
    return {field: multihost.file_digest(Path(path)) for field, path in sorted(fields.items())
            if path and Path(path).is_file()}


def run(cfg: ConfigDict, workdir: Path, user_set=()) -> dict[str, Path]:
    """Runs the stages in order (up to `pipeline.stop_after`). Each stage's inputs are recorded in
    `W/inputs/<stage>.json` before it runs (`jaxrag.pipeline.provenance`); a finished stage built from the
    same inputs is skipped, stale eval / export are redone, an earlier stale stage stops the run
    before anything is done. `user_set`: fields set on the command line (`config_check`).

    On several processes (`jaxrag.runtime.multihost`): each process first shows process 0 its config, data
    and workdir, and is refused if they differ; every process then plans from the same workdir,
    runs each stage (`LEADER_STAGES`: process 0 alone) and meets the others at a barrier after it."""
    check_config(cfg, user_set)
    workdir = Path(workdir)
    multihost.agree_at_start(cfg.to_dict(), input_files(cfg), workdir)
    multihost.start_watchdog()  # after the agreement: a refused start is every process's own error
    preflight(cfg)
    stages = [st for st in _stages() if st[0] != "world" or is_embedded(cfg)]
    names = [n for n, _, _ in stages]
    stop_after = cfg.pipeline.stop_after
    if stop_after:
        if stop_after not in names:
            raise JaxragError(f"--config.pipeline.stop_after={stop_after!r}: not a stage; stages: {', '.join(names)}")
        stages, names = stages[: names.index(stop_after) + 1], names[: names.index(stop_after) + 1]
    done = {name: workdir.is_dir() and is_done(workdir) for name, _, is_done in stages}
    steps = provenance.plan(cfg, workdir, names, done, is_embedded(cfg), cfg.pipeline.get("rerun_from", ""))
    multihost.agree_on_plan(names, steps)  # every process plans the same stages (one line where not)
    check_fit_before(cfg, workdir, names, steps)
    workers = _workers(cfg, user_set)
    multihost.barrier("planned")  # every process planned from the workdir as it was before this run
    leader = multihost.is_leader()
    if leader:
        workdir.mkdir(parents=True, exist_ok=True)
        write_config(cfg, workdir)

    def stage_task(i: int, name: str, stage, step):
        head = f"[{i}/{len(stages)}] {name}:"

        def go():
            with multihost.stage(name):
                run_step()

        def run_step():
            if step.action in ("skip", "adopt"):
                if leader and step.action == "adopt":
                    provenance.write_record(workdir, step.record)
                print(f"{head} done" + (" (made before inputs were recorded; trusted, as rerun_from is later)"
                                        if step.action == "adopt" else ""), flush=True)
                return
            if step.action == "redo" and leader:
                _remove(workdir, provenance.STAGES[name].outputs)
            if leader:
                provenance.write_record(workdir, step.record)
            why = {"rerun_from": " (rerun_from)"}.get(step.why[0], f" (inputs changed: {'; '.join(step.why)})") \
                if step.why else ""
            print(f"{head} running{why}", flush=True)
            start = time.perf_counter()
            multihost.barrier(f"{name}:start")  # process 0 removed the stale outputs
            if leader or name not in LEADER_STAGES:
                PLACEMENT.clear()
                stage(cfg, workdir)
                if leader and PLACEMENT:  # how the stage placed its generation model
                    provenance.write_record(workdir, {**step.record, "placement": dict(PLACEMENT)})
            multihost.barrier(f"{name}:done")  # every process sees the stage's outputs whole
            host_memory.release()  # the stage's models and temporaries, before the next stage loads its own
            print(f"{head} finished in {time.perf_counter() - start:.0f}s", flush=True)
        return go, tuple(u for u in provenance.STAGES[name].upstream if u in names)

    # A stage starts once the stages it reads are done (index beside base, the baselines beside
    # stage 2 and the datastore), `pipeline.workers` at once (`jaxrag.lanes`); eval reads every
    # stage before it, so its latency is measured with nothing beside it.
    lanes.run_graph({name: stage_task(i, name, stage, step)
                     for i, ((name, stage, _), step) in enumerate(zip(stages, steps), 1)}, workers)
    if (workdir / "report.md").is_file() and (not stop_after or stop_after in ("eval", "export")) and leader:
        print((workdir / "report.md").read_text(encoding="utf-8"), flush=True)
    multihost.finish()
    return {name: workdir / name for name in names}


CONFIG_FILE = "config.json"  # W/config.json: the config of the last run that got past the checks


def write_config(cfg: ConfigDict, workdir: Path) -> None:
    """`W/config.json`: what the workdir's stages were (or are being) built from, for tools that read
    a workdir before its eval has written `results.json` (`python -m jaxrag.eval.tau`)."""
    path = workdir / CONFIG_FILE
    tmp = path.with_name(f".{CONFIG_FILE}.tmp")
    tmp.write_text(json.dumps(cfg.to_dict(), indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _workers(cfg: ConfigDict, user_set=()) -> int:
    """Stages at a time. A run on several devices takes one at a time (`lanes.run_graph`: every
    device must reach the programs' collectives in one order); more, asked for on its command
    line, is refused."""
    workers = int(cfg.pipeline.workers)
    if workers < 1:
        raise JaxragError(f"--config.pipeline.workers={workers}: must be at least 1")
    if workers > 1 and jax.device_count() > 1 and "pipeline.workers" in user_set:
        raise JaxragError(f"--config.pipeline.workers={workers}: a run on {jax.device_count()} devices runs one stage "
                          "at a time, so that every device reaches the collectives in one order; set "
                          "--config.pipeline.workers=1")
    return workers


def _remove(workdir: Path, outputs) -> None:
    """A stage's outputs, before it is redone from scratch (checkpoints and shards included)."""
    for rel in outputs:
        path = workdir / rel
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
