"""`python -m jaxrag.pipeline --config configs/qwen.py[:tiny] --workdir DIR [--config.x.y=v ...]`
(documented as `python -m jaxrag.train`, its alias)

Runs the SR-RAG pipeline (`jaxrag.pipeline.run`): finished stages built from the same config are
skipped. A config mistake is one `error:` line and exit code 2 (`jaxrag.pipeline.cli.ConfigFlag`).
"""

import sys

from absl import app, flags, logging

from jaxrag.errors import run
from jaxrag.pipeline.cli import ConfigFlag, patient_cpu_collectives, reuse_cpu_temporaries

reuse_cpu_temporaries()  # before jax is imported
patient_cpu_collectives()
_CONFIG = ConfigFlag()
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (stages are cached here)")
flags.mark_flags_as_required(["workdir"])


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected argument {argv[1]!r} (flags are --name=value)", file=sys.stderr)
        raise SystemExit(2)
    logging.set_verbosity(logging.WARNING)  # orbax/absl INFO lines would bury the progress
    # jax loads here, after reuse_cpu_temporaries() above and once the flags have parsed
    from jaxrag.pipeline import run as pipeline
    from jaxrag.runtime.join import initialize_distributed

    initialize_distributed()
    run(lambda: pipeline.run(_CONFIG.value, _WORKDIR.value, user_set=_CONFIG.user_set))


def cli() -> None:
    app.run(main, flags_parser=_CONFIG.parse)


if __name__ == "__main__":
    cli()
