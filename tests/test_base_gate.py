"""The base stage's reading gate: a base that still fails it after the last attempt stops the run
with one line (unless `world_probe.allow_failed_reading_gate`), and the gate asks its questions
with the passages `pipeline/base.py` hands it (`retrieval.n_passages`, cut at
`inference.max_knowledge_tokens`)."""

import json

import pytest
from pipeline_fixtures import mini_config

from jaxrag.errors import exit_code
from jaxrag.models.tokens import WIKI, source_token
from jaxrag.pipeline import base
from jaxrag.pipeline.config import tiny_config
from test_fair_comparisons import route_model  # noqa: F401 - the fixture: a tiny model with the SR-RAG tokens

FAILED = {"fresh_reading": 0.45, "reading_attempts": [0.3, 0.45], "reading_gate_passed": False,
          "fresh_rule_verbalization": 0.9, "verbalization_attempts": [0.2, 0.9], "verbalization_gate_passed": True,
          "kept_attempt": 1}


def test_a_base_below_the_reading_gate_stops_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    """Through `pipeline.run` (world, then base): exit 2, one `error:` line naming the gate, the
    score, the threshold and the override; no `W/base`, so nothing later runs on it. With the
    override the base is kept and its gates recorded as failed."""
    from jaxrag.pipeline import run as pipeline

    monkeypatch.setattr(base, "pretrain_until_it_reads_and_verbalizes", lambda cfg, w, world: ("model", dict(FAILED)))
    probed = []
    monkeypatch.setattr(base, "probe_world_knowledge", lambda *a: probed.append(a) or {"n_popular": 3})
    monkeypatch.setattr(base, "save_model", lambda model, out: out.mkdir(parents=True) or out)
    cfg = mini_config()
    cfg.world_probe.allow_failed_reading_gate = False  # the default: tiny_config's
    assert cfg.world_probe.allow_failed_reading_gate == tiny_config("qwen2").world_probe.allow_failed_reading_gate
    cfg.pipeline.stop_after = "base"
    assert exit_code(lambda: pipeline.run(cfg, tmp_path / "w")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: base: the reading gate failed: the kept base (attempt 2 of 2) reads 0.45 of fresh-entity "
                   "questions with retrieved passages, threshold 0.80 (--config.world_probe.reading_gate); "
                   "--config.world_probe.allow_failed_reading_gate=True runs on with it (then python -m "
                   "jaxrag.eval.seeds refuses the run)"]
    assert not (tmp_path / "w" / "base").exists() and not probed
    cfg.world_probe.allow_failed_reading_gate = True  # the override: a run control, so nothing is stale
    assert exit_code(lambda: pipeline.run(cfg, tmp_path / "w")) == 0
    metrics = json.loads((tmp_path / "w" / "base" / "metrics.json").read_text())
    assert metrics["reading_gate_passed"] is False and metrics["fresh_reading"] == 0.45 and len(probed) == 1


def test_the_gate_reads_the_passages_base_py_passes(route_model, tmp_path, monkeypatch):  # noqa: F811
    """`pretrain_until_it_reads_and_verbalizes` (training replaced by the tiny model) asks the real
    `fresh_reading`: each base prompt holds `retrieval.n_passages` = 3 passages (the probe's own
    default is 1), each routed prompt's knowledge is cut at `inference.max_knowledge_tokens` = 5."""
    from jaxrag.prompts import answer_prefix_ids
    from jaxrag.world import probe
    from jaxrag.world.generate import generate_world

    cfg = tiny_config("qwen2")
    cfg.retrieval.n_passages, cfg.inference.max_knowledge_tokens = 3, 5
    cfg.world_probe.update(reading_questions=4, attempts=1)
    tok, wiki = route_model.tokenizer, route_model.token_id(source_token(WIKI))
    asked = []

    def generate(decoder, prompts, max_new, stop_ids=()):
        asked.extend(prompts)
        return [[] for _ in prompts]

    monkeypatch.setattr(probe, "generate", generate)
    monkeypatch.setattr(base, "_tiny_model", lambda cfg, workdir: route_model)
    monkeypatch.setattr(base, "train_lm", lambda model, texts, cfg, workdir: model)
    monkeypatch.setattr(base, "fresh_rule_verbalization", lambda *a: 1.0)
    _, gates = base.pretrain_until_it_reads_and_verbalizes(cfg, tmp_path, generate_world())
    assert gates["reading_attempts"] == [0.0]
    base_prompts, routed = [p for p in asked if wiki not in p], [p for p in asked if wiki in p]
    assert len(base_prompts) == len(routed) == 4
    assert [tok.decode(p).count("(Title: ") for p in base_prompts] == [3] * 4
    tail = len(answer_prefix_ids(tok))
    assert [len(p) - (p.index(wiki) + 1) - tail for p in routed] == [5] * 4  # knowledge tokens between
