"""Entities, facts, Zipf popularity, namesakes and rules of the embedded world."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace

from jaxrag.world import text as wt

ENTITY_TYPES = ("person", "city", "company", "band")
TOP_VIEWS = 1_000_000  # page views of the most popular entity; popularity is Zipf in rank


@dataclass(frozen=True)
class Entity:
    """A named entity. `mentions` is how many bios per pretraining epoch state its facts."""

    id: str
    type: str
    name: str
    attributes: dict[str, str]
    popularity: int
    mentions: int
    bucket: str  # "head" (known well), "torso" (seen a little) or "tail" (never seen)
    namesake_of: str | None = None
    # attribute -> (kind, wrong value): an extra corpus passage that states the wrong value,
    # "stale" (an older record) or "conflict" (a plain contradiction).
    misleading: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Category:
    """A rule: every member of the category has these property values. `stated` is what the
    category's corpus passage says per property (the truth, a wrong value, or None = silent).
    An unknown category's rules are never in pretraining and its passages state the truth:
    science the model lacks and only retrieval supplies, as some of real ARC's and OBQA's."""

    name: str
    domain: str  # "science" or "health"
    properties: dict[str, str]
    stated: dict[str, str | None]
    known: bool = True


class NameMaker:
    """Fresh pseudo-words that collide with no template word and no name already made."""

    def __init__(self, rng: random.Random, reserved: set[str]):
        self.rng = rng
        self.used = {w.lower() for w in reserved}

    def word(self) -> str:
        while True:
            word = "".join(  # two syllables: short names tokenize into few pieces
                self.rng.choice(wt.ONSETS) + self.rng.choice(wt.VOWELS) + self.rng.choice(wt.CODAS)
                for _ in range(2)
            )
            if len(word) >= 4 and word not in self.used:
                self.used.add(word)
                return word

    def name(self) -> str:
        return self.word().capitalize()


def template_words() -> set[str]:
    """Every word that occurs in the world's templates and pools (generated names avoid them)."""
    texts = [str(v) for v in vars(wt).values() if isinstance(v, (str, tuple, dict))]
    return {w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t)}


def make_pools(cfg, names: NameMaker) -> dict[str, tuple[str, ...]]:
    """All value pools: the fixed word pools plus generated countries, rivers and entity names."""
    # One first and one last name per person: with shared name parts (30 x 30 pools for 300
    # persons, every head person sharing both) person facts bind to a pair of shared tokens and
    # closed-book recall of persons swings several-fold from one world seed to the next.
    generated = {
        "country": cfg.num_countries, "river": cfg.num_rivers, "city": cfg.num_cities,
        "company": cfg.num_companies, "band": cfg.num_bands, "first_name": cfg.num_persons,
        "last_name": cfg.num_persons,
    }
    pools = dict(wt.POOLS)
    for kind, count in generated.items():
        pools[kind] = tuple(names.name() for _ in range(count))
    return pools


def make_entities(cfg, pools: dict[str, tuple[str, ...]], rng: random.Random) -> list[Entity]:
    """Base entities with Zipf popularity, then namesakes and misleading passages for the known."""
    drafts = [(t, name) for t in ENTITY_TYPES for name in _entity_names(t, cfg, pools, rng)]
    ranks = list(range(len(drafts)))
    rng.shuffle(ranks)
    entities = [
        _entity(f"{t}-{i:04d}", t, name, _random_attributes(t, pools, rng), rank, len(drafts), cfg)
        for i, ((t, name), rank) in enumerate(zip(drafts, ranks, strict=True))
    ]
    entities = [_with_misleading(_attached(e, entities, rng), pools, cfg, rng) for e in entities]
    return entities + _namesakes(entities, pools, cfg, rng)


def _attached(entity: Entity, entities: list[Entity], rng: random.Random) -> Entity:
    """Links by preferential attachment, as in the real world (people are born in big cities and
    work for big firms): the linked entity is drawn with weight mentions + 1, so most links name
    a known entity, and a chain question's second fact is one the model holds."""
    links = wt.LINKS.get(entity.type, {})
    if not links:
        return entity
    attributes = dict(entity.attributes)
    for attribute, target_type in links.items():
        targets = [e for e in entities if e.type == target_type]
        attributes[attribute] = rng.choices(targets, [e.mentions + 1 for e in targets])[0].name
    return replace(entity, attributes=attributes)


