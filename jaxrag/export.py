"""`python -m jaxrag.export --checkpoint CKPT --out DIR [--dtype bfloat16] [--max-shard-size 5GB]`

jaxrag checkpoint -> Hugging Face directory (config.json, safetensors, tokenizer with the added
tokens, generation_config.json) for `AutoModelForCausalLM.from_pretrained(DIR)`.
"""

from __future__ import annotations

import argparse
import re

from jaxrag.cli import run
from jaxrag.errors import JaxragError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (HF's convention), '500MiB', '1024'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise JaxragError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MiB or 1024")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxrag.export", description=__doc__)
    parser.add_argument("--checkpoint", required=True, help="jaxrag checkpoint directory")
    parser.add_argument("--out", required=True, help="HF directory to create")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the params' own)")
    parser.add_argument("--max-shard-size", default="5GB", help="shard safetensors past this size")
    args = parser.parse_args(argv)

    def export():
        from jaxrag.models.model import export_hf, load_model

        shard = parse_size(args.max_shard_size)
        export_hf(load_model(args.checkpoint), args.out, max_shard_bytes=shard, dtype=args.dtype)
        print(f"wrote {args.out}")

    run(export)


if __name__ == "__main__":
    main()
