"""`python -m jaxrag.train --config configs/qwen.py[:tiny] --workdir DIR [--config.x.y=v ...]`

Runs the SR-RAG pipeline (`jaxrag.pipeline`), skipping stages whose artifact already exists.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrag.cli import run

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<model>.py[:tiny]", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (stages are cached here)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax/absl INFO lines would bury the progress
    from jaxrag import pipeline
    from jaxrag.sharding import initialize_distributed

    initialize_distributed()
    run(lambda: pipeline.run(_CONFIG.value, _WORKDIR.value))


if __name__ == "__main__":
    app.run(main)
