"""The laptop real-model example (`examples/real_model.py`, docs/export-and-serve.md) end to end:
SmolLM2's GGUF converted with the SR-RAG tokens, vital-article paragraphs indexed with MiniLM, one routed batch. It builds
its own model (not test_real_model.py's), so it runs on whichever worker is free."""

from __future__ import annotations

import importlib.util

import pytest

from real_fixtures import REPO_ROOT, smollm_gguf, wiki_paragraphs

# CI's step after the suite (pyproject's ci_step marker), on the other xdist worker beside
# tests/test_real_path.py, whose 2-process run leaves a core idle during its eval.
pytestmark = pytest.mark.ci_step


def test_laptop_example_routes_real_questions(tmp_path, capsys):
    """examples/real_model.py (docs/export-and-serve.md) end to end on a smaller index:
    convert, chunk + index, one routed batch with both sources; rerunning skips finished steps."""
    smollm_gguf(), wiki_paragraphs()  # skip, naming the package, when the test data is absent
    spec = importlib.util.spec_from_file_location("real_model_example", REPO_ROOT / "examples" / "real_model.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(["--workdir", str(tmp_path), "--paragraphs", "260"])  # holds the 2 gold paragraphs
    rows = out["rows"]
    assert [r.source for r in rows] == ["wiki", "self", "wiki", "self"]
    paragraphs = wiki_paragraphs()
    for r, title in zip(rows, ("Eiffel Tower", None, "Hamlet", None)):
        # Untrained source rows are the same mean row: equal probabilities, over the whole vocabulary.
        assert r.p_model[0] == pytest.approx(r.p_model[1], rel=1e-4) and 0 < sum(r.p_model) < 1
        if title:  # MiniLM's top passage is the gold paragraph (it is under 100 words: one chunk)
            assert r.knowledge == f"(Title: {title}) {paragraphs[title]}" and set(r.latency) == {"T_d", "T_r", "T_g"}
        else:
            assert set(r.latency) == {"T_d", "T_v", "T_g"}
    assert {"convert", "chunk+index", "route"} <= set(out["timings"])
    # The same four questions (the first call's compiled programs), all retrieving this time.
    again = example.main(["--workdir", str(tmp_path), "--source", "wiki", *example.QUESTIONS])
    assert "convert" not in again["timings"] and "chunk+index" not in again["timings"]
    assert [r.source for r in again["rows"]] == ["wiki"] * 4
    assert again["rows"][0].question == "Which engineer is the Eiffel Tower named after?"
    assert again["rows"][0].knowledge.startswith("(Title: Eiffel Tower)")
    assert "seconds per step" in capsys.readouterr().out
