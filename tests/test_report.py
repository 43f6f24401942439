"""report.md cells equal hand-formatted values of a hand-built results dict; plots are real PNGs
written atomically."""

import pytest

from jaxrag.eval import report
from jaxrag.eval.plots import write_plots, write_report
from jaxrag.eval.report import fmt_latency, render_report


def _cells(md: str, first: str) -> list[str]:
    """The cells of the first table row whose first cell is `first` (after the header row)."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{md}")


def _section(md: str, title_start: str) -> str:
    start = md.index(f"## {title_start}")
    end = md.find("\n## ", start + 1)
    return md[start:] if end < 0 else md[start:end]


@pytest.fixture
def results():
    m = lambda acc, rag, lat: {"acc": acc, "rag_frac": rag, "latency_s": lat}
    return {
        "datasets": {
            "popqa": {"srrag": m(0.5661, 0.96, 1.0), "srrag_always_rag": m(0.568, 1.0, 1.2),
                      "no_ft_genread": m(0.247, 0.0, 0.5)},
            "arc": {"srrag": m(0.63, 0.29, 0.8), "srrag_always_rag": m(0.608, 1.0, 1.1),
                    "no_ft_genread": {"acc": 0.605, "rag_frac": None}},  # % RAG missing
        },
        "average": {
            "srrag": m(0.644, 0.64, 0.04567),
            "srrag_always_rag": m(0.634, 1.0, 1.25),
            "no_ft_genread": m(0.426, 0.0, float("nan")),  # NaN latency reads as missing
            "srrag_no_knn": m(0.634, 0.75, 0.5),
            "srrag_no_dpo": {"acc": 0.616},
        },
        "source_selection": {
            "srrag": {"acc_verb_ge_ret": 0.923, "auroc_ret_gt_verb": 0.57, "auroc_left_out": ["arc"],
                      "per_dataset": {"popqa": {"acc_verb_ge_ret": 0.959, "auroc_ret_gt_verb": 0.57},
                                      "arc": {"acc_verb_ge_ret": 0.887, "auroc_ret_gt_verb": None}}},
            "srrag_no_knn": {"acc_verb_ge_ret": 0.912, "per_dataset": {"popqa": {"acc_verb_ge_ret": 0.9}}}},
        "comparisons": {"srrag - srrag_always_rag": {"diff": 0.01, "ci95": [-0.004, 0.0242], "significant": False}},
        "latency": {"srrag": {"latency_s": 0.04567, "phases": {"T_d": 0.001, "T_v": 0.02, "T_r": 0.01, "T_g": 0.03},
                              "rag_frac": 0.64, "decisions_equal_harness": 1.0, "answers_equal_harness": 0.995,
                              "n": 400}},
        "curves": {
            "srrag": [{"threshold": t, "rag_frac": r, "acc": a, "latency_s": l}
                      for t, r, a, l in [(0.0, 1.0, 0.63, 1.2), (0.1, 0.64, 0.644, 0.9), (0.5, 0.2, 0.6, 0.5)]],
            "srrag_no_knn": [{"threshold": 0.1, "rag_frac": 0.75, "acc": 0.634, "latency_s": 0.5}],
        },
        "construct": {"table": "| dataset | % Self |\n|---|---|\n| nq | 28.0 |\n"},
        "config": {"model": {"name": "qwen", "layers": 28}, "tau": 0.2, "datasets": ["popqa", "arc"]},
    }


def test_number_formats():
    assert report.fmt_acc(0.6439) == "0.644" and report.fmt_pct(0.645001) == "65%"
    assert [fmt_latency(x) for x in (0.04567, 1.5, 12.34, 123.4, 1234.5, 0)] == \
        ["0.0457", "1.50", "12.3", "123", "1234", "0.00"]
    assert report.fmt_acc(None) == report.fmt_pct(float("nan")) == fmt_latency("x") == "–"


def test_table1_cells(results):
    md = render_report(results)
    t1 = _section(md, "Table 1")
    header = _cells(t1, "Method")
    assert header == ["Method", "popqa ACC", "popqa % RAG", "arc ACC", "arc % RAG",
                      "Average ACC", "Average % RAG", "Latency / item (s)"]
    assert _cells(t1, "SR-RAG") == ["SR-RAG", "0.566", "96%", "0.630", "29%", "0.644", "64%", "0.0457"]
    assert _cells(t1, "Untuned, GenRead") == ["Untuned, GenRead", "0.247", "0%", "0.605", "–", "0.426", "0%", "–"]
    # Ablation present only in "average": per-dataset cells are missing, not zero.
    assert _cells(t1, "SR-RAG w/o DPO") == ["SR-RAG w/o DPO", "–", "–", "–", "–", "0.616", "–", "–"]
    # Display order from METHODS; absent methods (IK, SeaKR, ...) have no row at all.
    rows = [_cells(t1, n)[0] for n in ("Untuned, GenRead", "SR-RAG fine-tuned, always RAG", "SR-RAG",
                                        "SR-RAG w/o kNN", "SR-RAG w/o DPO")]
    assert [t1.index(f"| {r} |") for r in rows] == sorted(t1.index(f"| {r} |") for r in rows)
    for absent in ("IK classifier", "SeaKR", "CCSK", "Untuned, always RAG", "Selective RAG"):
        assert f"| {absent} |" not in md


def test_table2_and_table3(results):
    md = render_report(results)
    t2 = _section(md, "Table 2")
    acc, auroc = t2.split("AUROC (retrieval > verbalization)")
    assert _cells(acc, "Method") == ["Method", "popqa", "arc", "Average"]
    assert _cells(acc, "SR-RAG") == ["SR-RAG", "0.959", "0.887", "0.923"]
    assert _cells(acc, "SR-RAG w/o kNN") == ["SR-RAG w/o kNN", "0.900", "–", "0.912"]
    assert _cells(auroc, "SR-RAG") == ["SR-RAG", "0.570", "–", "0.570"]
    assert "leave out datasets where one class is absent: SR-RAG: arc" in t2
    t3 = _section(md, "Table 3")
    assert _cells(t3, "SR-RAG") == ["SR-RAG", "0.644", "ref", "64%", "ref"]
    # 0.634 - 0.644 = -0.010; 75% - 64% = +11 points.
    assert _cells(t3, "SR-RAG w/o kNN") == ["SR-RAG w/o kNN", "0.634", "-0.010", "75%", "+11 pp"]
    assert _cells(t3, "SR-RAG w/o DPO") == ["SR-RAG w/o DPO", "0.616", "-0.028", "–", "–"]
    assert "w/o kv label" not in t3 and "fine-tuned" not in t3


def test_table2_shows_selective_rags_auroc_under_its_own_labels(results):
    """Selective RAG chooses between retrieval and no knowledge: its accuracy and AUROC get their
    own tables ("retrieval > no knowledge"), never a row among SR-RAG's verbalization labels."""
    results["source_selection"]["selective_rag"] = {
        "acc_verb_ge_ret": 0.81, "auroc_ret_gt_verb": 0.64,
        "per_dataset": {"popqa": {"acc_verb_ge_ret": 0.8, "auroc_ret_gt_verb": 0.66},
                        "arc": {"acc_verb_ge_ret": 0.82, "auroc_ret_gt_verb": 0.62}}}
    t2 = _section(render_report(results), "Table 2")
    titles = [line for line in t2.splitlines() if line.startswith(("Accuracy", "AUROC ("))]
    assert titles == ["Accuracy (verbalization ≥ retrieval)", "Accuracy (no knowledge ≥ retrieval)",
                      "AUROC (retrieval > verbalization)", "AUROC (retrieval > no knowledge)"]
    own = t2.split("AUROC (retrieval > no knowledge)")[1]
    srrags = t2.split("AUROC (retrieval > verbalization)")[1].split("AUROC (retrieval > no knowledge)")[0]
    assert _cells(own, "Selective RAG") == ["Selective RAG", "0.660", "0.620", "0.640"]
    assert _cells(own, "Method") == ["Method", "popqa", "arc", "Average"] and "| SR-RAG |" not in own
    assert "Selective RAG" not in srrags and _cells(srrags, "SR-RAG") == ["SR-RAG", "0.570", "–", "0.570"]


