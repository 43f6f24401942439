"""Data-construction throughput (Algorithm 1) of a random embedded-default-sized decoder.

    python -m benchmarks.construct [--questions 8] [--new 48] [--hidden 256] -> JSON on stdout

A warm-up run compiles every program; a second run on fresh questions of the same shapes is
timed (questions/s, and the split between GenRead generation and likelihood scoring). A random
model never emits EOS, so every verbalization runs to its token limit: the worst case.
"""

import argparse
import json
import tempfile
import time
import warnings
import zlib
from collections import defaultdict

import jax
import numpy as np
import transformers
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import jaxrag.data.construct as construct_mod
import jaxrag.data.construct_genread as genread_mod
from jaxrag.data.construct import construct
from jaxrag.data.schema import QAExample
from jaxrag.models.decoder import Decoder
from jaxrag.models.hf import decoder_config
from jaxrag.models.model import Model
from jaxrag.prompts import GENREAD_AMBIGUOUS, GENREAD_PROMPT

WORDS = ("the novel was written in by a famous author who lived near river city museum king queen war year "
         "born died capital country population language river mountain team won league film directed").split()


def tokenizer(vocab: int):
    rs = np.random.RandomState(0)
    texts = [GENREAD_PROMPT + GENREAD_AMBIGUOUS, "Question: Background knowledge: Answer:"] * 20
    texts += [" ".join(rs.choice(WORDS, 12)) for _ in range(2000)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<pad>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>",
                                                clean_up_tokenization_spaces=False)


def examples(n: int, offset: int):
    rs = np.random.RandomState(offset)
    out = []
    for i in range(n):
        dataset = "asqa" if i % 4 == 0 else "nq"
        q = f"who {' '.join(rs.choice(WORDS, 8))} number {offset + i}?"
        out.append((dataset, QAExample(f"q{offset + i}", q, (" ".join(rs.choice(WORDS, 3)),))))
    return out


class HashEncoder:
    def encode(self, texts):
        out = np.zeros((len(texts), 64), np.float32)
        for i, t in enumerate(texts):
            for w in t.split():
                out[i, zlib.crc32(w.encode()) % 64] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--new", type=int, default=48, help="verbalize_max_tokens (tiny config: 48, paper: 150)")
    parser.add_argument("--n", type=int, default=5, help="contexts per source")
    parser.add_argument("--demos", type=int, default=2, help="demos_per_cluster (paper: 5)")
    parser.add_argument("--passage-words", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="generate / score batch rows")
    args = parser.parse_args()
    tok = tokenizer(1024)
    hf = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=2048, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    model = Model(Decoder(decoder_config(hf), nnx.Rngs(0)), tok, hf)
    rs = np.random.RandomState(1)
    corpus = [" ".join(rs.choice(WORDS, args.passage_words)) for _ in range(50)]

    def retrieve(questions, k):
        return [[corpus[(zlib.crc32(q.encode()) + j) % len(corpus)] for j in range(k)] for q in questions]

    section = dict(n_contexts=args.n, verbalize_max_tokens=args.new, kmeans_clusters=5, demos_per_cluster=args.demos,
                   shard_size=args.questions, generate_batch_size=args.batch, score_batch_size=args.batch)
    timings = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            timings[name] += time.perf_counter() - start
            return out
        return wrapper

    genread_mod.verbalize = timed("generate_s", genread_mod.verbalize)
    construct_mod.verbalize = timed("generate_s", construct_mod.verbalize)
    construct_mod.answer_logliks = timed("score_s", construct_mod.answer_logliks)
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        construct(model, examples(args.questions, 0), retrieve, HashEncoder(), section, f"{tmp}/warm", progress=False)
        warm = time.perf_counter() - start
        timings.clear()
        start = time.perf_counter()
        construct(model, examples(args.questions, 10_000), retrieve, HashEncoder(), section, f"{tmp}/timed",
                  progress=False)
        seconds = time.perf_counter() - start
    print(json.dumps({
        "device": str(jax.devices()[0]), "params": sum(x.size for x in jax.tree.leaves(nnx.state(model.decoder))),
        "questions": args.questions, "contexts_per_source": args.n, "verbalize_max_tokens": args.new,
        "demos_per_prompt": args.demos, "passage_words": args.passage_words,
        "warmup_with_compile_s": round(warm, 2), "seconds": round(seconds, 2),
        "questions_per_s": round(args.questions / seconds, 3),
        "generate_s": round(timings["generate_s"], 2), "score_s": round(timings["score_s"], 2),
        "generated_tokens_per_s": round(args.questions * (args.n + 1) * args.new / max(timings["generate_s"], 1e-9), 1),
    }, indent=1))


if __name__ == "__main__":
    main()
