"""Policy datastore: kNN source distribution vs numpy, edits, and the `python -m jaxrag.datastore` CLI."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrag.datastore import main
from jaxrag.errors import JaxragError
from jaxrag.retrieval.datastore import (PolicyDatastore, build_datastore, knn_policy, label_distribution)
from jaxrag.retrieval.index import IndexParams

DIM = 64
MODEL = "qwen2.5-tiny-srrag@layer2"


def hidden_states(n, seed=0):
    """Two regions of hidden-state space (wiki-preferring, self-preferring) with big norm spread."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    centres = rng.normal(size=(2, DIM)) * 3
    keys = (centres[labels] + rng.normal(size=(n, DIM))) * rng.uniform(1, 50, size=(n, 1))
    return keys.astype(np.float32), labels


def numpy_policy(keys, stored, labels, k):
    q = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    s = stored / np.linalg.norm(stored, axis=1, keepdims=True)
    top = np.argsort(-(q @ s.T), axis=1, kind="stable")[:, :k]
    return np.stack([(labels[top] == c).mean(1) for c in (0, 1)], -1)


@pytest.fixture
def datastore(tmp_path):
    keys, labels = hidden_states(400)
    names = np.array(["wiki", "self"])[labels]
    ds = build_datastore(tmp_path / "ds", keys, names, [f"q{i}" for i in range(400)],
                         [f"question number {i}" for i in range(400)], model=MODEL)
    return ds, keys, labels


def test_policy_distribution_matches_numpy_knn(datastore):
    ds, keys, labels = datastore
    assert ds.sources == ("wiki", "self") and ds.index.meta.kind == "exact" and len(ds) == 400
    queries, _ = hidden_states(16, seed=1)
    p = ds.policy_distribution(queries)  # k = 30, the paper's value
    np.testing.assert_allclose(p, numpy_policy(queries, keys, labels, 30), atol=1e-6)
    np.testing.assert_allclose(p.sum(1), 1.0)
    assert (ds.label_counts(queries) == np.round(p * 30)).all()
    np.testing.assert_array_equal(label_distribution(ds.neighbour_labels(queries), 2), p)
    keys_dev, labels_dev = ds.device_arrays()
    np.testing.assert_allclose(np.asarray(knn_policy(jnp.asarray(queries), keys_dev, labels_dev, 30, 2)), p, atol=1e-6)
    np.testing.assert_allclose(label_distribution(np.array([[0, 0, 1, 1, 1]]), 3), [[0.4, 0.6, 0.0]])


