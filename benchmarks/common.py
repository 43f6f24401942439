"""What the peer benchmarks share: the Qwen2 config they compare on, CLI and JSON conventions,
and the record of where a number was measured (device, library versions, load average)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import jax
import transformers

# The comparison model of issue 22: Qwen2 shapes, small enough for a CPU.
ARCH = dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, vocab=8192)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_common_args(parser: Parser, arch: dict = ARCH) -> None:
    parser.add_argument("--json", required=True, metavar="OUT", help="where to write the result (JSON)")
    g = parser.add_argument_group("model (Qwen2; defaults are the benchmark's)")
    for name, value in arch.items():
        g.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=value)


def check_arch(parser: Parser, args) -> dict:
    arch = {name: getattr(args, name) for name in ARCH}
    if arch["hidden"] % arch["heads"]:
        parser.error(f"--hidden {arch['hidden']} is not a multiple of --heads {arch['heads']}")
    if arch["heads"] % arch["kv_heads"]:
        parser.error(f"--heads {arch['heads']} is not a multiple of --kv-heads {arch['kv_heads']}")
    out = Path(args.json)
    if not out.parent.is_dir():
        parser.error(f"--json {out}: directory {out.parent} does not exist")
    return arch


def qwen2_config(arch: dict, max_positions: int) -> transformers.Qwen2Config:
    """The transformers config both sides are built from (so they are the same model)."""
    return transformers.Qwen2Config(
        vocab_size=arch["vocab"], hidden_size=arch["hidden"], intermediate_size=arch["intermediate"],
        num_hidden_layers=arch["layers"], num_attention_heads=arch["heads"],
        num_key_value_heads=arch["kv_heads"], max_position_embeddings=max_positions,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def environment() -> dict:
    """Where the numbers come from: the machine, the versions, the code (`code_identity`: commit and
    whether the tree was dirty) and the load average, which matters on a shared CPU. Call it before
    measuring: `load_avg_start` is read here."""
    import torch

    from jaxrag.pipeline.provenance import code_identity

    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": dev.device_kind, "devices": jax.device_count(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "jax": jax.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "code": code_identity(), "load_avg_start": load_average()}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def median(values) -> float:
    return float(statistics.median(values))


def write_json(path: str | os.PathLike, result: dict) -> None:
    """Writes `result` to a temp file next to `path`, then renames it: never a half-written file."""
    path = Path(path)
    result["load_avg_end"] = load_average()  # in place: the caller returns what was written
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(json.dumps(result, indent=1))