def _entity_names(entity_type: str, cfg, pools, rng: random.Random) -> list[str]:
    if entity_type != "person":
        return list(pools[entity_type])
    lasts = rng.sample(pools["last_name"], cfg.num_persons)
    return [f"{first} {last}" for first, last in zip(pools["first_name"], lasts, strict=True)]


def _random_attributes(entity_type: str, pools, rng: random.Random) -> dict[str, str]:
    return {a: rng.choice(pools[spec.values]) for a, spec in wt.ATTRIBUTES[entity_type].items()}


def _entity(ident, entity_type, name, attributes, rank, n_entities, cfg) -> Entity:
    """Zipf in rank: views ~ rank^-s; bios per epoch = floor(top * rank^-s), capped, where `top`
    makes exactly `known_fraction` of entities appear at least once."""
    s = cfg.zipf_exponent
    top = (cfg.known_fraction * n_entities) ** s
    mentions = min(cfg.max_mentions, int(top * (rank + 1) ** -s + 1e-9))  # 1e-9: float error
    bucket = "head" if mentions >= cfg.head_min_mentions else "torso" if mentions else "tail"
    views = max(1, round(TOP_VIEWS * (rank + 1) ** -s))
    return Entity(ident, entity_type, name, attributes, views, mentions, bucket)


def _with_misleading(entity: Entity, pools, cfg, rng: random.Random) -> Entity:
    """Known entities (like popular real ones) get stale and conflicting passages per fact."""
    if entity.bucket == "tail":
        return entity
    misleading = {}
    for attribute, value in entity.attributes.items():
        draw = rng.random()
        kind = "stale" if draw < cfg.stale_rate else (
            "conflict" if draw < cfg.stale_rate + cfg.conflict_rate else None)
        if kind:
            pool = pools[wt.ATTRIBUTES[entity.type][attribute].values]
            misleading[attribute] = (kind, _other(pool, value, rng))
    return replace(entity, misleading=misleading)


def _namesakes(entities: list[Entity], pools, cfg, rng: random.Random) -> list[Entity]:
    """Some known entities share their name with an obscure entity of the same type; the
    disambiguating attribute (e.g. a person's occupation) always differs."""
    count = {t: sum(e.type == t for e in entities) for t in ENTITY_TYPES}
    namesakes = []
    for entity in entities:
        if entity.bucket == "tail" or rng.random() >= cfg.namesake_rate:
            continue
        attributes = _random_attributes(entity.type, pools, rng)
        key = wt.DISAMBIGUATOR[entity.type]
        pool = pools[wt.ATTRIBUTES[entity.type][key].values]
        attributes[key] = _other(pool, entity.attributes[key], rng)
        ident = f"{entity.type}-{count[entity.type]:04d}"
        count[entity.type] += 1
        namesakes.append(Entity(ident, entity.type, entity.name, attributes, 1, 0, "tail",
                                namesake_of=entity.id))
    return namesakes


def make_categories(cfg, names: NameMaker, rng: random.Random) -> list[Category]:
    sizes = {"science": cfg.num_science_categories, "health": cfg.num_health_categories}
    categories = []
    for domain, size in sizes.items():
        unknown = round(size * cfg.unknown_rule_fraction)
        for k in range(size):
            properties = {p: rng.choice(wt.POOLS[p]) for p in wt.RULE_PROPERTIES[domain]}
            known = k >= unknown
            stated = {p: stated_value(wt.POOLS[p], v, cfg, rng, known)
                      for p, v in properties.items()}
            categories.append(Category(_singular_word(names), domain, properties, stated, known))
    return categories


def _singular_word(names: NameMaker) -> str:
    """A category name whose plural is just name + "s"."""
    word = names.word()
    while word.endswith("s"):
        word = names.word()
    return word


def stated_value(pool, truth: str, cfg, rng: random.Random, known: bool = True) -> str | None:
    """What a corpus passage says about a rule property: the truth (`rule_coverage_rate`), a
    wrong value (`rule_misleading_rate`) or nothing: the corpus covers rules poorly. A rule
    pretraining never states (`known=False`) the corpus states truly, its only source."""
    if not known:
        return truth
    draw = rng.random()
    if draw < cfg.rule_coverage_rate:
        return truth
    if draw < cfg.rule_coverage_rate + cfg.rule_misleading_rate:
        return _other(pool, truth, rng)
    return None


def _other(pool, value: str, rng: random.Random) -> str:
    return rng.choice([v for v in pool if v != value])