def test_report_names_the_code_and_each_stages_commit_when_they_differ(results):
    code = {"commit": "0123456789abcdef" * 2 + "01234567", "dirty": True, "jaxrag": "0.1.0", "jax": "0.4.38",
            "flax": "0.10.4", "transformers": "4.51.3"}
    results["code"] = {**code, "stages": {"base": {**code, "commit": "f" * 40, "dirty": False}, "eval": code}}
    md = render_report(results)
    assert ("Code: 0123456789+dirty; jax 0.4.38, flax 0.10.4, transformers 4.51.3. Stages ran across commits: "
            "base ffffffffff, eval 0123456789+dirty.") in md
    results["code"] = {**code, "commit": None, "dirty": None, "stages": {"eval": {**code, "commit": None}}}
    assert "Code: jaxrag 0.1.0 (no git checkout); jax 0.4.38," in render_report(results)
    assert "Stages ran" not in render_report(results)
    del results["code"]
    assert "Code: not recorded (results.json made before runs named their code)." in render_report(results)


def test_intervals_comparisons_latency_and_paper(results):
    results["average"]["srrag"]["acc_ci95"] = [0.6211, 0.667]
    results["config"]["data_counts"] = {"nq": {"train": 120, "validation": 36}, "popqa": {"test": 200}}
    md = render_report(results)
    assert _cells(_section(md, "Table 1"), "SR-RAG")[5] == "0.644 [0.621, 0.667]"
    diff = _cells(_section(md, "The paper's claims"), "SR-RAG − SR-RAG fine-tuned, always RAG")
    assert diff[1:] == ["average ACC", "+0.010", "[-0.004, 0.024]", "no (inside the noise)"]
    lat = _cells(_section(md, "Latency"), "SR-RAG")
    assert lat == ["SR-RAG", "0.0457", "0.00100", "0.0200", "0.0100", "0.0300", "64%", "100%", "100%", "400"]
    assert _cells(_section(md, "Data"), "nq") == ["nq", "120", "36", "–"]
    assert "Beside the paper" not in md  # the embedded world has no paper numbers
    assert "By question kind" not in md and "embedded world can show" not in md  # no by_kind: not the world
    results["by_kind"] = {"srrag": {"triviaqa/chain": {"acc": 0.8, "rag_frac": 0.1, "n": 60,
                                                       "acc_retrieval": 0.35, "acc_other": 0.85}}}
    md = render_report(results)
    kinds = _cells(_section(md, "By question kind"), "SR-RAG")
    assert kinds == ["SR-RAG", "triviaqa/chain", "60", "0.800 (10%)", "0.350", "0.850"]
    assert "checks the implementation, not the method" in _section(md, "What the embedded world can show")
    results["config"]["model"] = {"family": "qwen2", "path": "/data/qwen"}
    paper = _section(render_report(results), "Beside the paper")
    assert _cells(paper, "SR-RAG") == ["SR-RAG", "0.686", "67%", "0.644", "64%"]


