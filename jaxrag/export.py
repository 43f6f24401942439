"""`python -m jaxrag.export --checkpoint CKPT --out DIR [--dtype bfloat16] [--max-shard-size 5GB] [--adapter]`

jaxrag checkpoint -> Hugging Face directory (config.json, safetensors, tokenizer with the added
tokens, generation_config.json) for `AutoModelForCausalLM.from_pretrained(DIR)`; LoRA adapters
are merged into their weights. With `--adapter` (a LoRA-trained checkpoint): a PEFT adapter
directory instead, for `peft.PeftModel.from_pretrained(base, DIR)` on the base converted with
the SR-RAG tokens (`jaxrag.models.peft_export`).
"""

from __future__ import annotations

import argparse
import re

from jaxrag.errors import JaxragError, run

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
    parser.add_argument("--adapter", action="store_true", help="write a PEFT LoRA adapter, not merged weights")
    args = parser.parse_args(argv)

    def export():
        # jax and transformers load once the command runs: --help and argument errors stay instant
        from jaxrag.models.model import export_hf, load_model
        from jaxrag.models.peft_export import export_adapter

        shard = parse_size(args.max_shard_size)
        model = load_model(args.checkpoint)
        if args.adapter:
            export_adapter(model, args.out)
        else:
            export_hf(model, args.out, max_shard_bytes=shard, dtype=args.dtype)
        print(f"wrote {args.out}")

    run(export)


if __name__ == "__main__":
    main()
