"""The embedded world: a generated knowledge world the default config trains and evaluates on.

    generate.py    WorldConfig -> World (entities, corpus, datasets, pretraining text) and its files
    text.py        word pools, phrasing templates and text formats
    entities.py    entities, facts, Zipf popularity, namesakes and rules
    datasets.py    the QA datasets: a training mixture mirroring SR-RAG's six, and four evaluation sets
    corpus.py      the wiki corpus: ~100-word passages, gold and misleading
    pretrain.py    the base model's pretraining text, regenerated every epoch
    tokenizer.py   a small byte-level BPE tokenizer trained on the world's text, with the SR-RAG tokens
    probe.py       what a base model knows of the world, and its two gates (reading, verbalizing)

What it contains, why, and its limits: docs/embedded-world.md.
"""
