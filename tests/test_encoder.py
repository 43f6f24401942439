"""The Flax encoder matches transformers' (PyTorch) BertModel + the same pooling."""

import json

import numpy as np
import pytest
import torch
import transformers

from hf_fixtures import torch_minilm
from jaxrag.errors import JaxragError
from jaxrag.models.encoder import DEFAULT_ENCODER_NAME
from jaxrag.models.encoder_io import (default_encoder_path, embedding_space, load_encoder,
                                     resolve_encoder)

SENTENCES = [
    "Paris is the capital and most populous city of France.",
    "who wrote hamlet",
    "The mitochondrion is the powerhouse of the cell; " * 30,  # longer than max_length: truncated
    "a",
    "Ünïcödé and punctuation!? (yes) — 1999",
]
WORDS = ["the", "capital", "of", "france", "is", "paris", "who", "wrote", "hamlet", "shakespeare", "a", "cell"]


def cosine(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def minilm():
    return load_encoder()


def test_minilm_matches_torch_mean_pooling(minilm):
    assert minilm.name == DEFAULT_ENCODER_NAME and minilm.dim == 384
    assert (minilm.pooling, minilm.normalize, minilm.max_length) == ("mean", True, 256)
    ours = minilm.encode(SENTENCES, batch_size=4)
    ref = torch_minilm(SENTENCES)
    assert cosine(ours, ref).min() > 0.9999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)


def test_encode_is_independent_of_batching_and_order(minilm):
    a = minilm.encode(SENTENCES, batch_size=4, chunk=2)  # other batch-mates, other padding
    b = minilm.encode(SENTENCES[::-1], batch_size=4)[::-1]
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert minilm.buckets() == [16, 32, 48, 64, 80, 96, 128, 160, 192, 256]
    assert minilm.encode([]).shape == (0, 384)


def _tokenizer(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return transformers.BertTokenizerFast(vocab_file=str(vocab))


def _tiny_config(**kw):
    return dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=64, **kw)


@pytest.mark.parametrize("projection_dim", [0, 16])
def test_tiny_dpr_matches_torch_cls(tmp_path, projection_dim):
    torch.manual_seed(projection_dim)
    kind = "question_encoder" if projection_dim == 0 else "ctx_encoder"
    cfg = transformers.DPRConfig(**_tiny_config(projection_dim=projection_dim))
    model_cls = transformers.DPRQuestionEncoder if projection_dim == 0 else transformers.DPRContextEncoder
    model = model_cls(cfg).eval()
    out = tmp_path / f"dpr-{kind}-tiny"
    model.save_pretrained(out)
    tok = _tokenizer(tmp_path)
    tok.save_pretrained(out)

    enc = load_encoder(out)
    assert (enc.pooling, enc.normalize, enc.pair_input, enc.dim) == ("cls", False, True, projection_dim or 32)
    titles, texts = ["paris", "hamlet", "cell"], ["the capital of france is paris", "who wrote hamlet", "a"]
    ours_q = enc.encode(texts, batch_size=2)
    ours_p = enc.encode_passages(titles, texts, batch_size=2)
    for ours, args in ((ours_q, (texts,)), (ours_p, (titles, texts))):
        batch = tok(*args, padding=True, return_tensors="pt")
        with torch.no_grad():  # DPR feeds zero segment ids, also for (title, text) pairs
            ref = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                        token_type_ids=torch.zeros_like(batch["input_ids"])).pooler_output.numpy()
        assert cosine(ours, ref).min() > 0.9999
        np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_tiny_bert_pooler_matches_torch(tmp_path):
    torch.manual_seed(1)
    model = transformers.BertModel(transformers.BertConfig(**_tiny_config(hidden_act="gelu_new"))).eval()
    model.save_pretrained(tmp_path / "bert-tiny")
    _tokenizer(tmp_path).save_pretrained(tmp_path / "bert-tiny")
    enc = load_encoder(tmp_path / "bert-tiny", pooling="pooler")
    texts = ["who wrote hamlet", "the capital of france is paris paris paris"]
    batch = _tokenizer(tmp_path)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = model(**batch).pooler_output.numpy()
    assert cosine(enc.encode(texts), ref).min() > 0.9999


def test_embedding_space_pairs_dpr_encoders():
    q = embedding_space("facebook/dpr-question_encoder-single-nq-base")
    assert q == embedding_space("dpr-ctx_encoder-single-nq-base")
    assert q != embedding_space("facebook/dpr-question_encoder-multiset-base")
    assert embedding_space(DEFAULT_ENCODER_NAME) != q


def test_pytorch_bin_checkpoint_and_aliases(tmp_path, minilm):
    torch.manual_seed(2)
    model = transformers.DPRQuestionEncoder(transformers.DPRConfig(**_tiny_config())).eval()
    out = tmp_path / "dpr-question_encoder-bin"
    model.config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")  # what older hub repos ship
    _tokenizer(tmp_path).save_pretrained(out)
    texts = ["who wrote hamlet"]
    batch = _tokenizer(tmp_path)(texts, return_tensors="pt")
    with torch.no_grad():
        ref = model(**batch).pooler_output.numpy()
    assert cosine(load_encoder(out).encode(texts), ref).min() > 0.9999
    assert resolve_encoder("minilm") == (default_encoder_path(), DEFAULT_ENCODER_NAME)
    assert resolve_encoder(out) == (out, "dpr-question_encoder-bin")


def test_bad_encoder_directories(tmp_path):
    with pytest.raises(JaxragError, match="nor in the local Hugging Face cache"):
        load_encoder("no-such-org/no-such-encoder")
    with pytest.raises(JaxragError, match="no config.json"):
        load_encoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(JaxragError, match="not a BERT-family encoder"):
        load_encoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", **_tiny_config()}))
    with pytest.raises(JaxragError, match="no \\*.safetensors \\(or pytorch_model.bin\\)"):
        load_encoder(tmp_path)
    with pytest.raises(JaxragError, match="pooling"):
        load_encoder(default_encoder_path(), pooling="sum")
