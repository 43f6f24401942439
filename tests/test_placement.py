"""Generation gives the same results on any placement of the model (docs/scale.md): the
quickstart's miniature run (1 process x 4 devices, generation's data axis 4) is trained once, and
its generation stages (construct, the datastore, the baselines' datastores, eval) are rerun on a
copy of its workdir per layout with the real stage functions (tests/generation_layout.py):

- 1 process x 1 device;
- 1 process x 4 devices, the model split over a model axis of 2 (data 2 x tensor 2);
- 2 processes x 2 devices (data 2 each), joined as a pod's processes are, each computing its
  share of the questions.

Each gives the quickstart run's construct labels and texts (log-likelihoods within 1e-4), its
datastore keys (within 1e-4) and values, and its results.json decisions and accuracies. Every
run uses the miniature's XLA flags (pipeline_fixtures.MINI_XLA_FLAGS), as the quickstart's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from multihost_fixtures import free_ports
from pipeline_fixtures import MINI_XLA_FLAGS, REPO

from jaxrag.retrieval.datastore import PolicyDatastore

SCRIPT = Path(__file__).with_name("generation_layout.py")
LAYOUTS = {"1x1": (1, 1, 1), "1x4 tensor 2": (1, 4, 2), "2x2": (2, 2, 0)}  # processes, devices each, tensor
DATASTORES = ("datastore", "baselines/no_kv_label_datastore", "baselines/no_dpo_datastore")


def _env(devices: int, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{MINI_XLA_FLAGS} --xla_force_host_platform_device_count={devices}", **extra)
    return env


def _rerun(workdir: Path, processes: int, devices: int, tensor: int) -> tuple[list[dict], list[str]]:
    """The generation stages rerun on `workdir` by `processes` processes: (each one's JSON line,
    each one's stdout)."""
    port, procs = free_ports(), []
    for i in range(processes):
        join = {} if processes == 1 else dict(JAXRAG_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                              JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(workdir), str(tensor)], cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(devices, **join)))
    outs = [p.communicate(timeout=1500) for p in procs]
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}: {err[-3000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs], [out for out, _ in outs]


@pytest.fixture(scope="module")
def layouts(quickstart, tmp_path_factory):
    """{layout: (workdir, each process's JSON line, each process's stdout)}."""
    source, _ = quickstart
    runs = {}
    for name, (processes, devices, tensor) in LAYOUTS.items():
        workdir = tmp_path_factory.mktemp("layout") / "run"
        shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("logs"))
        lines, stdout = _rerun(workdir, processes, devices, tensor)
        runs[name] = (workdir, lines, stdout)
    return runs


def _records(workdir: Path) -> list[dict]:
    rows = [json.loads(line) for path in sorted((workdir / "construct").glob("shard-*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: (r["dataset"], r["id"]))


def _without_floats(record: dict) -> dict:
    out = {k: v for k, v in record.items() if k not in ("no_context_loglik", "source_loglik")}
    out["contexts"] = [{k: v for k, v in c.items() if k != "loglik"} for c in record["contexts"]]
    return out


def _logliks(record: dict) -> list[float]:
    return [record["no_context_loglik"], *(c["loglik"] for c in record["contexts"])]


def _decisions(results: dict) -> dict:
    """Each method's accuracy and retrieval share, on average and per dataset."""
    out = {f"average/{m}": (s["acc"], s["rag_frac"]) for m, s in results["average"].items()}
    out.update({f"{d}/{m}": (s["acc"], s["rag_frac"]) for d, methods in results["datasets"].items()
                for m, s in methods.items()})
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_construct_is_the_same_on_every_layout(quickstart, layouts, layout):
    want, got = _records(quickstart[0]), _records(layouts[layout][0])
    assert len(got) == len(want) > 0
    assert [_without_floats(r) for r in got] == [_without_floats(r) for r in want]
    np.testing.assert_allclose([_logliks(r) for r in got], [_logliks(r) for r in want], atol=1e-4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_datastores_are_the_same_on_every_layout(quickstart, layouts, layout):
    for rel in DATASTORES:
        want, got = PolicyDatastore.load(quickstart[0] / rel), PolicyDatastore.load(layouts[layout][0] / rel)
        assert [(e.question_id, e.source) for e in got.entries] == [(e.question_id, e.source) for e in want.entries]
        np.testing.assert_allclose(got.keys(), want.keys(), atol=1e-4, err_msg=rel)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_results_are_the_same_on_every_layout(quickstart, layouts, layout):
    want = json.loads((quickstart[0] / "results.json").read_text())
    got = json.loads((layouts[layout][0] / "results.json").read_text())
    assert _decisions(got) == _decisions(want)
    assert len(_decisions(got)) > 12


def test_each_process_runs_its_share(layouts):
    """On 2 processes, each places the model on its own 2 devices and computes its share of the
    datastore's and eval's batches (its log says which), and construct's shards."""
    _, lines, stdout = layouts["2x2"]
    assert [line["process"] for line in lines] == [0, 1]
    for i, (line, out) in enumerate(zip(lines, stdout)):
        assert line["placement"] == {"processes": 2, "devices_per_process": 2, "data": 2, "tensor": 1}
        assert f"datastore: process {i} of 2 computes batches" in out
        assert f"srrag paths [wiki]: process {i} of 2 computes batches" in out
        assert set(line["seconds"]) == {"construct", "datastore", "baselines", "eval"}
    _, single, _ = layouts["1x4 tensor 2"]
    assert single[0]["placement"] == {"processes": 1, "devices_per_process": 4, "data": 2, "tensor": 2}
