"""A small byte-level BPE tokenizer trained on the world's text.

Byte-level BPE rather than WordLevel: it round-trips any text exactly and never produces an
unknown token, so prompts the pipeline adds (GenRead's, chat wrappers) still encode. The
world's vocabulary is small enough that every answer value ends up a single token.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from jaxrag.models.tokens import add_srrag_tokens
from jaxrag.prompts import GENREAD_PROMPT
from jaxrag.world.pretrain import document_text

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
RC_DOCS_FOR_TRAINING = 100  # a few, for the format: fresh names would only waste merges
# Rare names (tail cities, say) need extra counts to earn their last merges; repeating the
# value pools makes every answer value a single token at the default vocabulary size.
POOL_REPEATS = 5


def tokenizer_training_texts(world) -> list[str]:
    parts = world.pretraining_parts(0)
    texts = [r["contents"] for r in world.corpus()]
    for splits in world.datasets().values():
        for examples in splits.values():
            texts += [f"{e.prompt_question()} {' '.join(e.golden_answers)}" for e in examples]
    for name, part in parts.items():
        texts += [document_text(d) for d in (part[:RC_DOCS_FOR_TRAINING] if name == "rc" else part)]
    pools = " ".join(" ".join(p) for p in world.pools.values())
    return [*texts, GENREAD_PROMPT, *[pools] * POOL_REPEATS]


def train_tokenizer(world) -> PreTrainedTokenizerFast:
    """BPE over the world's text; BOS/EOS/PAD first, then the SR-RAG tokens appended."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=world.config.vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tokenizer_training_texts(world), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )
    add_srrag_tokens(wrapped)
    return wrapped


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """`save_pretrained`, naming the class `PreTrainedTokenizerFast`: transformers 5 writes its
    new `TokenizersBackend`, which transformers 4 cannot load; both load the old name."""
    tokenizer.save_pretrained(out_dir)
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
