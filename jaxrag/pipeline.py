"""The pipeline: stages `(config, workdir) -> artifact`, each cached in `workdir/<stage>`.

    world (embedded default only) -> base -> index -> construct -> stage1 -> stage2 -> datastore
      -> baselines -> eval -> export

A stage is skipped when its completion marker exists (its artifact renamed into place, a trained
model's `model/`, construct's `stats.json`, `results.json`) and it was built from the same inputs
(`jaxrag.provenance`: `W/inputs/<stage>.json`); an interrupted stage is redone from its own
checkpoints or shards (`jaxrag.pipeline_srrag`, `jaxrag.eval.methods`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import transformers
from flax import nnx
from ml_collections import ConfigDict

from jaxrag import lanes
from jaxrag.errors import JaxragError
from jaxrag.pipeline_srrag import dataset_items, is_embedded


def _world(cfg: ConfigDict):
    """The embedded world (pure function of the config: cheap to regenerate in any stage)."""
    from jaxrag.data.world import WorldConfig, generate_world

    return generate_world(WorldConfig(**cfg.world.to_dict()))


def world_stage(cfg: ConfigDict, workdir: Path) -> Path:
    from jaxrag.data.world import write_world

    return write_world(_world(cfg), workdir / "world")


def _tiny_model(cfg: ConfigDict, workdir: Path):
    """A randomly initialised model of the config's family and `arch`, on the world tokenizer
    (which already carries the SR-RAG tokens)."""
    from jaxrag.models import hf
    from jaxrag.models.decoder import Decoder
    from jaxrag.models.model import Model

    tok = transformers.AutoTokenizer.from_pretrained(workdir / "world" / "tokenizer")
    hf_config = transformers.AutoConfig.for_model(
        cfg.model.family, vocab_size=len(tok), tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **cfg.model.arch.to_dict())
    dec_cfg = hf.decoder_config(hf_config, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    decoder = Decoder(dec_cfg, nnx.Rngs(int(cfg.seed)))
    return Model(decoder, tok, hf_config, tuple(cfg.model.sources))


def base_stage(cfg: ConfigDict, workdir: Path) -> Path:
    """Embedded default: pretrain the tiny model on the world's text until it reads, then probe
    what it knows. Real models: convert the HF checkpoint and add the SR-RAG tokens."""
    from jaxrag.models.model import add_special_tokens, load_model, save_model

    out = workdir / "base"
    if not is_embedded(cfg):
        model = add_special_tokens(load_model(cfg.model.path, dtype=cfg.model.dtype), cfg.model.sources)
        return save_model(model, out)
    from jaxrag.eval.probe import probe_world_knowledge

    world = _world(cfg)
    model, gates = pretrain_until_it_reads_and_verbalizes(cfg, workdir, world)
    metrics = probe_world_knowledge(model, world, int(cfg.world_probe.questions),
                                    int(cfg.construct.verbalize_max_tokens))
    metrics.update(gates)
    save_model(model, out)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print("  what the base model knows:", json.dumps(metrics))
    return out


def pretrain_until_it_reads_and_verbalizes(cfg: ConfigDict, workdir: Path, world) -> tuple[object, dict]:
    """(base model, the gates' record). SR-RAG assumes a model that can read a passage and can
    verbalize what it knows; a tiny model learns each on a knife edge, so the base must pass two
    gates, both on questions no dataset holds (never a test question):
    - reading: one base can read 0.39 of fresh-entity questions with the gold passage where others
      read 0.90, and more steps (also reading-heavy ones) leave a failing base where it was;
      it is asked as the pipeline asks the base (`probe.fresh_reading`: `retrieval.n_passages`
      passages in the index's `(Title: T) text` lines, in the base prompt of construct and the
      untuned baselines; the routed `<EOQ><Wiki>` prompt is recorded beside it), since a base that
      read one gold passage in its own format could still fail on what retrieval hands it;
    - verbalizing: a base can read well (0.91) while its GenRead documents state the rule of only
      a quarter of fresh rule questions (other bases: 0.975-1.0), naming other categories' rules,
      so its <Self> path falls to chance on ARC-Challenge.
    A base that fails either is pretrained again from another initialisation and data order, up
    to `world_probe.attempts` runs in all; the one with the largest margin over both gates is kept."""
    from jaxrag.eval.probe import fresh_reading, fresh_rule_verbalization
    from jaxrag.train.stages import train_lm

    probe = cfg.world_probe
    gates = {"reading": float(probe.reading_gate), "verbalization": float(probe.verbal_gate)}
    best, best_margin, scores = None, None, []
    for attempt in range(int(probe.attempts)):
        run_cfg = cfg
        if attempt:  # a new initialisation and data order; the world stays the config's
            run_cfg = ConfigDict(cfg.to_dict())
            run_cfg.seed = int(cfg.seed) + 1_000_003 * attempt
        train_dir = workdir / "base_train" / (f"attempt{attempt}" if attempt else "")
        model = train_lm(_tiny_model(run_cfg, workdir), world.pretraining_documents, run_cfg, train_dir)
        reading = fresh_reading(model, world, int(probe.reading_questions), passages=int(cfg.retrieval.n_passages),
                                max_knowledge_tokens=int(cfg.inference.max_knowledge_tokens))
        scores.append({"reading": reading["reading"], "reading_prompts": reading,
                       "verbalization": fresh_rule_verbalization(model, world, int(probe.rule_questions),
                                                                 int(cfg.construct.verbalize_max_tokens))})
        print(f"  base attempt {attempt}: reads {scores[-1]['reading']:.2f} of fresh-entity questions with retrieved "
              f"passages (gate {gates['reading']:.2f}); its documents state the rule for "
              f"{scores[-1]['verbalization']:.2f} of fresh rule questions (gate {gates['verbalization']:.2f})")
        margin = min(scores[-1][k] - gates[k] for k in gates)
        if best is None or margin > best_margin:
            best, best_margin, kept = model, margin, attempt
        if margin >= 0:
            break
    record = {"fresh_reading": scores[kept]["reading"], "reading_attempts": [s["reading"] for s in scores],
              "reading_prompts_attempts": [s["reading_prompts"] for s in scores],
              "reading_gate_passed": scores[kept]["reading"] >= gates["reading"],
              "fresh_rule_verbalization": scores[kept]["verbalization"],
              "verbalization_attempts": [s["verbalization"] for s in scores],
              "verbalization_gate_passed": scores[kept]["verbalization"] >= gates["verbalization"],
              "kept_attempt": kept}
    return best, record


def index_stage(cfg: ConfigDict, workdir: Path) -> Path:
    """Encode the corpus and build the passage index; on the embedded world also measure
    recall@n of the gold passage per evaluation set (written beside the index)."""
    from jaxrag.retrieval.retriever import build_corpus_index

    corpus = workdir / "world" / "corpus.jsonl" if is_embedded(cfg) else Path(cfg.retrieval.corpus)
    if not corpus.is_file():
        raise JaxragError(f"{corpus}: corpus not found (set --config.retrieval.corpus=/path/psgs_w100.tsv)")
    building, out = workdir / "index.building", workdir / "index"
    build_corpus_index(corpus, building, encoder=cfg.retrieval.encoder,
                       passage_embeddings=cfg.retrieval.passage_embeddings or None, overwrite=True)
    if is_embedded(cfg):
        recall = gold_passage_recall(cfg, workdir, building)
        (building / "retrieval_metrics.json").write_text(json.dumps(recall, indent=1) + "\n")
        print("  gold-passage recall:", json.dumps(recall))
    building.rename(out)
    return out


def gold_passage_recall(cfg: ConfigDict, workdir: Path, index_dir: Path) -> dict[str, float]:
    """recall@k of each evaluation question's gold passage (embedded world), for k = 5 and the
    number of passages the model reads (`retrieval.n_passages`)."""
    from jaxrag.retrieval.retriever import Retriever

    retriever = Retriever.load(index_dir, cfg.retrieval.encoder)
    ks, recall = sorted({5, int(cfg.retrieval.n_passages)}), {}
    for name in cfg.data.eval:
        examples = [e for _, e in dataset_items(cfg, workdir, [name], "test") if e.metadata.get("gold_passage_id")]
        if examples:
            hits = retriever.search([e.question for e in examples], max(ks))
            for k in ks:
                found = [e.metadata["gold_passage_id"] in {h.passage.id for h in hs[:k]} for e, hs in zip(examples, hits)]
                recall[f"{name}@{k}"] = sum(found) / len(found)
    return recall


def export_stage(cfg: ConfigDict, workdir: Path) -> Path:
    """The final SR-RAG model (stage 2) in Hugging Face format, with what routing needs beside
    the weights (`jaxrag.serve`: policy datastore, the tau eval used (`inference.tau` under the
    paper's protocol), k, index)."""
    from jaxrag.models.model import export_hf, load_model
    from jaxrag.pipeline_srrag import route_config
    from jaxrag.serve import write_serving_files

    tau = json.loads((workdir / "results.json").read_text())["config"]["thresholds"]["srrag"]

    def serving_files(out: Path) -> None:
        write_serving_files(out, workdir / "datastore", tau=tau, k=int(cfg.inference.k), route_cfg=route_config(cfg),
                            index_dir=workdir / "index", encoder=cfg.retrieval.encoder,
                            n_passages=int(cfg.retrieval.n_passages))

    return export_hf(load_model(workdir / "stage2" / "model"), workdir / "export", extra=serving_files)


def _stages():
    from jaxrag import pipeline_srrag as sr
    from jaxrag.data.construct import construct_done
    from jaxrag.eval.methods import eval_stage

    def exists(name):
        return lambda w: (w / name).exists()

    return [  # (name, stage, done(workdir))
        ("world", world_stage, exists("world")),
        ("base", base_stage, exists("base")),
        ("index", index_stage, exists("index")),
        ("construct", sr.construct_stage, lambda w: construct_done(w / "construct")),
        ("stage1", sr.stage1_stage, exists("stage1/model")),
        ("stage2", sr.stage2_stage, exists("stage2/model")),
        ("datastore", sr.datastore_stage, exists("datastore")),
        ("baselines", sr.baselines_stage, sr.baselines_done),
        ("eval", eval_stage, exists("results.json")),
        ("export", export_stage, exists("export")),
    ]


def preflight(cfg: ConfigDict) -> None:
    """Real-model configs stop at once, before any work, when the weights are not at hand or a
    dataset file is wrong or smaller than the mixture's counts (`data.check`)."""
    if is_embedded(cfg):
        return
    from jaxrag.models.model import resolve_model_dir

    try:
        resolve_model_dir(cfg.model.path)
    except JaxragError as e:
        raise JaxragError(f"{e}. Download the weights and pass --config.model.path=/path/to/hf_model_dir "
                          "(plus --config.retrieval.corpus=/path/psgs_w100.tsv and --config.data.paths.NAME=/path per dataset)") from None
    from jaxrag.data.check import check_data

    check_data(cfg)  # every row of every dataset, and Table 5's counts against the files: before `base`


# Stages that run the decoder's programs (`jaxrag.plan_programs`): before the first of them runs,
# every program must fit in device (accelerators) or host (CPU) memory.
DECODER_STAGES = ("construct", "stage1", "stage2", "datastore", "baselines", "eval")


def check_fit_before(cfg: ConfigDict, names, steps) -> None:
    if is_embedded(cfg) or all(s.action in ("skip", "adopt") for n, s in zip(names, steps) if n in DECODER_STAGES):
        return
    from jaxrag.plan_fit import check_fit

    check_fit(cfg)  # every program fits, or stop now with the setting to change (jaxrag.plan)


def run(cfg: ConfigDict, workdir: Path, user_set=()) -> dict[str, Path]:
    """Runs the stages in order (up to `pipeline.stop_after`). Each stage's inputs are recorded in
    `W/inputs/<stage>.json` before it runs (`jaxrag.provenance`); a finished stage built from the
    same inputs is skipped, stale eval / export are redone, an earlier stale stage stops the run
    before anything is done. `user_set`: fields set on the command line (`config_check`)."""
    from jaxrag import provenance
    from jaxrag.config_check import check_config

    check_config(cfg, user_set)
    workdir = Path(workdir)
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
    check_fit_before(cfg, names, steps)
    workers = _workers(cfg)
    workdir.mkdir(parents=True, exist_ok=True)
    leader = _is_leader()

    def stage_task(i: int, name: str, stage, step):
        head = f"[{i}/{len(stages)}] {name}:"

        def go():
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
            stage(cfg, workdir)
            print(f"{head} finished in {time.perf_counter() - start:.0f}s", flush=True)
        return go, tuple(u for u in provenance.STAGES[name].upstream if u in names)

    # A stage starts once the stages it reads are done (index beside base, the baselines beside
    # stage 2 and the datastore), `pipeline.workers` at once (`jaxrag.lanes`); eval reads every
    # stage before it, so its latency is measured with nothing beside it.
    lanes.run_graph({name: stage_task(i, name, stage, step)
                     for i, ((name, stage, _), step) in enumerate(zip(stages, steps), 1)}, workers)
    if (workdir / "report.md").is_file() and (not stop_after or stop_after in ("eval", "export")):
        print((workdir / "report.md").read_text(encoding="utf-8"), flush=True)
    return {name: workdir / name for name in names}


def _workers(cfg: ConfigDict) -> int:
    import jax

    workers = int(cfg.pipeline.workers)
    if workers < 1:
        raise JaxragError(f"--config.pipeline.workers={workers}: must be at least 1")
    if workers > 1 and jax.process_count() > 1:
        raise JaxragError(f"--config.pipeline.workers={workers}: the {jax.process_count()} processes of a multi-host "
                          "run must issue their collectives in one order; set --config.pipeline.workers=1")
    return workers


def _is_leader() -> bool:
    """Process 0 writes the records and removes stale outputs (on a shared filesystem)."""
    import jax

    return jax.process_index() == 0


def _remove(workdir: Path, outputs) -> None:
    """A stage's outputs, before it is redone from scratch (checkpoints and shards included)."""
    for rel in outputs:
        path = workdir / rel
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
