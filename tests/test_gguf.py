"""GGUF import for each family: a random tiny HF model is written as a GGUF file with the `gguf`
package's writer (llama.cpp's tensor names, float32 tensors, a byte-level BPE vocabulary), then
`jaxrag.load_model("x.gguf")` must give the original model's logits. The real quantized file
(SmolLM2, Llama) is tested in test_real_model.py."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

import jaxrag
from hf_fixtures import make_hf_model
from jaxrag.errors import JaxragError
from jaxrag.models import gguf as gguf_import

gguf = pytest.importorskip("gguf")

ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "phi3": gguf.MODEL_ARCH.PHI3}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama files (rotary halves interleaved); transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer_dir, path, arch: str, name: str = "tiny") -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCHS[arch]])
    writer.add_name(name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"<unused{i}>" for i in range(cfg.vocab_size - len(vocab))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in ("<unk>", "<pad>", "</s>") else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    writer.add_token_scores([0.0] * len(tokens))  # read when the merge list is empty (a bytes-only vocab)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    names = gguf.get_tensor_name_map(ARCHS[arch], cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        w = tensor.numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            w = _permute(w, cfg.num_attention_heads if "q_proj" in base else cfg.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("variant", ["llama", "qwen2", "phi3"])
def test_gguf_file_loads_with_the_original_logits(tmp_path, variant):
    ref = make_hf_model(tmp_path / "hf", variant, spare_rows=0)
    (tmp_path / "gguf").mkdir()
    write_gguf(ref, tmp_path / "hf", tmp_path / "gguf" / "tiny.gguf", variant)
    model = jaxrag.load_model(tmp_path / "gguf" / "tiny.gguf")
    assert model.config.family == variant and model.config.qkv_bias == (variant == "qwen2")
    ids = np.array([[5, 17, 3, 40, 8, 99, 12, 60]])
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.logits(ids)), want, atol=1e-4, rtol=0)
    text = "The quick brown fox jumps over the lazy dog."
    from transformers import AutoTokenizer

    assert model.tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"]
    again = jaxrag.load_model(tmp_path / "gguf")  # a directory holding one GGUF file
    np.testing.assert_array_equal(np.asarray(again.logits(ids)), np.asarray(model.logits(ids)))


def test_a_file_is_dequantized_once_per_contents(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRAG_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    to_hf_dir = gguf_import.to_hf_dir
    monkeypatch.setattr(gguf_import, "to_hf_dir", lambda path, out: calls.append(path) or to_hf_dir(path, out))
    ref = make_hf_model(tmp_path / "hf", "llama", spare_rows=0)
    write_gguf(ref, tmp_path / "hf", tmp_path / "tiny.gguf", "llama")
    loaded = []
    threads = [threading.Thread(target=lambda: loaded.append(jaxrag.load_model(tmp_path / "tiny.gguf")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loaded) == 2 and len(calls) == 1  # two loads at once: one conversion, the other waited
    ids = np.array([[5, 17, 3, 40, 8]])
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    for model in (*loaded, jaxrag.load_model(tmp_path / "tiny.gguf")):
        np.testing.assert_allclose(np.asarray(model.logits(ids)), want, atol=1e-4, rtol=0)
    assert len(calls) == 1
    entry, = (tmp_path / "cache" / "gguf").glob("tiny-*[!k]")  # the entry beside its lock file
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == [entry.name, entry.name + ".lock"]
    # other contents under the same name: converted anew, with the other model's logits
    other = make_hf_model(tmp_path / "hf2", "llama", spare_rows=0, seed=1)
    write_gguf(other, tmp_path / "hf2", tmp_path / "tiny.gguf", "llama")
    with torch.no_grad():
        want = other(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(jaxrag.load_model(tmp_path / "tiny.gguf").logits(ids)), want, atol=1e-4, rtol=0)
    assert len(calls) == 2
    # an entry left incomplete (no config.json) is converted again, not read
    (entry / "config.json").unlink()
    write_gguf(ref, tmp_path / "hf", tmp_path / "tiny.gguf", "llama")
    jaxrag.load_model(tmp_path / "tiny.gguf")
    assert len(calls) == 3 and (entry / "config.json").is_file()


def test_unsupported_architectures_and_bad_files(tmp_path):
    ref = make_hf_model(tmp_path / "hf", "llama", spare_rows=0)
    write_gguf(ref, tmp_path / "hf", tmp_path / "mistral.gguf", "llama", name="mistral-7b-tiny")
    with pytest.raises(JaxragError, match=r"mistral.gguf: GGUF architecture 'llama \(Mistral\)' is not supported "
                                          r"\(jaxrag imports qwen2, llama, phi3\)"):
        jaxrag.load_model(tmp_path / "mistral.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(JaxragError, match=r"gpt2.gguf: GGUF architecture 'gpt2' is not supported"):
        jaxrag.load_model(tmp_path / "gpt2.gguf")
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(JaxragError, match=r"broken.gguf: not a readable GGUF file"):
        jaxrag.load_model(tmp_path / "broken.gguf")
    write_gguf(ref, tmp_path / "hf", tmp_path / "llama.gguf", "llama")
    (tmp_path / "file").write_text("")
    with pytest.MonkeyPatch.context() as m, pytest.raises(
            JaxragError, match=r"file/gguf: cannot create the GGUF conversion cache .*set JAXRAG_CACHE_DIR"):
        m.setenv("JAXRAG_CACHE_DIR", str(tmp_path / "file"))  # a file where the cache's directory would be
        jaxrag.load_model(tmp_path / "llama.gguf")
    with pytest.raises(JaxragError, match=r"missing.gguf: no such GGUF file"):
        jaxrag.load_model(tmp_path / "missing.gguf")
    (tmp_path / "two").mkdir()
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / n).write_bytes(b"")
    with pytest.raises(JaxragError, match=r"two: 2 GGUF files \(a.gguf, b.gguf\); pass one of them"):
        jaxrag.load_model(tmp_path / "two")


def test_missing_packages_give_one_clear_line(monkeypatch):
    real = gguf_import.importlib.util.find_spec
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("gguf", "accelerate") else real(name, *a))
    with pytest.raises(JaxragError, match=r"GGUF import needs the packages gguf, accelerate: "
                                          r"pip install 'jaxrag\[gguf\]'"):
        gguf_import.check_supported(gguf_import.Path("model.gguf"))
