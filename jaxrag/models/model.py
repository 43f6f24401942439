"""The public model: a decoder + its tokenizer + the HF config it round-trips to.

`load_model(path)` reads either a Hugging Face directory (config.json + safetensors), a hub
name when the network allows, a jaxrag checkpoint (orbax params + the same json/tokenizer
files), or a GGUF file / a directory holding one (`jaxrag.models.gguf`). `save_model` / `export_hf` write the two formats atomically (temp dir, then rename).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp
import transformers
from flax import nnx

from jaxrag.runtime import concurrency
from jaxrag.errors import JaxragError
from jaxrag.models import gguf, hf
from jaxrag.models.decoder import Decoder, DecoderConfig, resolve_dtype, stack_layers, unstack_layers
from jaxrag.models.lora import merge_lora
from jaxrag.models.masks import positions_from_mask
from jaxrag.models.params import abstract_decoder, build_decoder, host_params
from jaxrag.models.tokens import DEFAULT_SOURCES, add_srrag_tokens, sources_in_tokenizer, srrag_tokens

JAXRAG_META = "jaxrag.json"  # marks a jaxrag checkpoint: sources, token ids, dtypes
PARAMS_DIR = "params"


@dataclasses.dataclass
class Model:
    decoder: Decoder
    tokenizer: transformers.PreTrainedTokenizerBase
    hf_config: transformers.PretrainedConfig
    sources: tuple[str, ...] = ()  # knowledge sources whose tokens were added ((): none yet)

    @property
    def config(self) -> DecoderConfig:
        return self.decoder.cfg

    def logits(self, ids, attention_mask=None) -> jax.Array:
        """ids int [batch, seq] -> float32 [batch, seq, vocab] (vocab padding sliced off)."""
        logits, _ = _forward(self.decoder, jnp.asarray(ids), _mask(ids, attention_mask), None)
        return logits[..., : self.config.vocab_size]

    def hidden_states(self, ids, layer: int, attention_mask=None) -> jax.Array:
        """Output of decoder layer `layer` (1-based; transformers' `hidden_states[layer]`)."""
        if not 0 <= layer <= self.config.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.config.num_layers}")
        _, hidden = _forward(self.decoder, jnp.asarray(ids), _mask(ids, attention_mask), layer)
        return hidden

    def token_id(self, token: str) -> int:
        ids = self.tokenizer.convert_tokens_to_ids([token])
        if ids[0] is None or ids[0] == self.tokenizer.unk_token_id:
            raise JaxragError(f"token {token!r} is not in the tokenizer")
        return ids[0]


def _mask(ids, attention_mask) -> jax.Array:
    return jnp.ones(np.shape(ids), bool) if attention_mask is None else jnp.asarray(attention_mask, bool)


@nnx.jit(static_argnums=(3,))
def _forward(decoder: Decoder, ids, mask, layer):
    out = decoder(ids, positions_from_mask(mask), mask, hidden_layer=layer)
    return out.logits, out.hidden


