"""GGUF files (llama.cpp's format) -> a plain Hugging Face directory, via transformers' GGUF loader.

transformers reads a GGUF file's metadata into an HF config and tokenizer (chat template
included) and dequantizes every tensor to float32. `to_hf_dir` writes those as config.json,
safetensors and tokenizer files, so `load_model("model.gguf")` loads a GGUF model through the
same checks as any other checkpoint. Quantized weights are dequantized once: the jaxrag model
is a float model with the quantized model's values (its logits equal transformers' own GGUF
load), not a quantized one. `converted` keeps that directory in a cache keyed by the file's
contents (`JAXRAG_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxrag`, else `~/.cache/jaxrag`), as the hub's
downloads are kept: a second load of the same file, or every process of a multi-process run after
the first, reads it instead of dequantizing again (one process converts while the others wait on
a file lock).

Families: the GGUF architectures that both transformers and jaxrag's decoder implement, i.e.
llama, qwen2 and phi3. Needs the optional packages `gguf`, `accelerate` and torch
(`pip install 'jaxrag[gguf]'`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import filelock

from jaxrag.errors import JaxragError
from jaxrag.models.families import FAMILIES
from jaxrag.models.hf import write_hf_tensors

SUFFIX = ".gguf"
# GGUF `general.architecture` -> transformers model_type, for the families jaxrag implements.
ARCHITECTURES = {f.gguf: name for name, f in FAMILIES.items() if f.gguf}
_DROPPED_CONFIG_KEYS = ("quantization_config", "_name_or_path")  # the export is a plain float model


def find_gguf(path) -> Path | None:
    """`path` if it names a .gguf file; the single .gguf file of a directory that is not an HF
    directory (no config.json); None otherwise."""
    p = Path(path)
    if p.suffix.lower() == SUFFIX:
        if not p.is_file():
            raise JaxragError(f"{p}: no such GGUF file")
        return p
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(f for f in p.iterdir() if f.suffix.lower() == SUFFIX and f.is_file())
    if len(files) > 1:
        raise JaxragError(f"{p}: {len(files)} GGUF files ({', '.join(f.name for f in files)}); pass one of them")
    return files[0] if files else None


def _require_packages() -> None:
    missing = [name for name in ("gguf", "accelerate", "torch") if importlib.util.find_spec(name) is None]
    if missing:
        raise JaxragError(f"GGUF import needs the packages {', '.join(missing)}: pip install 'jaxrag[gguf]' "
                          "(torch: the CPU wheel is enough)")


def architecture(path: Path) -> tuple[str, str]:
    """(GGUF `general.architecture`, `general.name`) from the file's metadata (read, not loaded)."""
    _require_packages()
    # lazy: gguf: an optional package, needed only to read a .gguf file
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:  # bad magic, truncated file
        raise JaxragError(f"{path}: not a readable GGUF file ({e})") from None

    def field(key: str) -> str:
        f = reader.get_field(key)
        return "" if f is None else str(f.contents())

    arch = field("general.architecture")
    if not arch:
        raise JaxragError(f"{path}: GGUF metadata has no general.architecture")
    return arch, field("general.name")


def check_supported(path: Path) -> str:
    """The transformers model_type of a GGUF file; a clear error for any other architecture."""
    arch, name = architecture(path)
    supported = ", ".join(ARCHITECTURES)
    # transformers reads a llama-architecture file whose name says mistral as Mistral.
    if arch not in ARCHITECTURES or (arch == "llama" and "mistral" in name.lower()):
        shown = "llama (Mistral)" if arch == "llama" else arch
        raise JaxragError(f"{path}: GGUF architecture {shown!r} is not supported (jaxrag imports {supported})")
    return ARCHITECTURES[arch]


def load_transformers(path) -> tuple:
    """(torch model, tokenizer) as transformers loads the GGUF file: dequantized to float32."""
    path = Path(path)
    check_supported(path)
    # lazy: torch: only the GGUF/encoder conversion path needs it, and it takes seconds to import
    import torch
    # lazy: transformers: only this conversion path needs it, and it takes seconds to import
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, OSError, KeyError, NotImplementedError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise JaxragError(f"{path}: transformers could not read this GGUF file ({reason})") from None
    return model, tokenizer


def plain_config(config):
    """The HF config of a GGUF-loaded model without its GGUF quantization entry, so that
    `from_pretrained` on the written directory reads plain float safetensors."""
    # lazy: transformers: only this conversion path needs it, and it takes seconds to import
    import transformers

    values = {k: v for k, v in config.to_dict().items() if k not in _DROPPED_CONFIG_KEYS}
    return transformers.AutoConfig.for_model(**values)


def cache_root() -> Path:
    """Where jaxrag keeps what it can rebuild: `JAXRAG_CACHE_DIR`, else the XDG cache directory."""
    if root := os.environ.get("JAXRAG_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxrag"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()[:20]


def converted(path) -> Path:
    """The HF directory of the GGUF file `path` (`to_hf_dir`), converted once per file contents
    into `cache_root()/gguf/` and read from there afterwards. The directory appears whole or not
    at all (written beside it, then renamed); concurrent callers convert it once."""
    path = Path(path)
    check_supported(path)
    root = cache_root() / "gguf"
    out = root / f"{path.stem}-{_digest(path)}"
    if (out / "config.json").is_file():
        return out
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JaxragError(f"{root}: cannot create the GGUF conversion cache ({e.strerror}); set JAXRAG_CACHE_DIR "
                          "to a writable directory") from None
    with filelock.FileLock(str(out) + ".lock"):
        if not (out / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=root))
            try:
                to_hf_dir(path, tmp / "hf")
                shutil.rmtree(out, ignore_errors=True)  # an incomplete entry, e.g. a user's half-deleted one
                os.replace(tmp / "hf", out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def to_hf_dir(path, out, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Writes the GGUF file `path` as a Hugging Face directory `out`; returns `out`."""
    model, tokenizer = load_transformers(path)
    return write_hf_dir(model, tokenizer, out, max_shard_bytes)


def write_hf_dir(model, tokenizer, out, max_shard_bytes: int = 5 * 2**30) -> Path:
    """A GGUF-loaded transformers model + tokenizer -> HF directory `out` (float32 safetensors,
    config.json, tokenizer files with the chat template).

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the config (minus its
    quantization entry) and the dequantized state dict are written directly."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = plain_config(model.config)
    config.save_pretrained(out)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {name: t.detach().numpy() for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    write_hf_tensors(tensors, out, max_shard_bytes)
    tokenizer.save_pretrained(out)
    return out
