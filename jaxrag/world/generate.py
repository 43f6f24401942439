"""The embedded world: a generated knowledge world in which we KNOW what the model knows.

Entities have one-word facts and Zipf popularity; pretraining text states popular entities'
facts many times and tail entities' never. A wiki corpus states every fact once, plus stale,
conflicting and namesake passages for known entities, and covers the world's rules poorly or
wrongly, so retrieval helps on the tail but sometimes hurts on the head and on rules — the
trade-off SR-RAG learns to route around. Links (birthplace, employer, ...) name popular
entities by preferential attachment, and chain questions ask a fact of the linked entity: a
model that holds both facts answers them only after stating the first (verbalizing), and a
retriever given the question finds the subject's passage, not the linked one's.
Everything is a pure function of `WorldConfig`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from jaxrag.data.schema import QAExample, write_examples, write_jsonl
from jaxrag.world.corpus import build_corpus
from jaxrag.world.datasets import (
    DatasetBuilder,
    RuleItem,
    chain_links,
    pretrain_chains,
    pretrain_facts,
)
from jaxrag.world.entities import (
    Category,
    Entity,
    NameMaker,
    make_categories,
    make_entities,
    make_pools,
    template_words,
)
from jaxrag.world.pretrain import Document, document_text, pretraining_parts, reading_comprehension


@dataclass(frozen=True)
class WorldConfig:
    """Sizes are for a ~3M-parameter model pretrained on a 2-core CPU in ~8 minutes: one epoch
    of `pretraining_texts` is ~0.12M tokens (world tokenizer), so the 2.5M-token budget is ~20
    epochs, which a head entity's facts need to be recalled (~120+ bios each)."""

    seed: int = 0
    # The generator's version, raised whenever the same fields give another world, so that a
    # workdir built by an older generator is refused (provenance) instead of silently reused.
    # The generator is frozen at this version; what each version changed and why is in
    # results/embedded/HISTORY.md.
    version: int = 7
    num_persons: int = 300
    num_cities: int = 100
    num_companies: int = 100
    num_bands: int = 80
    num_countries: int = 16
    num_rivers: int = 30
    num_science_categories: int = 12
    num_health_categories: int = 10
    # Popularity: Zipf in rank; `known_fraction` of entities appear in pretraining at all.
    zipf_exponent: float = 1.5
    known_fraction: float = 0.5
    max_mentions: int = 30  # bios per epoch of the most popular entities
    head_min_mentions: int = 6  # bios per epoch that make an entity "head"
    pretrain_qa_fraction: float = 0.35  # head facts also stated as QA in pretraining
    pretrain_qa_repeats: int = 2
    pretrain_chain_fraction: float = 0.3  # head subjects' chains verbalized in pretraining
    # Noise: per known entity (namesake) or per known fact (stale, conflict); rules.
    namesake_rate: float = 0.2
    stale_rate: float = 0.2
    conflict_rate: float = 0.15
    rule_coverage_rate: float = 0.3  # a rule/item passage states the true value
    rule_misleading_rate: float = 0.4  # ... or a wrong one (else it says nothing)
    # Categories (per domain) whose rules pretraining never states and the corpus states truly:
    # with every rule known, OBQA/ARC-Easy training questions are all <Self>-labelled, stage 1
    # never trains answering a multiple-choice question after a passage, and the fine-tuned
    # Wiki path answers ARC outside its options 1.3-2x as often as the base.
    unknown_rule_fraction: float = 0.25
    # Corpus and pretraining.
    passage_words: int = 100
    num_event_passages: int = 60
    rule_mentions: int = 12
    rule_qa_per_epoch: int = 200
    rule_verbalize_per_epoch: int = 200  # (question, rule document): <Self> for rule questions
    rc_docs_per_epoch: int = 400
    rc_max_passages: int = 2
    rc_extra_passage_prob: float = 0.3
    # Datasets: train-split sizes of the training mixture (+ its validation split, the only one:
    # the eval sets are test sets, as the paper's); 200 test questions per eval set so paired
    # differences of a few points can be told from noise.
    nq_size: int = 170  # ~30% chains (world_datasets.CHAIN_MIX), ~120 plain facts
    fever_size: int = 70
    obqa_size: int = 100
    arc_easy_size: int = 80
    wow_size: int = 60
    asqa_size: int = 20
    validation_fraction: float = 0.3  # 150 validation questions: enough to fix a constant
    eval_test_size: int = 200
    # Before the SR-RAG tokens; every answer value must be one token (4096 split some; at 5120
    # the rule items' names took merges some river names needed; 5376 checked on world seeds 0-40).
    vocab_size: int = 5376