def pad_vocab(params: dict, cfg: DecoderConfig) -> dict:
    """Zero rows up to the padded vocab; their logits are masked, so real logits are unchanged."""
    pad = cfg.padded_vocab_size - params["embed"].shape[0]
    params["embed"] = np.pad(params["embed"], ((0, pad), (0, 0)))
    if "lm_head" in params:
        params["lm_head"] = np.pad(params["lm_head"], ((0, 0), (0, pad)))
    return params


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(model_dir: Path) -> str | None:
    config = model_dir / "tokenizer_config.json"
    try:
        return json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    except json.JSONDecodeError as e:
        raise JaxragError(f"{config}: not valid JSON ({e})") from None


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        raise JaxragError(f"{model_dir}: no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    try:
        # A generic tokenizer (`tokenizer.json` alone: the embedded world's, saved by transformers
        # 5 as `TokenizersBackend`) loads as itself. AutoTokenizer would build the config's
        # model-type class instead (`Qwen2Tokenizer` for a tiny qwen2, which swaps in Qwen2's
        # pre-tokenizer: "1827" became four digit tokens the model never saw, and on some world
        # seeds every reloaded model read passages at ~0.1 where the in-memory one read 0.9).
        if _tokenizer_class(model_dir) in _GENERIC_TOKENIZERS:
            return transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        return transformers.AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as e:
        raise JaxragError(f"{model_dir}: no usable tokenizer (tokenizer.json / tokenizer_config.json): {e}") from None


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A local directory (or GGUF file), or a hub name downloaded when the network allows."""
    if gguf.find_gguf(path) is not None:
        return Path(path)
    local = Path(path)
    hub_like = str(path).count("/") == 1 and not str(path).startswith((".", "/", "~"))
    if local.exists() or not hub_like:
        if not local.is_dir():
            raise JaxragError(f"{path}: no such directory")
        return local
    try:
        # lazy: huggingface_hub: only a download from the hub needs it
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except Exception as e:  # network, auth, missing repo: all mean "not available here"
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise JaxragError(f"{path}: not a local directory and could not be fetched from the hub ({reason})") from None


def for_inference(model: Model) -> Model:
    """The model as generation reads it fastest: LoRA adapters merged into their weights (once,
    here, not per token), and each layer's weights in buffers of their own (`unstack_layers`), so
    a decode step reads every weight byte once. Same outputs; not for training (which keeps the
    adapters and the stacked layers)."""
    merged = merge_lora(model)
    return Model(unstack_layers(merged.decoder), merged.tokenizer, merged.hf_config, merged.sources)


def load_model(path, *, dtype: str = "float32", param_dtype: str = "float32", inference: bool = False) -> Model:
    """HF directory / hub name / jaxrag checkpoint / GGUF -> Model. `dtype` = compute dtype ('auto' ok).
    `inference`: the model as `for_inference` makes it (generation, scoring, serving; not training)."""
    if inference:
        return for_inference(load_model(path, dtype=dtype, param_dtype=param_dtype))
    if (gguf_file := gguf.find_gguf(path)) is not None:  # dequantized once into the conversion cache
        return load_model(gguf.converted(gguf_file), dtype=dtype, param_dtype=param_dtype)
    model_dir = resolve_model_dir(path)
    hf_config = hf.read_hf_config(model_dir)
    cfg = hf.decoder_config(hf_config, dtype=dtype, param_dtype=param_dtype)
    meta_path = model_dir / JAXRAG_META
    tokenizer = _load_tokenizer(model_dir)
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if lora := meta.get("lora"):  # adapters beside the base weights (`jaxrag.models.lora`)
            cfg = dataclasses.replace(cfg, lora_rank=int(lora["rank"]), lora_alpha=float(lora["alpha"]),
                                      lora_targets=tuple(lora["targets"]))
        params = _restore_params(model_dir / PARAMS_DIR, cfg)
        return Model(build_decoder(cfg, params), tokenizer, hf_config, tuple(meta["sources"]))
    params = hf.hf_to_params(hf.read_hf_tensors(model_dir, cfg), cfg, resolve_dtype(param_dtype))
    return Model(build_decoder(cfg, pad_vocab(params, cfg)), tokenizer, hf_config, sources_in_tokenizer(tokenizer))


def add_special_tokens(model: Model, sources: Sequence[str] = DEFAULT_SOURCES) -> Model:
    """Adds `<EOQ>`, the source tokens and `<EOK>` to tokenizer and embeddings.

    New rows (embedding and lm_head) = the mean of the existing real-token rows, so the new
    tokens start as an "average" token instead of noise. Ids that already fit inside the
    config's vocab (Qwen's unused padding rows) are reused; otherwise the vocab grows.
    A model that has SR-RAG tokens may be given another source set (Selective RAG's
    {wiki, none}): tokens it already has keep their trained rows.
    """
    tok = model.tokenizer
    known, vocab = len(tok), tok.get_vocab()
    present = {t for t in srrag_tokens(sources) if t in vocab}
    ids = [i for t, i in zip(srrag_tokens(sources), add_srrag_tokens(tok, sources)) if t not in present]
    if not ids:
        return Model(model.decoder, tok, model.hf_config, tuple(sources))
    cfg = model.config
    new_vocab = max(cfg.vocab_size, max(ids) + 1)
    new_cfg = dataclasses.replace(cfg, vocab_size=new_vocab)
    params = host_params(model.decoder)
    params["embed"] = params["embed"][: cfg.vocab_size]
    if "lm_head" in params:
        params["lm_head"] = params["lm_head"][:, : cfg.vocab_size]
    params = pad_vocab(params, new_cfg)
    real = min(known, cfg.vocab_size)
    params["embed"][ids] = params["embed"][:real].mean(axis=0)
    if "lm_head" in params:
        params["lm_head"][:, ids] = params["lm_head"][:, :real].mean(axis=1, keepdims=True)
    hf_config = transformers.AutoConfig.for_model(**{**model.hf_config.to_dict(), "vocab_size": new_vocab})
    return Model(build_decoder(new_cfg, params), tok, hf_config, tuple(sources))


@contextmanager
def atomic_dir(out: Path):
    """Yields a temp dir beside `out`; renames it to `out` only if the block succeeds.

    On a multi-host run every process gets the same temp dir (orbax writes params from all of
    them); process 0 alone renames it, after all processes are done."""
    out = Path(out)
    if out.exists():
        raise JaxragError(f"{out}: already exists (refusing to overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    multihost = jax.process_count() > 1
    if multihost:
        tmp = out.with_name(f".{out.name}.tmp-shared")
        tmp.mkdir(exist_ok=True)
    else:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if multihost:
            multihost_utils.sync_global_devices(f"jaxrag:write:{out}")
        if jax.process_index() == 0:
            tmp.rename(out)
    finally:
        if jax.process_index() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_hf_side_files(model: Model, out: Path, weights_dtype: str) -> None:
    if jax.process_index() != 0:
        return
    hf_config = copy.deepcopy(model.hf_config)
    # transformers >= 5 names it `dtype`, 4.x `torch_dtype`: the dtype from_pretrained loads in.
    setattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", weights_dtype)
    hf_config.save_pretrained(out)
    model.tokenizer.save_pretrained(out)
    gen = transformers.GenerationConfig.from_model_config(hf_config)
    if model.tokenizer.eos_token_id is not None:
        gen.eos_token_id = model.tokenizer.eos_token_id
    if model.tokenizer.pad_token_id is not None:
        gen.pad_token_id = model.tokenizer.pad_token_id
    gen.save_pretrained(out)


def save_model(model: Model, out) -> Path:
    """jaxrag checkpoint: HF config/tokenizer files + orbax params + jaxrag.json."""
    with atomic_dir(out) as tmp:
        _write_hf_side_files(model, tmp, model.config.param_dtype)
        state = nnx.to_pure_dict(nnx.state(stack_layers(model.decoder)))
        with concurrency.ORBAX, ocp.StandardCheckpointer() as ckptr:  # the save completes inside the lock
            ckptr.save((tmp / PARAMS_DIR).absolute(), state)
        meta = {"format": "jaxrag", "sources": list(model.sources),
                "special_tokens": {t: model.token_id(t) for t in srrag_tokens(model.sources)} if model.sources else {}}
        if model.config.lora_rank:
            c = model.config
            meta["lora"] = {"rank": c.lora_rank, "alpha": c.lora_alpha, "targets": list(c.lora_targets)}
        if jax.process_index() == 0:
            (tmp / JAXRAG_META).write_text(json.dumps(meta, indent=2))
    return Path(out)


def _restore_params(params_dir: Path, cfg: DecoderConfig) -> dict:
    _, abstract = abstract_decoder(cfg)
    # Whole on this process's first device, as a Hugging Face load is, and by this process alone
    # (no barrier with the others): a checkpoint saved by a multi-process run would otherwise come
    # back sharded over the processes that saved it, and every load would be a collective.
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), nnx.to_pure_dict(abstract))
    alone = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(), active_processes={jax.process_index()})
    try:
        with concurrency.ORBAX, ocp.StandardCheckpointer(multiprocessing_options=alone) as ckptr:
            return ckptr.restore(params_dir.absolute(), target)
    except (FileNotFoundError, ValueError) as e:
        raise JaxragError(f"{params_dir}: cannot restore params ({e})") from None


def export_hf(model: Model, out, max_shard_bytes: int = 5 * 2**30, dtype: str | None = None,
              extra: Callable[[Path], None] | None = None) -> Path:
    """A Hugging Face directory `AutoModelForCausalLM.from_pretrained` loads with no missing keys
    (LoRA adapters merged into their weights). `extra(dir)` adds files beside the HF ones
    (process 0, before the directory appears)."""
    model = merge_lora(model)
    params = host_params(model.decoder)
    tensors = hf.params_to_hf(params, model.config)
    if dtype is not None:
        tensors = {k: v.astype(jnp.dtype(dtype)) for k, v in tensors.items()}
    with atomic_dir(out) as tmp:
        _write_hf_side_files(model, tmp, str(next(iter(tensors.values())).dtype))
        if jax.process_index() == 0:
            hf.write_hf_tensors(tensors, tmp, max_shard_bytes)
            if extra is not None:
                extra(tmp)
    return Path(out)
