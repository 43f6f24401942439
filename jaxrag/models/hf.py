"""Hugging Face checkpoints <-> jaxrag params: config.json, safetensors (single or sharded).

Every check names the file and what is wrong, raised as `JaxragError`, so a CLI can print one
line. Weights are read tensor by tensor with `safe_open` (a 7B checkpoint is never duplicated
whole in host memory beyond the target params).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import transformers
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxrag.errors import JaxragError
from jaxrag.models.decoder import DecoderConfig
from jaxrag.models.families import FAMILIES
from jaxrag.models.rope import ROPE_TYPES, RopeConfig

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def read_hf_config(model_dir: Path) -> transformers.PretrainedConfig:
    """config.json -> the transformers config object, with errors that name the file."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise JaxragError(f"{model_dir}: no such directory")
    if not path.is_file():
        raise JaxragError(f"{path}: missing (not a Hugging Face model directory)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise JaxragError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(raw, dict):
        raise JaxragError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise JaxragError(
            f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    try:
        return transformers.AutoConfig.for_model(**raw)
    except (TypeError, ValueError, KeyError) as e:
        raise JaxragError(f"{path}: invalid {model_type} config ({e})") from None


def _rope_parameters(hf: transformers.PretrainedConfig) -> dict:
    # transformers >= 5 standardises into `rope_parameters`; 4.x keeps `rope_scaling` + `rope_theta`.
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return params


def decoder_config(hf: transformers.PretrainedConfig, **overrides) -> DecoderConfig:
    """The static DecoderConfig of an HF config (`overrides`: dtype, param_dtype, ...): the fields
    every family shares read here, the family's own by its `families.FAMILIES` entry."""
    where = f"config.json ({hf.model_type})"
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise JaxragError(f"{where}: hidden_act {hf.hidden_act!r} is not supported (silu only)")
    if getattr(hf, "mlp_bias", False):
        raise JaxragError(f"{where}: mlp_bias=true is not supported")
    if getattr(hf, "use_sliding_window", False):
        raise JaxragError(f"{where}: use_sliding_window=true is not supported")
    rp = _rope_parameters(hf)
    rope_type = {"su": "longrope", None: "default"}.get(rp.get("rope_type", rp.get("type")), None)
    rope_type = rope_type or rp.get("rope_type", rp.get("type"))
    if rope_type not in ROPE_TYPES:
        raise JaxragError(f"{where}: rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    partial = rp.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0
    rope = RopeConfig(
        theta=float(rp["rope_theta"]),
        rotary_dim=int(head_dim * partial),
        rope_type=rope_type,
        factor=float(rp.get("factor") or 1.0),
        low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            rp.get("original_max_position_embeddings")
            or getattr(hf, "original_max_position_embeddings", None)
            or hf.max_position_embeddings
        ),
        max_position_embeddings=int(hf.max_position_embeddings),
        short_factor=tuple(rp.get("short_factor") or ()),
        long_factor=tuple(rp.get("long_factor") or ()),
        attention_factor=rp.get("attention_factor"),
    )
    return DecoderConfig(
        family=hf.model_type,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=int(hf.num_attention_heads),
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.rms_norm_eps),
        rope=rope,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        **FAMILIES[hf.model_type].traits(hf),
        **overrides,
    )


# --- tensor layout --------------------------------------------------------------------------
# A "mapping" pairs an HF tensor name (llama layout) with our param path, the layer it fills in
# our stacked layer params (None outside the layers) and the two layout transforms. A family's
# fused tensors (its `families` entry's `fused`) are split into/joined from the llama layout around it.


def _mappings(cfg: DecoderConfig) -> Iterator[tuple[str, tuple, int | None, Callable, Callable]]:
    e, n, kv, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = (lambda w: w, lambda w: w)
    linear = (lambda w: w.T, lambda w: w.T)  # torch Linear [out, in] <-> our [in, out]

    def heads_in(count):  # [count*h, e] <-> [e, count, h]
        return (lambda w: w.T.reshape(e, count, h), lambda w: w.reshape(e, count * h).T)

    def heads_bias(count):  # [count*h] <-> [count, h]
        return (lambda b: b.reshape(count, h), lambda b: b.reshape(count * h))

    out_proj = (lambda w: w.T.reshape(n, h, e), lambda w: w.reshape(n * h, e).T)
    yield "model.embed_tokens.weight", ("embed",), None, *ident
    yield "model.norm.weight", ("final_norm", "scale"), None, *ident
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", ("lm_head",), None, *linear
    at = ("layers", "attn")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", ("layers", "attn_norm", "scale"), i, *ident
        yield p + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), i, *ident
        for name, ours, count in (("q", "q", n), ("k", "k", kv), ("v", "v", kv)):
            yield p + f"self_attn.{name}_proj.weight", (*at, f"w{ours}"), i, *heads_in(count)
            if cfg.qkv_bias:
                yield p + f"self_attn.{name}_proj.bias", (*at, f"b{ours}"), i, *heads_bias(count)
        yield p + "self_attn.o_proj.weight", (*at, "wo"), i, *out_proj
        if cfg.o_bias:
            yield p + "self_attn.o_proj.bias", (*at, "bo"), i, *ident
        for name in ("gate", "up", "down"):
            yield p + f"mlp.{name}_proj.weight", ("layers", "mlp", f"w_{name}"), i, *linear


def part_rows(cfg: DecoderConfig) -> dict[str, int]:
    """Rows of each llama-layout projection in HF's [out, in] orientation: the blocks a fused
    tensor stacks."""
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q": q, "k": kv, "v": kv, "gate": f, "up": f}