def test_leave_one_out_audit_equals_numpy(tmp_path, capsys):
    """Leave-one-out p_D excludes the entry itself (numpy reference on the same keys); the audit
    scores it per dataset (question-id prefix): neighbours that share a label separate the
    classes (AUROC 1 on two far-apart clusters), shuffled labels do not."""
    from sklearn.metrics import roc_auc_score

    keys, labels = hidden_states(120, seed=3)
    shuffled = np.random.default_rng(4).permutation(labels)
    ids = [f"{'nq' if i < 60 else 'fever'}-train-{i:05d}" for i in range(120)]
    y = np.where(np.arange(120) < 60, labels, shuffled)  # nq: labels follow the clusters
    ds = build_datastore(tmp_path / "ds", keys, np.array(["wiki", "self"])[y], ids, ids, model=MODEL)
    q = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    sim = q @ q.T
    np.fill_diagonal(sim, -np.inf)
    top = np.argsort(-sim, axis=1, kind="stable")[:, :7]
    want = (y[top] == 0).mean(1)
    np.testing.assert_allclose(ds.leave_one_out(7)[:, 0], want, atol=1e-6)
    assert main(["audit", str(tmp_path / "ds"), "-k", "7", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    nq, fever = table["datasets"]["nq"], table["datasets"]["fever"]
    wiki = (y == 0).astype(int)
    assert nq["n"] == fever["n"] == 60 and table["k"] == 7 and table["positive"] == "wiki"
    assert nq["auroc"] == roc_auc_score(wiki[:60], want[:60]) > 0.95
    assert fever["auroc"] == roc_auc_score(wiki[60:], want[60:]) < 0.8
    assert table["all"]["auroc"] == roc_auc_score(wiki, want) and table["all"]["n"] == 120
    assert nq["share"] == wiki[:60].mean() and 0 < table["all"]["prior_auroc"] < 1
    assert nq["agreement"] == ((want[:60] > 0.5) == wiki[:60]).mean()  # k odd: no ties
    assert main(["audit", str(tmp_path / "ds"), "-k", "7"]) == 0
    assert "nq" in capsys.readouterr().out
    one_class = build_datastore(tmp_path / "one", keys[:20], ["self"] * 20, ids[:20], ids[:20], model=MODEL)
    assert main(["audit", str(one_class.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["datasets"]["nq"]["auroc"] is None  # strict JSON, no NaN


def test_scann_datastore_agrees_with_exact(tmp_path):
    # Questions of one kind cluster in hidden-state space; each cluster leans to one source.
    rng = np.random.default_rng(2)
    centres, lean = rng.normal(size=(300, DIM)), rng.uniform(0.1, 0.9, 300)
    which = rng.integers(0, 300, 30_000)
    keys = (centres[which] + 0.3 * rng.normal(size=(30_000, DIM))) * rng.uniform(1, 50, (30_000, 1))
    keys = keys.astype(np.float32)
    labels = (rng.uniform(size=30_000) < lean[which]).astype(int)
    ds = build_datastore(tmp_path / "big", keys, np.array(["wiki", "self"])[labels], [str(i) for i in range(30_000)],
                         [""] * 30_000, model=MODEL, params=IndexParams(exact_below=10_000))
    assert ds.index.meta.kind == "scann" and ds.remove(["0"]).index.meta.kind == "scann"  # edits keep params
    queries = (centres[:50] + 0.3 * rng.normal(size=(50, DIM))).astype(np.float32)
    exact = numpy_policy(queries, keys[1:], labels[1:], 30)
    assert np.abs(PolicyDatastore(tmp_path / "big").policy_distribution(queries) - exact).max() <= 0.1


def test_edits_persist_and_reload(datastore, tmp_path):
    ds, keys, labels = datastore
    ds = ds.remove(["q0", "q1"]).relabel(["q2"], "self")
    extra, _ = hidden_states(3, seed=9)
    ds = ds.add(extra, ["wiki", "self", "wiki"], ["n1", "n2", "n3"], ["new a", "new b", "new c"])
    again = PolicyDatastore(tmp_path / "ds")
    assert len(again) == 401 and again.entries[-1].question == "new c"
    assert again.entries[again.row_of("q2")].source == "self"
    with pytest.raises(JaxragError, match="no entry with question id 'q0'"):
        again.row_of("q0")
    found = again.search(extra[1:2] * 7.0, k=1)  # scale-free: cosine on normalised keys
    assert again.entries[found.rows[0, 0]].question_id == "n2" and found.labels[0, 0] == 1


def test_datastore_errors(datastore, tmp_path):
    ds, keys, _ = datastore
    with pytest.raises(JaxragError, match=r"\[batch, 64\]"):
        ds.search(np.zeros((1, 32)), 5)
    with pytest.raises(JaxragError, match="built with encoder"):
        ds.search(keys[:1], 5, model="llama-2-7b@15")
    with pytest.raises(JaxragError, match="already present"):
        ds.add(keys[:1], ["wiki"], ["q5"], ["dup"])
    with pytest.raises(JaxragError, match="source 'web'"):
        ds.add(keys[:1], ["web"], ["z"], ["?"])
    with pytest.raises(JaxragError, match="empty"):
        build_datastore(tmp_path / "none", np.zeros((0, DIM)), [], [], [], model=MODEL)
    assert len(PolicyDatastore(tmp_path / "ds")) == 400  # failed edits changed nothing


def test_cli_inspect_add_remove_relabel(datastore, tmp_path, capsys):
    ds, keys, labels = datastore
    path = str(tmp_path / "ds")
    assert main(["inspect", path, "--source", "self", "--limit", "3"]) == 0
    out = capsys.readouterr().out
    n_self = int((labels == 1).sum())
    assert f"400 entries, model {MODEL}" in out and f"self {n_self}" in out and f"{n_self} matching" in out
    assert main(["inspect", path, "--neighbours", "q7", "-k", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("q7 [") and out[1].startswith("p_D: wiki") and out[2].startswith("q7\t")
    np.savez(tmp_path / "more.npz", keys=keys[:2] + 1, sources=np.array(["self", "self"]),
             question_ids=np.array(["m1", "m2"]), questions=np.array(["more 1", "more 2"]))
    assert main(["add", path, "--from", str(tmp_path / "more.npz")]) == 0
    assert main(["remove", path, "q3", "q4", "m1"]) == 0
    assert main(["relabel", path, "q5", "--source", "wiki"]) == 0
    assert main(["inspect", path, "--grep", "more", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == {"question_id": "m2", "question": "more 2", "source": "self"}
    assert len(PolicyDatastore(path)) == 399


def test_cli_errors_are_one_line(datastore, tmp_path, capsys):
    path = str(tmp_path / "ds")
    assert main(["remove", path, "nope"]) == 2
    assert main(["relabel", path, "q1", "--source", "web"]) == 2
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "no entry with question id 'nope'" in err[0] and "unknown source 'web'" in err[1]
    proc = subprocess.run([sys.executable, "-m", "jaxrag.datastore", "remove", path, "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "nope" in proc.stderr