@dataclass(frozen=True, eq=False)
class World:
    """A generated world: its facts (entities, rule categories), corpus and datasets, plus
    per-epoch pretraining text. Build with `generate_world`; fields are read-only."""

    config: WorldConfig
    pools: dict[str, tuple[str, ...]]
    entities: tuple[Entity, ...]
    categories: tuple[Category, ...]
    items: tuple[RuleItem, ...]  # the items rule questions name (each has a corpus passage)
    pretrain_facts: tuple[tuple[str, str], ...]  # (entity id, attribute) shown as QA
    pretrain_chains: tuple[tuple[str, str], ...]  # (entity id, link) verbalized as a chain
    passages: tuple[dict[str, str], ...]
    splits: dict[str, dict[str, tuple[QAExample, ...]]]

    @cached_property
    def _by_id(self) -> dict[str, Entity]:
        return {e.id: e for e in self.entities}

    def entity(self, entity_id: str) -> Entity:
        return self._by_id[entity_id]

    @cached_property
    def known_categories(self) -> tuple[Category, ...]:
        """The rule categories pretraining states (the others only the corpus does)."""
        return tuple(c for c in self.categories if c.known)

    @cached_property
    def person_names(self) -> frozenset[str]:
        return frozenset(e.name for e in self.entities if e.type == "person")

    def reserved_words(self) -> set[str]:
        """Words fresh names must avoid: templates, pools, names, categories, items."""
        words = template_words() | {w for pool in self.pools.values() for w in pool}
        return words | {c.name for c in self.categories} | {i.name for i in self.items}

    def pretrain_qa_facts(self) -> list[tuple[Entity, str]]:
        return [(self.entity(i), a) for i, a in self.pretrain_facts]

    def pretrain_chain_facts(self) -> list[tuple[Entity, str, Entity]]:
        """(subject, link attribute, linked entity) of the chains pretraining verbalizes, in
        `pretrain_chains`' order."""
        chains = {(s.id, a): (s, a, linked) for s, a, linked in chain_links(list(self.entities))}
        return [chains[key] for key in self.pretrain_chains]

    def corpus(self) -> list[dict[str, str]]:
        """Passages as `{"id", "contents": "title\\ntext"}`."""
        return [dict(p) for p in self.passages]

    def datasets(self) -> dict[str, dict[str, list[QAExample]]]:
        return {name: {split: list(examples) for split, examples in splits.items()}
                for name, splits in self.splits.items()}

    def pretraining_parts(self, epoch: int) -> dict[str, list[Document]]:
        """One epoch of pretraining documents by kind: bio, rule (text); qa, verbalize, rc
        (`(prompt, completion)`: the loss is on the completion)."""
        return pretraining_parts(self, epoch)

    def pretraining_documents(self, epoch: int) -> list[Document]:
        """One epoch of pretraining documents, all kinds shuffled together."""
        docs = [d for part in self.pretraining_parts(epoch).values() for d in part]
        random.Random(f"{self.config.seed}:shuffle:{epoch}").shuffle(docs)
        return docs

    def pretraining_texts(self, epoch: int) -> list[str]:
        """`pretraining_documents` as plain text."""
        return [document_text(d) for d in self.pretraining_documents(epoch)]

    def reading_comprehension(self, seed: int, n: int) -> list[QAExample]:
        """`n` fresh reading-comprehension examples (new entities, random values) for `seed`;
        metadata holds `passages` (corpus `contents` strings) and `gold_index`."""
        rng = random.Random(f"{self.config.seed}:rc:{seed}")
        return reading_comprehension(self, n, NameMaker(rng, self.reserved_words()), rng)

    def facts_json(self) -> dict:
        """Everything the world asserts, for audit (world.json)."""
        return {
            "config": asdict(self.config),
            "pools": {k: list(v) for k, v in self.pools.items()},
            "entities": [asdict(e) for e in self.entities],
            "categories": [asdict(c) for c in self.categories],
            "items": [asdict(i) for i in self.items],
            "pretrain_qa_facts": [list(f) for f in self.pretrain_facts],
            "pretrain_chains": [list(f) for f in self.pretrain_chains],
        }


def generate_world(cfg: WorldConfig = WorldConfig()) -> World:
    """Pure and deterministic: each part draws from its own seeded stream."""
    def rng(part: str) -> random.Random:
        return random.Random(f"{cfg.seed}:{part}")

    names = NameMaker(rng("names"), template_words())
    pools = make_pools(cfg, names)
    entities = make_entities(cfg, pools, rng("entities"))
    categories = make_categories(cfg, names, rng("rules"))
    reserved = pretrain_facts(cfg, entities, rng("pretrain-facts"))
    chains = pretrain_chains(cfg, entities, rng("pretrain-chains"))
    builder = DatasetBuilder(cfg, entities, categories, pools, reserved, chains, names,
                             rng("datasets"))
    splits = builder.build()
    corpus = build_corpus(cfg, entities, categories, builder.items, pools["city"], rng("corpus"))
    return World(
        config=cfg, pools=pools, entities=tuple(entities), categories=tuple(categories),
        items=tuple(builder.items), pretrain_facts=tuple(reserved), pretrain_chains=tuple(chains),
        passages=tuple(corpus),
        splits={n: {s: tuple(x) for s, x in d.items()} for n, d in splits.items()},
    )


def write_world(world: World, out_dir: str | os.PathLike) -> Path:
    """Writes corpus.jsonl, datasets/{name}/{split}.jsonl, world.json and tokenizer/ into a temp
    folder next to `out_dir`, then swaps it in, so `out_dir` is never half-written."""
    # transformers is slow to import; only writing the world needs it.
    from jaxrag.world.tokenizer import save_tokenizer, train_tokenizer

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed run with a recycled pid
    tmp.mkdir(parents=True)
    try:
        write_jsonl(tmp / "corpus.jsonl", world.corpus())
        for name, splits in world.datasets().items():
            for split, examples in splits.items():
                write_examples(tmp / "datasets" / name / f"{split}.jsonl", examples)
        (tmp / "world.json").write_text(json.dumps(world.facts_json(), indent=1) + "\n")
        save_tokenizer(train_tokenizer(world), tmp / "tokenizer")
        _swap_in(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _swap_in(new: Path, target: Path) -> None:
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)
