"""Generation gives the same results on any placement of the model (docs/scale.md): the
quickstart's miniature run (1 process x 4 devices, generation's data axis 4) is trained once, and
its generation stages (construct, the datastore, the baselines' datastores, eval) are rerun on a
copy of its workdir on 1 process x 1 device, with the real stage functions
(tests/generation_layout.py), and the miniature's XLA flags (pipeline_fixtures.MINI_XLA_FLAGS), as
the quickstart's. It gives the quickstart run's construct labels and texts (log-likelihoods
within 1e-4), its datastore keys (within 1e-4) and values, and its results.json decisions and
accuracies.

The model split over a model axis, on several processes each computing its share of the
questions, is tests/test_multihost.py's launch of the whole pipeline (2 processes x 2 devices,
data 1 x tensor 2 each), compared there with the same quickstart run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pipeline_fixtures import MINI_XLA_FLAGS, REPO

from jaxrag.retrieval.datastore import PolicyDatastore

SCRIPT = Path(__file__).with_name("generation_layout.py")
DATASTORES = ("datastore", "baselines/no_kv_label_datastore", "baselines/no_dpo_datastore")


@pytest.fixture(scope="module")
def one_device(quickstart, tmp_path_factory) -> tuple[Path, dict]:
    """(the rerun's workdir, its JSON line)."""
    workdir = tmp_path_factory.mktemp("one_device") / "run"
    shutil.copytree(quickstart[0], workdir, ignore=shutil.ignore_patterns("logs"))
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{MINI_XLA_FLAGS} --xla_force_host_platform_device_count=1")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(workdir)], cwd=REPO, text=True,
                          capture_output=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, json.loads(proc.stdout.strip().splitlines()[-1])


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


def test_construct_is_the_same_on_one_device(quickstart, one_device):
    want, got = _records(quickstart[0]), _records(one_device[0])
    assert len(got) == len(want) > 0
    assert [_without_floats(r) for r in got] == [_without_floats(r) for r in want]
    np.testing.assert_allclose([_logliks(r) for r in got], [_logliks(r) for r in want], atol=1e-4)


def test_datastores_are_the_same_on_one_device(quickstart, one_device):
    for rel in DATASTORES:
        want, got = PolicyDatastore.load(quickstart[0] / rel), PolicyDatastore.load(one_device[0] / rel)
        assert [(e.question_id, e.source) for e in got.entries] == [(e.question_id, e.source) for e in want.entries]
        np.testing.assert_allclose(got.keys(), want.keys(), atol=1e-4, err_msg=rel)


def test_results_are_the_same_on_one_device(quickstart, one_device):
    want = json.loads((quickstart[0] / "results.json").read_text())
    got = json.loads((one_device[0] / "results.json").read_text())
    assert _decisions(got) == _decisions(want)
    assert len(_decisions(got)) > 12


def test_the_rerun_records_its_placement(one_device):
    """The rerun placed the model on its one device, and says so (tests/generation_layout.py's line)."""
    line = one_device[1]
    assert line["placement"] == {"processes": 1, "devices_per_process": 1, "data": 1, "tensor": 1}
    assert set(line["seconds"]) == {"construct", "datastore", "baselines", "eval"}