def test_construct_config_and_partial(results):
    md = render_report(results)
    assert "| nq | 28.0 |" in _section(md, "Training data construction")
    cfg = _section(md, "Config")
    assert "model.name = \"qwen\"" in cfg and "tau = 0.2" in cfg and 'datasets = ["popqa", "arc"]' in cfg
    assert "against 0.634 for the same fine-tuned model" in md
    # A partial run: no ablations, no source selection, no construct -> those sections are absent.
    partial = {"datasets": {"popqa": {"srrag": results["datasets"]["popqa"]["srrag"]}}, "average": {}}
    md = render_report(partial)
    assert _cells(md, "SR-RAG") == ["SR-RAG", "0.566", "96%", "–", "–", "–"]
    assert all(s not in md for s in ("Table 2", "Table 3", "construction", "Config", "Plots"))
    # Construct stats without a ready-made table fall back to % Self and % flip per dataset.
    md = render_report({"construct": {"datasets": {"nq": {"self_pct": 28.04, "flip_pct": None}}}})
    assert _cells(md, "nq") == ["nq", "28.0", "–"]


def _assert_png(path):
    from matplotlib.image import imread

    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and img.shape[2] in (3, 4)


def test_write_report_files(results, tmp_path):
    path = write_report(results, tmp_path)
    assert path == tmp_path / "report.md"
    md = path.read_text(encoding="utf-8")
    assert md == render_report(results, images=["plots/accuracy_vs_retrieval.png", "plots/latency_accuracy.png"])
    assert "![accuracy_vs_retrieval](plots/accuracy_vs_retrieval.png)" in md
    assert "![latency_accuracy](plots/latency_accuracy.png)" in md
    for name in ("accuracy_vs_retrieval.png", "latency_accuracy.png"):
        _assert_png(tmp_path / "plots" / name)
    # Nothing but the finished files: no temp leftovers from the atomic writes.
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == \
        ["plots", "plots/accuracy_vs_retrieval.png", "plots/latency_accuracy.png", "report.md"]


