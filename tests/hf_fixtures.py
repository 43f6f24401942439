"""Random tiny Hugging Face checkpoints (model + tokenizer) made with transformers in the test."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

from jaxrag.models.families import FAMILIES

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: who wrote the novel? Background knowledge: the novel was written in 1850. Answer: Hawthorne",
    "Retrieval augmented generation reads passages from Wikipedia before answering.",
    "Self routing lets a model verbalize what it knows instead of retrieving.",
] * 4

# Variants the parity tests cover: every family of `jaxrag.models.families` plain (a family added
# there is tested with no change here), Llama-3 RoPE scaling, Phi-3 LongRoPE run past its original
# context (16 < test lengths), a Phi-3 sliding window, tied embeddings.
VARIANTS = {
    **{family: (family, {}) for family in FAMILIES},
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "phi3_longrope": ("phi3", {"original_max_position_embeddings": 16, "rope_scaling": {
        "type": "longrope", "short_factor": list(np.linspace(1.0, 2.0, 8)),
        "long_factor": list(np.linspace(1.0, 8.0, 8))}}),
    "phi3_window": ("phi3", {"sliding_window": 5}),
}


def make_tokenizer(out: Path, vocab_size: int = 120) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="</s>")
    fast.save_pretrained(out)
    return fast


def make_hf_model(out: Path, variant: str, spare_rows: int = 20, seed: int = 0):
    """Saves a random tiny model of `variant` + a tokenizer to `out`; returns the torch model.

    The vocab has `spare_rows` unused rows past the tokenizer, as Qwen2.5 checkpoints do."""
    family, overrides = VARIANTS[variant]
    tok = make_tokenizer(out)
    cfg = transformers.AutoConfig.for_model(family, vocab_size=len(tok) + spare_rows, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                     bos_token_id=None, **overrides)
    torch.manual_seed(seed)
    model = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)](cfg).eval()
    model.save_pretrained(out)
    return model


def torch_minilm(texts: list[str]) -> np.ndarray:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: BertModel, mean pooling, L2 norm."""
    from jaxrag.models.encoder_io import default_encoder_path

    path = str(default_encoder_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertModel.from_pretrained(path).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
