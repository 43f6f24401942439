"""Token lengths of real GenRead round-2 prompts, against what `jaxrag.plan` assumes for them.

    python -m benchmarks.genread_prompts --model W/base --data DATA [--questions 96] [--json OUT]

Runs the construct stage's own GenRead round 1 (greedy, zero-shot, up to `--new` tokens, the
paper's 150) with a real model on the training questions of `examples/real_data.py`'s files,
clusters them into the paper's k-means pools (5 clusters), then builds every question's n = 5
round-2 prompts with the paper's 5 demonstrations each (`construct.genread_prompt`) and reports
their token lengths beside the planner's assumption, (demos + 1) x (verbalize_max_tokens + 48),
and the cache slots each gets (`decode.sampler.bucket`).
"""

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from jaxrag.data.construct import ConstructParams, Item, prepare_items
from jaxrag.data.construct_genread import genread_pools, genread_prompt, is_ambiguous
from jaxrag.data.loaders import load_dataset_examples
from jaxrag.decode import sampler
from jaxrag.models.model import load_model
from jaxrag.models.encoder_io import load_encoder

TRAIN = {"nq": "nq.jsonl", "fever": "fever.jsonl", "obqa": "obqa.jsonl", "arc_easy": "ARC-Easy-Train.jsonl",
         "wow": "wow.jsonl", "asqa": "ASQA.json"}


def prompt_lengths(model, items: list[Item], params: ConstructParams, encoder, seed: int = 0) -> list[int]:
    with tempfile.TemporaryDirectory() as tmp:
        pools = genread_pools(model, [items], [0], Path(tmp), encoder, params, seed, 0)
    lengths = []
    for it in items:
        pool = pools.get(it.dataset)
        for j in range(params.n_contexts):
            demos = pool.demos_for(it.example.id, j, params.demos_per_cluster, seed, it.dataset) if pool else []
            ids, _ = genread_prompt(model.tokenizer, it.question, is_ambiguous(it.dataset, it.example), demos)
            lengths.append(len(ids))
    return lengths


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a converted model (the pipeline's W/base)")
    parser.add_argument("--data", required=True, help="examples/real_data.py's output folder")
    parser.add_argument("--questions", type=int, default=96, help="training questions, spread over the datasets")
    parser.add_argument("--new", type=int, default=150, help="round-1 document tokens (the paper: 150)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    data = Path(args.data)
    per = -(-args.questions // len(TRAIN))
    examples = [(name, ex) for name, file in TRAIN.items() for ex in load_dataset_examples(name, data / file)[:per]]
    items, _ = prepare_items(examples)
    params = ConstructParams(verbalize_max_tokens=args.new, generate_batch_size=16)
    model = load_model(args.model)
    lengths = np.array(prompt_lengths(model, items, params, load_encoder("minilm")))
    assumed = (params.demos_per_cluster + 1) * (params.verbalize_max_tokens + 48)
    out = {"model": args.model, "questions": len(items), "prompts": int(lengths.size),
           "demos_per_prompt": params.demos_per_cluster, "document_tokens": params.verbalize_max_tokens,
           "tokens": {"mean": float(lengths.mean()), "p50": float(np.percentile(lengths, 50)),
                      "p95": float(np.percentile(lengths, 95)), "max": int(lengths.max())},
           "planner_assumes": assumed, "planner_slots": sampler.bucket(assumed),
           "slots_of_p95": sampler.bucket(int(np.percentile(lengths, 95)))}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
