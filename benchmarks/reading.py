"""How fast reading comprehension emerges in the embedded default's tiny model: trains it from
scratch on the world's fresh reading-comprehension documents alone (`world_pretrain.
reading_comprehension`, loss on the answers) and every `--every` steps measures greedy accuracy
on held-out single-passage fact questions about fresh entities. Prints one JSON object per
evaluation (JSON lines), then a summary.

    python -m benchmarks.reading [--steps 600] [--every 100] [--lr 2e-3] [--hidden 128]

This is the probe for the base stage's unmet target (gold passage tail >= 0.8): copying must
switch on here, cheaply, before the base budget is spent on it.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxrag import sharding
from jaxrag.models.model import Model
from jaxrag.pipeline.base import _tiny_model
from jaxrag.pipeline.config import tiny_config
from jaxrag.prompts import base_prompt_text
from jaxrag.train import losses
from jaxrag.train.batches import TextData
from jaxrag.train.trainer import TrainSpec, make_optimizer, make_train_step, state_shardings
from jaxrag.world import pretrain as wp
from jaxrag.world.entities import NameMaker
from jaxrag.world.generate import WorldConfig, generate_world, write_world
from jaxrag.world.probe import _answers, answer_scores, fresh_reading_questions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--lr", type=float, default=None, help="default: the config's pretraining lr")
    ap.add_argument("--batch", type=int, default=None, help="default: the config's pretraining batch")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default: the tiny config's)")
    ap.add_argument("--docs-per-epoch", type=int, default=400)
    ap.add_argument("--questions", type=int, default=120)
    args = ap.parse_args()

    cfg = tiny_config("qwen2")
    if args.hidden:
        cfg.model.arch.hidden_size = args.hidden
    world = generate_world(WorldConfig(**cfg.world.to_dict()))
    with tempfile.TemporaryDirectory() as tmp:
        write_world(world, Path(tmp) / "world")
        model = _tiny_model(cfg, Path(tmp))

    def documents(epoch: int) -> list:
        rng = random.Random(f"bench_reading:{epoch}")
        examples = wp.reading_comprehension(world, args.docs_per_epoch, NameMaker(rng, world.reserved_words()), rng)
        return [wp.knowledge_text(ex.prompt_question(), ex.metadata["passages"], ex.golden_answers[0])
                + wp.followups(ex.metadata["followups"]) for ex in examples]

    batch = args.batch or int(cfg.pretrain.batch_size)
    spec = TrainSpec("reading", batch, args.lr or float(cfg.pretrain.lr), args.steps,
                     warmup_ratio=float(cfg.pretrain.warmup_ratio), weight_decay=float(cfg.pretrain.weight_decay))
    data = TextData(documents, model.tokenizer, int(cfg.model.max_length), int(cfg.seed))
    mesh = sharding.make_mesh(cfg.mesh)
    graphdef, _ = nnx.split(model.decoder)
    _, shardings = state_shardings(model.decoder, spec, mesh)
    params = sharding.place(nnx.to_pure_dict(nnx.state(model.decoder)), shardings["params"])
    state = {"params": params, "opt": jax.jit(make_optimizer(spec).init, out_shardings=shardings["opt"])(params),
             "step": sharding.place(np.int32(0), shardings["step"])}
    step_fn = make_train_step(graphdef, losses.lm_objective, spec, mesh, shardings, 1)
    questions = fresh_reading_questions(world, args.questions)

    def evaluate(params) -> dict:
        trained = Model(nnx.merge(graphdef, params), model.tokenizer, model.hf_config, model.sources)
        answers = _answers(trained, [base_prompt_text(q, p) for q, p, _ in questions])
        return answer_scores(answers, [a for *_, a in questions], [p[0] for _, p, _ in questions])

    curve, recent, step, epoch, start = [], [], 0, 0, time.time()
    while step < args.steps:
        for rows in data.order(epoch, batch):
            state, metrics = step_fn(state, data.rows(rows, epoch), {})
            step += 1
            recent.append(float(metrics["loss"]))
            if step % args.every == 0 or step == args.steps:
                point = {"step": step, "answer_loss": round(float(np.mean(recent)), 3),
                         **{k: round(v, 3) for k, v in evaluate(state["params"]).items()},
                         "seconds": round(time.time() - start)}
                curve.append(point)
                recent = []
                print(json.dumps(point), flush=True)
            if step >= args.steps:
                break
        epoch += 1
    print(json.dumps({"bench": "reading", "hidden_size": int(cfg.model.arch.hidden_size), "lr": spec.lr,
                      "batch": batch, "steps": args.steps, "final_accuracy": curve[-1]["accuracy"],
                      "best_accuracy": max(p["accuracy"] for p in curve), "curve": curve}))


if __name__ == "__main__":
    main()
