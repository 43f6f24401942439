"""`python -m jaxrag.train --config configs/qwen.py[:tiny] --workdir DIR [--config.x.y=v ...]`

Runs the SR-RAG pipeline (`jaxrag.pipeline`): finished stages built from the same config are
skipped. A config mistake is one `error:` line and exit code 2 (`jaxrag.cli.ConfigFlag`).
"""

import sys

from absl import app, flags, logging

from jaxrag.cli import ConfigFlag, reuse_cpu_temporaries, run

reuse_cpu_temporaries()  # before jax is imported
_CONFIG = ConfigFlag()
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (stages are cached here)")
flags.mark_flags_as_required(["workdir"])


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected argument {argv[1]!r} (flags are --name=value)", file=sys.stderr)
        raise SystemExit(2)
    logging.set_verbosity(logging.WARNING)  # orbax/absl INFO lines would bury the progress
    from jaxrag import pipeline
    from jaxrag.sharding import initialize_distributed

    initialize_distributed()
    run(lambda: pipeline.run(_CONFIG.value, _WORKDIR.value, user_set=_CONFIG.user_set))


if __name__ == "__main__":
    app.run(main, flags_parser=_CONFIG.parse)