def test_write_plots_empty_and_failed_write(tmp_path, monkeypatch):
    # No data at all still yields valid (empty-axes) PNGs, so the report's links never dangle.
    paths = write_plots({}, tmp_path / "p")
    assert [p.name for p in paths] == ["accuracy_vs_retrieval.png", "latency_accuracy.png"]
    for p in paths:
        _assert_png(p)
    # A write that fails midway leaves the old file and no temp file behind.
    before = paths[0].read_bytes()
    monkeypatch.setattr("matplotlib.figure.Figure.savefig", lambda *a, **k: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError):
        write_plots({}, tmp_path / "p")
    assert paths[0].read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["accuracy_vs_retrieval.png", "latency_accuracy.png"]


def test_training_stages_validation_choices_and_latency_questions():
    results = {"config": {"latency_questions": "the first 2 questions of each test set", "training": {
        "selective_rag": {"stages": [{"name": "stage1", "objective": "stage1_loss", "epochs": 3, "steps": 27, "lr": 3e-4},
                                     {"name": "stage2", "objective": "stage1_loss", "epochs": 2, "steps": 18, "lr": 1e-4}]},
        "srrag": {"stages": [{"name": "stage2", "objective": "stage2_loss", "epochs": 2, "steps": None, "lr": 1e-4}]}}},
        "selective_rag_at_srrag_retrieval": {"threshold": 0.25, "srrag_rag_frac_validation": 0.4,
                                             "rag_frac_validation": 0.4, "acc": 0.6125, "rag_frac": 0.45},
        "latency": {"no_ft_genread": {"latency_s": 0.5, "phases": {"T_v": 0.25, "T_g": 0.25}, "n": 4}}}
    text = render_report(results)
    assert "| Selective RAG | stage2 | stage1_loss | 2 | 18 | 0.0001 |" in text
    assert "| SR-RAG | stage2 | stage2_loss | 2 | – | 0.0001 |" in text  # steps unknown: not invented
    assert "same second stage as SR-RAG" in text
    assert ("threshold 0.25 chosen on the validation split, where SR-RAG retrieves 40% and Selective RAG 40%): "
            "test ACC 0.613 at 45% retrieval") in text
    assert "Every method timed the same way: the first 2 questions of each test set." in text
    assert "| Untuned, GenRead | 0.500 | – | 0.250 | – | 0.250 |" in text
