"""What tests/test_pipeline.py builds on: the miniature embedded world's config, the notebooks run
headless, and how a run's output and files are compared."""

import hashlib
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from jaxrag.pipeline.config import tiny_config

REPO = Path(__file__).parent.parent

MINI_WORLD = dict(num_persons=60, num_cities=30, num_companies=30, num_bands=20, num_rivers=6,
                  num_event_passages=10, nq_size=20, fever_size=12, obqa_size=8, arc_easy_size=6, wow_size=12,
                  asqa_size=4, eval_test_size=10, rc_docs_per_epoch=50,
                  rule_qa_per_epoch=30, rule_verbalize_per_epoch=30, vocab_size=1200)


def mini_config():
    cfg = tiny_config("qwen2")
    cfg.world.update(MINI_WORLD)
    cfg.model.arch.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1)
    cfg.model.datastore_layer = 2  # its last layer, as the tiny config's
    cfg.model.max_length = 160
    cfg.pretrain.update(steps=3, batch_size=4, checkpoint_every=2)
    # a 3-step model fails the gates: 2 attempts, then it runs on (a failed reading gate would stop it)
    cfg.world_probe.update(questions=3, reading_questions=4, rule_questions=4, allow_failed_reading_gate=True)
    cfg.retrieval.n_passages = 2
    cfg.construct.update(n_contexts=2, verbalize_max_tokens=8, kmeans_clusters=2, demos_per_cluster=1)
    cfg.stage1.update(batch_size=4, epochs=1)
    cfg.stage2.update(batch_size=4, epochs=1)
    # One batch of 16 rows holds a whole test set (10 questions): one routed batch per set, path
    # and method's latency, where batches of 8 take two (the second padded to 8 rows).
    cfg.inference.update(batch_size=16, k=3, max_answer_tokens=4, max_knowledge_tokens=96)
    cfg.baselines.update(seakr_samples=2, max_train_questions=20, ik_answer_tokens=4)
    return cfg


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def mini_overrides() -> dict:
    """mini_config as flattened overrides of the tiny config (notebook / command-line form)."""
    tiny = dict(_flat(tiny_config("qwen2").to_dict()))
    return {k: v for k, v in _flat(mini_config().to_dict()) if tiny[k] != v}


def run_notebook(name: str, params: dict, cwd: Path) -> nbformat.NotebookNode:
    """Executes colab/NAME.ipynb headless with `params` injected after its parameters cell."""
    nb = nbformat.read(REPO / "colab" / f"{name}.ipynb", as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items())))
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def outputs(nb) -> str:
    return "".join(o.get("text", "") + "".join(map(str, o.get("data", {}).values()))
                   for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def statuses(out: str) -> list[str]:
    """The status word of each stage's progress line ("done", "running")."""
    return [line.split(":")[1].strip().split()[0] for line in out.splitlines()
            if line.startswith("[") and "finished in" not in line]


def file_digests(root: Path, parts=None) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, mtime_ns) of every file under root (or under its `parts`)."""
    tops = [root / p for p in parts] if parts else [root]
    return {str(f.relative_to(root)): (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
            for top in tops for f in sorted(top.rglob("*")) if f.is_file()}


def without_timings(obj):
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if "latency" not in k and k != "phases"}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    if isinstance(obj, float) and obj != obj:  # undefined (an AUROC over one class) equals itself
        return "nan"
    return obj
