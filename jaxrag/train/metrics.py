"""Training metrics: `metrics.jsonl` in the run directory, TensorBoard events, a tqdm bar.

Only process 0 writes. On resume, records past the restored step are dropped from
`metrics.jsonl` (rewritten atomically) and TensorBoard purges its events past that step, so a
resumed run's logs read like an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from pathlib import Path

import jax
from tqdm.auto import tqdm

METRICS_FILE = "metrics.jsonl"


def _keep_until(path: Path, step: int) -> None:
    if not path.is_file():
        return
    lines = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= step]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write("".join(l + "\n" for l in lines))
    os.replace(tmp, path)


class MetricsLogger:
    def __init__(self, workdir: Path, name: str, total_steps: int, start_step: int):
        self.name, self.active = name, jax.process_index() == 0
        self.path = Path(workdir) / METRICS_FILE
        self.writer, self.bar = None, None
        if not self.active:
            return
        _keep_until(self.path, start_step)
        try:
            # lazy: tensorboardX: only when TensorBoard logs are written
            from tensorboardX import SummaryWriter
            self.writer = SummaryWriter(str(Path(workdir) / "tensorboard"), purge_step=start_step + 1)
        except ImportError:  # an optional extra: the JSONL log is the record
            warnings.warn("tensorboardX is not installed: metrics go to metrics.jsonl only", stacklevel=2)
        self.bar = tqdm(total=total_steps, initial=start_step, desc=name, unit="step", dynamic_ncols=True)

    def log(self, step: int, values: dict) -> None:
        """One record per logged step; `values` are Python scalars."""
        if not self.active:
            return
        record = {"step": step, "task": self.name, **{k: _clean(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.writer.add_scalar(f"{self.name}/{k}", v, step)
        self.bar.set_postfix(loss=f"{values.get('loss', float('nan')):.4g}", refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def message(self, text: str) -> None:
        if self.active:
            tqdm.write(f"{self.name}: {text}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()


def _clean(v):
    # JSON has no NaN: a diverged loss is recorded as a string so the file stays parseable.
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v