def _part_name(prefix: str, fused: str, part: str) -> str:  # "self_attn.qkv_proj", "q" -> its q_proj
    return f"{prefix}{fused.split('.')[0]}.{part}_proj.weight"


def _split_fused(name: str, w: np.ndarray, cfg: DecoderConfig) -> dict[str, np.ndarray]:
    rows = part_rows(cfg)
    for fused, parts in FAMILIES[cfg.family].fused.items():
        if name.endswith(fused + ".weight"):
            prefix = name[: -len(fused + ".weight")]
            pieces = np.split(w, np.cumsum([rows[p] for p in parts])[:-1], axis=0)
            return {_part_name(prefix, fused, part): piece for part, piece in zip(parts, pieces)}
    return {name: w}


def _join_fused(tensors: dict[str, np.ndarray], cfg: DecoderConfig) -> dict[str, np.ndarray]:
    out = dict(tensors)
    for i in range(cfg.num_layers):  # layer by layer, as the checkpoint orders them
        p = f"model.layers.{i}."
        for fused, parts in FAMILIES[cfg.family].fused.items():
            out[f"{p}{fused}.weight"] = np.concatenate([out.pop(_part_name(p, fused, x)) for x in parts], axis=0)
    return out


def expected_hf_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, in the family's own layout (its fused tensors joined)."""
    shapes = {}
    v, e, n, kv, h, f = (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                         cfg.head_dim, cfg.intermediate_size)
    by_suffix = {"embed_tokens.weight": (v, e), "lm_head.weight": (v, e), "norm.weight": (e,),
                 "layernorm.weight": (e,), "q_proj.weight": (n * h, e), "k_proj.weight": (kv * h, e),
                 "v_proj.weight": (kv * h, e), "q_proj.bias": (n * h,), "k_proj.bias": (kv * h,),
                 "v_proj.bias": (kv * h,), "o_proj.weight": (e, n * h), "o_proj.bias": (e,),
                 "gate_proj.weight": (f, e), "up_proj.weight": (f, e), "down_proj.weight": (e, f)}
    for name, *_ in _mappings(cfg):
        shapes[name] = next(s for suf, s in by_suffix.items() if name.endswith(suf))
    if FAMILIES[cfg.family].fused:
        fused = _join_fused({k: np.empty(s, np.int8) for k, s in shapes.items()}, cfg)
        shapes = {k: t.shape for k, t in fused.items()}
    return shapes


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it."""
    index = model_dir / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise JaxragError(f"{index}: malformed index ({e})") from None
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / WEIGHTS
    if not single.is_file():
        raise JaxragError(f"{model_dir}: no {WEIGHTS} or {WEIGHTS_INDEX} (only safetensors weights are read)")
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def _open_safetensors(path: Path):
    if not path.is_file():
        raise JaxragError(f"{path}: missing weights file")
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise JaxragError(f"{path}: unreadable safetensors file, truncated or corrupt ({e})") from None


def read_hf_tensors(model_dir: Path, cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint in the llama layout, checked against `cfg` by name/shape."""
    model_dir = Path(model_dir)
    files = _weight_files(model_dir)
    expected = expected_hf_shapes(cfg)
    for name in expected:
        if name not in files:
            where = model_dir / (WEIGHTS_INDEX if (model_dir / WEIGHTS_INDEX).is_file() else WEIGHTS)
            raise JaxragError(f"{where}: tensor {name!r} is missing")
    tensors = {}
    for path in sorted(set(files.values())):
        with _open_safetensors(path) as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if name not in expected:
                    raise JaxragError(f"{path}: unexpected tensor {name!r} for a {cfg.family} model")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise JaxragError(f"{path}: tensor {name!r} has shape {shape}, expected {expected[name]}")
                try:
                    w = f.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise JaxragError(f"{path}: cannot read tensor {name!r} ({e})") from None
                tensors.update(_split_fused(name, w, cfg))
    return tensors


def hf_to_params(tensors: dict[str, np.ndarray], cfg: DecoderConfig, dtype) -> dict:
    """Llama-layout HF tensors -> our nested param dict (nnx pure-dict form), cast to `dtype`;
    layer i's tensors fill row i of the stacked `layers` params. Tensors are consumed (removed
    from `tensors`) as they are copied, so a 7B checkpoint is not held twice."""
    params: dict = {}
    for name, path, layer, to_ours, _ in _mappings(cfg):
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        w = np.asarray(to_ours(tensors.pop(name)))
        if layer is None:
            node[path[-1]] = w.astype(dtype)
            continue
        if path[-1] not in node:
            node[path[-1]] = np.empty((cfg.num_layers, *w.shape), dtype)
        node[path[-1]][layer] = w
    return params


def params_to_hf(params: dict, cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """Our nested params -> HF tensors in the family's layout (one per layer), vocab padding removed."""
    tensors = {}
    for name, path, layer, _, to_hf in _mappings(cfg):
        node = params
        for key in path:
            node = node[key]
        w = np.asarray(node) if layer is None else np.asarray(node)[layer]
        w = np.ascontiguousarray(to_hf(w))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = np.ascontiguousarray(w[: cfg.vocab_size])
        tensors[name] = w
    return _join_fused(tensors, cfg)


def write_hf_tensors(tensors: dict[str, np.ndarray], out_dir: Path, max_shard_bytes: int) -> None:
    """Safetensors, sharded with an index json past `max_shard_bytes` (HF's own naming)."""
    split = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda t: t.nbytes, max_shard_size=max_shard_bytes,
        filename_pattern="model{suffix}.safetensors",
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(out_dir / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out_dir / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))
