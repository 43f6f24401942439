"""Run by tests/test_placement.py: reruns the generation stages of a trained miniature workdir
(construct, the datastore, the baselines' datastores, eval) with the real stage functions, on
this process's devices (XLA_FLAGS sets how many).

    python tests/generation_layout.py WORKDIR

It first removes the stages' outputs, and ends with one JSON line:
{"placement": {...}, "seconds": {stage: s}}.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_fixtures import mini_config  # noqa: E402

from jaxrag.pipeline import workdir as workdir_mod  # noqa: E402
from jaxrag.pipeline.construct import construct_stage  # noqa: E402
from jaxrag.pipeline.datastore import build_policy_datastore, datastore_stage  # noqa: E402
from jaxrag.pipeline.eval import eval_stage  # noqa: E402
from jaxrag.train.stages import FINAL  # noqa: E402

OUTPUTS = ("construct", "datastore", "baselines/no_kv_label_datastore", "baselines/no_dpo_datastore",
           "results.json", "report.md", "plots", "eval_parts")
ABLATIONS = ("no_kv_label", "no_dpo")


def main(workdir: Path) -> None:
    cfg = mini_config()
    for rel in OUTPUTS:
        path = workdir / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    seconds = {}

    def baselines_datastores(cfg, workdir):
        records = workdir_mod.construct_records(workdir)
        for name in ABLATIONS:
            build_policy_datastore(cfg, workdir / "baselines" / name / FINAL, records,
                                   workdir / "baselines" / f"{name}_datastore")

    for name, stage in (("construct", construct_stage), ("datastore", datastore_stage),
                        ("baselines", baselines_datastores), ("eval", eval_stage)):
        start = time.perf_counter()
        stage(cfg, workdir)
        seconds[name] = round(time.perf_counter() - start, 1)
    print(json.dumps({"placement": workdir_mod.PLACEMENT, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
