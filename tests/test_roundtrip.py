"""HF -> convert (+ SR-RAG tokens) -> export -> transformers: same logits and greedy tokens."""

import json

import numpy as np
import pytest
import torch
import transformers

import jaxrag
from hf_fixtures import make_hf_model
from jaxrag import convert, export
from jaxrag.models.tokens import srrag_tokens

ORDINARY = "Question: who wrote the novel? Answer:"


def ordinary_columns(logits, tokenizer):
    """Logits of the tokens that existed before conversion (new token rows may reuse spares)."""
    new = tokenizer.convert_tokens_to_ids(srrag_tokens(["wiki", "self"]))
    keep = np.setdiff1d(np.arange(logits.shape[-1]), new)
    return np.asarray(logits)[..., keep]


@pytest.fixture(scope="module", params=["qwen2", "llama", "phi3"])
def converted(request, tmp_path_factory):
    """(reference torch model, original dir, jaxrag checkpoint dir). Llama's vocab equals the
    tokenizer length, so its vocab grows; Qwen/Phi reuse spare rows, as Qwen2.5 does."""
    root = tmp_path_factory.mktemp(request.param)
    grow = request.param == "llama"
    ref = make_hf_model(root / "hf", request.param, spare_rows=0 if grow else 20)
    convert.main(["--hf", str(root / "hf"), "--out", str(root / "ckpt")])
    return ref, root


def test_special_tokens_are_atomic_and_rows_are_mean_initialised(converted):
    ref, root = converted
    model = jaxrag.load_model(root / "ckpt")
    assert model.sources == ("wiki", "self")
    tok = model.tokenizer
    emb = np.asarray(model.decoder.embed[...])
    real = ref.get_input_embeddings().weight.detach().numpy()
    known = len(transformers.AutoTokenizer.from_pretrained(root / "hf"))
    for token in srrag_tokens(["wiki", "self"]):
        ids = tok.encode(f"a{token}b", add_special_tokens=False)
        assert token_ids_contain_once(ids, tok.convert_tokens_to_ids(token))
        assert tok.decode([tok.convert_tokens_to_ids(token)]) == token
        np.testing.assert_allclose(emb[tok.convert_tokens_to_ids(token)], real[:min(known, len(real))].mean(0), atol=1e-6)
    assert model.config.padded_vocab_size % 128 == 0
    assert model.config.vocab_size >= len(tok)


def token_ids_contain_once(ids, token_id):
    return ids.count(token_id) == 1


def test_checkpoint_logits_match_original(converted):
    ref, root = converted
    model = jaxrag.load_model(root / "ckpt")
    ids = model.tokenizer(ORDINARY, return_tensors="np")["input_ids"]
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = np.asarray(model.logits(ids))[..., : want.shape[-1]]
    tok = model.tokenizer
    np.testing.assert_allclose(ordinary_columns(got, tok), ordinary_columns(want, tok), atol=1e-4)


def test_models_loaded_from_one_config_hold_their_own_weights(converted):
    """Loads share the config's abstract decoder (traced once); each fills its own copy, so
    changing one model's weights leaves another's, and the original's logits, as they were."""
    ref, root = converted
    a, b = jaxrag.load_model(root / "ckpt"), jaxrag.load_model(root / "ckpt")
    before = np.asarray(b.decoder.embed[...]).copy()
    a.decoder.embed[...] = a.decoder.embed[...] * 0.0
    np.testing.assert_array_equal(np.asarray(b.decoder.embed[...]), before)
    ids = b.tokenizer(ORDINARY, return_tensors="np")["input_ids"]
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = np.asarray(jaxrag.load_model(root / "ckpt").logits(ids))[..., : want.shape[-1]]
    np.testing.assert_allclose(ordinary_columns(got, b.tokenizer), ordinary_columns(want, b.tokenizer), atol=1e-4)


@pytest.mark.parametrize("shard", ["5GB", "20KB"])
def test_export_loads_in_transformers_with_same_logits_and_greedy_tokens(converted, shard):
    ref, root = converted
    out = root / f"export-{shard}"
    export.main(["--checkpoint", str(root / "ckpt"), "--out", str(out), "--max-shard-size", shard])
    assert (out / "model.safetensors.index.json").is_file() == (shard == "20KB")
    assert (out / "generation_config.json").is_file()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for token in srrag_tokens(["wiki", "self"]):
        assert len(tok.encode(token, add_special_tokens=False)) == 1
        assert tok.decode(tok.encode(token, add_special_tokens=False)) == token
    ids = torch.tensor(tok(ORDINARY)["input_ids"])[None]
    with torch.no_grad():
        want, got = ref(ids).logits, loaded(ids).logits[..., : ref.config.vocab_size]
        np.testing.assert_allclose(ordinary_columns(got, tok), ordinary_columns(want, tok), atol=1e-5)
        kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
        assert ref.generate(ids, **kwargs).tolist() == loaded.generate(ids, **kwargs).tolist()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == loaded.config.vocab_size
