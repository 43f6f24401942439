"""`python -m jaxrag.train --config configs/qwen.py[:tiny] --workdir DIR [--config.x.y=v ...]`: the
documented name of the pipeline's command, `python -m jaxrag.pipeline` (`jaxrag/pipeline/__main__.py`)."""

from jaxrag.pipeline.__main__ import cli

if __name__ == "__main__":
    cli()
