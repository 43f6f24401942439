"""A LoRA-trained jaxrag model -> a PEFT adapter directory (`peft.PeftModel.from_pretrained`).

Written for PEFT's LoRA format as of peft 0.21 (`adapter_config.json` from `peft.LoraConfig`,
`adapter_model.safetensors` with PEFT's key names, the tokenizer with the SR-RAG tokens):

- each adapted projection: `base_model.model.model.layers.{l}.{module}.lora_A.weight` [r, in]
  and `lora_B.weight` [out, r], scaled alpha / r as in jaxrag;
- the SR-RAG tokens' trained rows through PEFT's *trainable tokens* (`trainable_token_indices`,
  peft >= 0.15): `...embed_tokens.token_adapter.trainable_tokens_delta` [n, hidden] (and
  `lm_head`'s when untied). PEFT writes these rows over the base's (`index_copy`), so any base
  with the tokens at the same ids works: the export of `python -m jaxrag.convert` (mean rows) or
  transformers' `resize_token_embeddings`.
- Phi-3 fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`: the separate adapters map
  onto the fused module exactly as one adapter of rank (parts x r): A stacks the parts' A, B is
  block-diagonal (zero rows for a part that has no adapter), with `rank_pattern` /
  `alpha_pattern` keeping the scale alpha / r.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxrag.errors import JaxragError
from jaxrag.models.decoder import LORA_TARGETS
from jaxrag.models.families import FAMILIES
from jaxrag.models.hf import part_rows
from jaxrag.models.lora import Trainable
from jaxrag.models.model import atomic_dir
from jaxrag.models.params import host_params

ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def _hf_factors(params: dict, target: str, layer: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(A [r, in], B [out, r]) of one target in one layer, in HF's (out, in) orientation."""
    name, _ = LORA_TARGETS[target]
    group = params["layers"]["mlp" if target in ("gate", "up", "down") else "attn"]
    a, b = np.asarray(group[f"{name}_lora_a"][layer]), np.asarray(group[f"{name}_lora_b"][layer])
    return a.reshape(-1, rank).T, b.reshape(rank, -1).T


def adapter_tensors(params: dict, cfg, row_ids) -> tuple[dict[str, np.ndarray], dict]:
    """PEFT state dict and LoraConfig fields for `params` (pure dict, adapters included)."""
    r, targets = cfg.lora_rank, list(cfg.lora_targets)
    modules: dict[str, tuple[str, ...]] = {}
    family_fused = FAMILIES[cfg.family].fused
    for t in targets:
        fused = next((m for m, parts in family_fused.items() if t in parts), None)
        key = fused or _MODULES[t]
        modules[key] = (*modules.get(key, ()), t)
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    for module, parts in modules.items():
        short = module.split(".")[-1]
        for layer in range(cfg.num_layers):
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            if module in family_fused:
                A, B = _fused(params, cfg, module, parts, layer, r)
            else:
                A, B = _hf_factors(params, parts[0], layer, r)
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(A, np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(B, np.float32)
        if len(parts) > 1:
            rank_pattern[short], alpha_pattern[short] = r * len(parts), cfg.lora_alpha * len(parts)
    ids = np.asarray(row_ids, np.int64)
    tensors["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"] = \
        np.ascontiguousarray(np.asarray(params["embed"])[ids], np.float32)
    token_indices = {"embed_tokens": [int(i) for i in ids]}
    if "lm_head" in params:
        tensors["base_model.model.lm_head.token_adapter.trainable_tokens_delta"] = \
            np.ascontiguousarray(np.asarray(params["lm_head"])[:, ids].T, np.float32)
        token_indices["lm_head"] = [int(i) for i in ids]
    fields = dict(r=r, lora_alpha=cfg.lora_alpha, target_modules=sorted({m.split(".")[-1] for m in modules}),
                  rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, trainable_token_indices=token_indices,
                  lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    return tensors, fields


def _fused(params, cfg, module, parts, layer, r):
    """One adapter of rank len(targeted) x r on a fused module (Phi-3's): stacked A, block-diagonal B."""
    sizes = part_rows(cfg)  # the fused weights' row blocks, as import splits them
    order = FAMILIES[cfg.family].fused[module]
    A_parts, B = [], np.zeros((sum(sizes[p] for p in order), r * len(parts)), np.float32)
    for j, part in enumerate(p for p in order if p in parts):
        a, b = _hf_factors(params, part, layer, r)
        start = sum(sizes[p] for p in order[: order.index(part)])
        A_parts.append(a)
        B[start:start + sizes[part], j * r:(j + 1) * r] = b
    return np.concatenate(A_parts), B


def export_adapter(model, out) -> Path:
    """Writes `out` (atomically): adapter_config.json, adapter_model.safetensors, tokenizer."""
    # lazy: safetensors: only this file format needs it
    from safetensors.numpy import save_file

    if not model.config.lora_rank:
        raise JaxragError("export --adapter: the checkpoint has no LoRA adapters (train with model.lora.rank > 0)")
    try:
        # lazy: peft: only the adapter export needs it (it imports torch)
        import peft
    except ImportError:
        raise JaxragError("export --adapter needs peft (pip install 'jaxrag[peft]')") from None
    tensors, fields = adapter_tensors(host_params(model.decoder), model.config, Trainable.for_model(model).row_ids)
    with atomic_dir(out) as tmp:
        peft.LoraConfig(**fields).save_pretrained(tmp)
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        model.tokenizer.save_pretrained(tmp)
    return Path(out)
