"""A tiny SR-RAG model, construct-stage records and a config for the training tests."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import numpy as np
import transformers
from flax import nnx
from ml_collections import ConfigDict

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxrag.models.decoder import Decoder
from jaxrag.models.hf import decoder_config
from jaxrag.models.model import Model, add_special_tokens
from jaxrag.models.params import build_decoder

SELF_TEXTS = ["the novel was written in 1850", "the quick brown fox", "a lazy dog"]
WIKI_TEXTS = ["Retrieval augmented generation reads passages", "Self routing lets a model verbalize",
              "The quick brown fox jumps", "the novel was written", "from Wikipedia before answering"]


def make_tokenizer(vocab_size: int = 400) -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE trained on the toy records' words, so a toy sequence is ~30 tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"Question: who wrote the novel {i}? Background knowledge: {' '.join(SELF_TEXTS + WIKI_TEXTS)} "
              "Answer: Hawthorne" for i in range(10)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 4, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                clean_up_tokenization_spaces=False)


def random_params(cfg, seed: int) -> dict:
    """numpy init (N(0, 0.02) weights, unit norms, zero biases): eager JAX init is slow on CPU."""
    rng = np.random.default_rng(seed)
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))))

    def init(path, x):
        name = str(path[-1].key)
        if name == "scale":
            return np.ones(x.shape, np.float32)
        if name in ("bq", "bk", "bv"):
            return np.zeros(x.shape, np.float32)
        return (rng.normal(size=x.shape) * 0.02).astype(np.float32)
    return jax.tree_util.tree_map_with_path(init, shapes)


def tiny_model(seed: int = 0) -> Model:
    """Qwen2-style decoder (hidden 32, 2 layers, vocab ~400 byte-level BPE) + SR-RAG tokens."""
    tok = make_tokenizer()
    hf = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    cfg = decoder_config(hf)
    return add_special_tokens(Model(build_decoder(cfg, random_params(cfg, seed)), tok, hf))


def toy_record(i: int, label: str) -> dict:
    contexts = [{"source": "self", "text": t, "loglik": -1.0 - j} for j, t in enumerate(SELF_TEXTS)]
    contexts += [{"source": "wiki", "text": t, "loglik": -2.0 - j} for j, t in enumerate(WIKI_TEXTS)]
    return {"id": f"q{i}", "dataset": "toy", "question": f"who wrote the novel {i}?",
            "golden_answers": ["Hawthorne", "N. Hawthorne"], "label": label, "contexts": contexts,
            "no_context_loglik": -9.0, "best": {"self": i % 3, "wiki": 3 + i % 5},
            "worst": {"self": (i + 1) % 3, "wiki": 3 + (i + 2) % 5}}


def toy_records(n: int) -> list[dict]:
    """Every third record is labelled Self, the rest Wiki."""
    return [toy_record(i, "self" if i % 3 == 0 else "wiki") for i in range(n)]


def train_config(**sections) -> ConfigDict:
    common = dict(warmup_ratio=0.25, weight_decay=0.01, grad_clip=1.0, per_device_batch_size=0,
                  checkpoint_every=2, keep_checkpoints=2, log_every=1)
    cfg = ConfigDict(dict(
        seed=0, model=dict(max_length=40), mesh=dict(data=-1, fsdp=1, tensor=1),
        pretrain=dict(common, batch_size=4, lr=3e-3, steps=6),
        stage1=dict(common, batch_size=4, lr=1e-3, epochs=1, extra_passages_lambda=2.0),
        stage2=dict(common, batch_size=4, lr=1e-4, epochs=1, extra_passages_lambda=2.0, dpo_beta=0.3)))
    for name, values in sections.items():
        cfg[name].update(values)
    return cfg


class Stopped(Exception):
    """Raised by `stopped_after`."""


@contextlib.contextmanager
def stopped_after(step: int):
    """The training run inside stops right after step `step` (and its checkpoint, when it takes
    one), with no final model, as a run killed there would: a rerun resumes from the latest
    checkpoint. (A finished training removes its checkpoints, so a finished run cannot stand in
    for a killed one.)"""
    from jaxrag.train import trainer

    dispatched = trainer._Loop.dispatched

    def stop_after(self, at, *args):
        dispatched(self, at, *args)
        if at == step:
            raise Stopped(f"stopped after step {step}")
    with mock.patch.object(trainer._Loop, "dispatched", stop_after):
        try:
            yield
        except Stopped:
            return
    raise AssertionError(f"the training finished before step {step}")
