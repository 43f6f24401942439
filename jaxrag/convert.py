"""`python -m jaxrag.convert --hf DIR --out CKPT [--sources wiki self]`

Hugging Face directory (or hub name), or a GGUF file (or a directory holding one; dequantized
through transformers' GGUF loader, `pip install 'jaxrag[gguf]'`) -> jaxrag checkpoint with the
SR-RAG special tokens added.
"""

from __future__ import annotations

import argparse

from jaxrag.errors import run
from jaxrag.models.tokens import DEFAULT_SOURCES


def _sources(values: list[str]) -> list[str]:
    return [s for v in values for s in v.split(",") if s]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxrag.convert", description=__doc__)
    parser.add_argument("--hf", required=True, help="HF model directory, hub name, or GGUF file")
    parser.add_argument("--out", required=True, help="jaxrag checkpoint directory to create")
    parser.add_argument("--sources", nargs="+", default=list(DEFAULT_SOURCES),
                        help="knowledge sources, one token each (default: wiki self)")
    args = parser.parse_args(argv)

    def convert():
        # jax and transformers load once the command runs: --help and argument errors stay instant
        from jaxrag.models.model import add_special_tokens, load_model, save_model

        model = add_special_tokens(load_model(args.hf), _sources(args.sources))
        save_model(model, args.out)
        print(f"wrote {args.out} ({model.config.family}, vocab {model.config.vocab_size}, "
              f"sources {list(model.sources)})")

    run(convert)


if __name__ == "__main__":
    main()
