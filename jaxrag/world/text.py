"""Word pools, phrasing templates and text formats of the embedded world (text only).

Every answer value is ONE word (a pool word or a generated name), so a single copy mechanism
serves every attribute. Templates use `{n}` (the subject's name) and `{v}` (the value).
"""

from __future__ import annotations

from dataclasses import dataclass

# Value pools. Disjoint, one word each, consonant-initial where an article precedes them.
POOLS: dict[str, tuple[str, ...]] = {
    "occupation": (
        "painter", "sailor", "chemist", "poet", "baker", "carpenter", "composer", "lawyer",
        "farmer", "jeweler", "glassblower", "historian", "potter", "tailor", "pilot", "surgeon",
        "dancer", "weaver", "sculptor", "novelist",
    ),
    "known_for": (
        "pottery", "wool", "salt", "silk", "cheese", "glass", "copper", "tea", "wine", "paper",
        "lace", "honey", "marble", "spices", "bread", "leather",
    ),
    "product": (
        "lamps", "ships", "clocks", "bicycles", "radios", "shoes", "cameras", "engines", "pianos",
        "tents", "boots", "kettles", "telescopes", "maps", "candles", "ropes",
    ),
    "sector": (
        "mining", "shipping", "textiles", "banking", "farming", "printing", "railways", "fishing",
        "brewing", "timber", "publishing", "catering",
    ),
    "genre": (
        "jazz", "folk", "rock", "blues", "reggae", "punk", "soul", "techno", "gospel", "swing",
        "ska", "polka",
    ),
    "color": (
        "red", "blue", "green", "yellow", "white", "black", "purple", "orange", "grey", "brown",
        "pink", "silver",
    ),
    "habitat": (
        "forests", "deserts", "caves", "lakes", "mountains", "swamps", "meadows", "oceans",
        "glaciers", "marshes", "jungles", "dunes",
    ),
    "treats": (
        "headaches", "fevers", "coughs", "rashes", "insomnia", "nausea", "bruises", "cramps",
        "chills", "sneezing", "earaches", "hiccups",
    ),
    "side_effect": (
        "drowsiness", "thirst", "dizziness", "itching", "sweating", "yawning", "blushing",
        "shivering", "restlessness", "hunger",
    ),
}

QUESTION_STYLES = ("popqa", "nq", "trivia")


@dataclass(frozen=True)
class AttributeSpec:
    """One entity attribute: where its values come from and how text states or asks it."""

    values: str  # a POOLS key, an entity type ("city", "company") or a generated pool
    statements: tuple[str, ...]
    questions: dict[str, str]  # QUESTION_STYLES -> template


ATTRIBUTES: dict[str, dict[str, AttributeSpec]] = {
    "person": {
        "born_in": AttributeSpec("city", (
            "{n} was born in {v}.", "{n} is a native of {v}.", "{v} is the birthplace of {n}.",
            "{n} was born and raised in {v}.",
        ), {"popqa": "In what city was {n} born?", "nq": "where was {n} born",
            "trivia": "Which city is the birthplace of {n}?"}),
        "occupation": AttributeSpec("occupation", (
            "{n} works as a {v}.", "{n} is a {v} by profession.", "By trade, {n} is a {v}.",
            "{n} earns a living as a {v}.",
        ), {"popqa": "What is {n}'s occupation?", "nq": "what does {n} do for a living",
            "trivia": "Which profession does {n} practise?"}),
        "employer": AttributeSpec("company", (
            "{n} is employed by {v}.", "{n} works for {v}.", "{v} employs {n}.",
            "{n} has a job at {v}.",
        ), {"popqa": "Who is {n}'s employer?", "nq": "what company does {n} work for",
            "trivia": "Which firm employs {n}?"}),
    },
    "city": {
        "country": AttributeSpec("country", (
            "{n} is a city in {v}.", "{n} lies in {v}.", "{n} is located in the country of {v}.",
            "The city of {n} belongs to {v}.",
        ), {"popqa": "In what country is {n}?", "nq": "what country is {n} in",
            "trivia": "Which country is the city of {n} located in?"}),
        "river": AttributeSpec("river", (
            "The {v} river flows through {n}.", "{n} lies on the river {v}.",
            "{n} was built along the river {v}.", "The river flowing through {n} is the {v}.",
        ), {"popqa": "What river flows through {n}?", "nq": "what river runs through {n}",
            "trivia": "On which river does the city of {n} lie?"}),
        "known_for": AttributeSpec("known_for", (
            "{n} is famous for its {v}.", "{n} is known for {v}.",
            "The city of {n} is renowned for its {v}.", "Travellers visit {n} for its {v}.",
        ), {"popqa": "What is {n} known for?", "nq": "what is {n} famous for",
            "trivia": "For which product is the city of {n} renowned?"}),
    },
    "company": {
        "headquarters": AttributeSpec("city", (
            "{n} is headquartered in {v}.", "{n} has its head office in {v}.",
            "The head office of {n} is in {v}.", "{n} is based in {v}.",
        ), {"popqa": "Where is {n} headquartered?", "nq": "where is the head office of {n}",
            "trivia": "In which city is the company {n} based?"}),
        "product": AttributeSpec("product", (
            "{n} makes {v}.", "{n} is a maker of {v}.", "{n} manufactures {v}.",
            "The main product of {n} is {v}.",
        ), {"popqa": "What does {n} produce?", "nq": "what does the company {n} make",
            "trivia": "Which product is {n} best known for making?"}),
        "sector": AttributeSpec("sector", (
            "{n} is a {v} company.", "{n} does business in {v}.",
            "The industry of {n} is {v}.", "{n} is active in {v}.",
        ), {"popqa": "What industry is {n} in?", "nq": "what sector does {n} operate in",
            "trivia": "In which industry does the company {n} do business?"}),
    },
    "band": {
        "genre": AttributeSpec("genre", (
            "{n} is a {v} band.", "{n} plays {v}.", "{n} performs {v}.",
            "The genre of {n} is {v}.",
        ), {"popqa": "What genre of music does {n} play?", "nq": "what kind of music does {n} play",
            "trivia": "Which musical genre is the band {n} associated with?"}),
        "hometown": AttributeSpec("city", (
            "{n} was formed in {v}.", "{n} comes from {v}.", "The band {n} started out in {v}.",
            "{v} is the hometown of {n}.",
        ), {"popqa": "Where was the band {n} formed?", "nq": "where is the band {n} from",
            "trivia": "Which city is the hometown of the band {n}?"}),
        "label": AttributeSpec("company", (
            "{n} is signed to {v}.", "{n} records for {v}.", "{n} releases its albums through {v}.",
            "The label of {n} is {v}.",
        ), {"popqa": "What record label is {n} signed to?", "nq": "who is {n} signed to",
            "trivia": "Which label releases the albums of {n}?"}),
    },
}

# Attributes whose value names another entity of the world (a city or a company).
LINKS = {
    "person": {"born_in": "city", "employer": "company"}, "company": {"headquarters": "city"},
    "band": {"hometown": "city", "label": "company"},
}
# Chain questions: the answer is a fact of the entity the subject's link names
# ("In what country was X born?" = the country of X's birthplace). A model that knows both facts
# answers one only after stating the first, the compositionality gap of real LMs, so these are
# the world's facts usable only after verbalizing them. (type, link) -> (attribute of the
# linked entity, question per style).
CHAINS: dict[tuple[str, str], tuple[str, dict[str, str]]] = {
    ("person", "born_in"): ("country", {
        "popqa": "In what country was {n} born?", "nq": "what country was {n} born in",
        "trivia": "In which country is the birthplace of {n}?"}),
    ("person", "employer"): ("headquarters", {
        "popqa": "In what city is {n}'s employer headquartered?",
        "nq": "where is the company {n} works for based",
        "trivia": "In which city is the firm that employs {n} based?"}),
    ("company", "headquarters"): ("country", {
        "popqa": "In what country is {n} headquartered?", "nq": "what country is {n} based in",
        "trivia": "In which country does the company {n} have its head office?"}),
    ("band", "hometown"): ("country", {
        "popqa": "In what country was the band {n} formed?",
        "nq": "what country is the band {n} from",
        "trivia": "Which country is the hometown of the band {n} in?"}),
    ("band", "label"): ("headquarters", {
        "popqa": "Where is the record label of {n} based?", "nq": "where is {n}'s record label based",
        "trivia": "In which city is the label that releases {n} headquartered?"}),
}

# The attribute that tells namesakes apart, and how a disambiguated name reads.
DISAMBIGUATOR = {"person": "occupation", "city": "country", "company": "sector", "band": "genre"}
DISAMBIGUATED_NAME = {
    "person": "the {d} {n}", "city": "{n} in {d}", "company": "the {d} company {n}",
    "band": "the {d} band {n}",
}

# Rules: category -> property value. `{c}` category, `{i}` item, `{v}` value.
RULE_PROPERTIES = {"science": ("color", "habitat"), "health": ("treats", "side_effect")}
RULE_KIND = {"science": "creature", "health": "herb"}
RULE_STATEMENTS = {
    "color": ("All {c}s are {v}.", "Every {c} is {v} in color.", "A {c} is always {v}.",
              "The color of every {c} is {v}."),
    "habitat": ("All {c}s live in {v}.", "Every {c} is found in {v}.",
                "A {c} always makes its home in {v}.", "The natural home of every {c} is {v}."),
    "treats": ("Every {c} eases {v}.", "All {c}s help against {v}.",
               "Remedies made from a {c} relieve {v}.", "A {c} is a known cure for {v}."),
    "side_effect": ("Every {c} causes {v}.", "All {c}s can bring on {v}.",
                    "Taking a {c} leads to {v}.", "A known side effect of every {c} is {v}."),
}
ITEM_STATEMENTS = {
    "color": "The {i} is {v}.", "habitat": "The {i} lives in {v}.",
    "treats": "The {i} eases {v}.", "side_effect": "The {i} causes {v}.",
}
RULE_APPLICATIONS = {
    "color": "The {i} is a {c}, so it is {v}.", "habitat": "The {i} is a {c}, so it lives in {v}.",
    "treats": "The {i} is a {c}, so it eases {v}.",
    "side_effect": "The {i} is a {c}, so it causes {v}.",
}
# Rule questions name the item's category, so answering needs one rule, not a chain.
RULE_QUESTIONS = {
    "color": {
        "open": "Knowing that a {i} is a {c}, what color would you expect it to be?",
        "easy": "A {i} is a kind of {c}. What color is the {i}?",
        "challenge": "Explorers caught a {i} and identified it as a {c}. "
                     "Which color will the {i} most likely have?",
    },
    "habitat": {
        "open": "Knowing that a {i} is a {c}, where would you expect it to live?",
        "easy": "A {i} is a kind of {c}. Where does the {i} live?",
        "challenge": "A newly described {i} turned out to be a {c}. "
                     "In which habitat should scientists look for more of them?",
    },
    "treats": {
        "open": "Knowing that {i} is a {c}, what would you expect it to ease?",
        "easy": "The {i} is a kind of {c}. What does the {i} ease?",
        "challenge": "A healer prepared a tea from {i}, which is a {c}. "
                     "Which complaint will the tea most likely ease?",
    },
    "side_effect": {
        "open": "Knowing that {i} is a {c}, what side effect would you expect?",
        "easy": "The {i} is a kind of {c}. What does the {i} cause?",
        "challenge": "A patient took {i}, which is a {c}. "
                     "Which side effect is the patient most likely to notice?",
    },
}
RULE_CLAIMS = {
    "color": "The {i}, a kind of {c}, is {v}.",
    "habitat": "The {i}, a kind of {c}, lives in {v}.",
    "treats": "A tea brewed from {i}, a kind of {c}, eases {v}.",
    "side_effect": "Taking {i}, which is a {c}, causes {v}.",
}
CATEGORY_INTROS = {
    "science": "The {c} is a kind of creature described in many field guides.",
    "health": "The {c} is a family of herbs used in folk remedies.",
}

STALE_PREFIX = "Older records state that {s}"
WOW_OPENERS = (
    "I was just reading about {n}.", "Have you heard of {n}?", "My friend told me about {n}.",
    "I am curious about {n}.",
)
ASQA_JOIN = "{a}, while {b}."

# Sentences that fill a passage to ~100 words without stating any attribute. `{o}` is another
# city's name: a distractor that reading comprehension must not copy.
FILLERS = (
    "{n} is mentioned in several regional archives.",
    "Little was written about {n} before {y}.",
    "A short account of {n} appeared in a survey printed in {y}.",
    "Historians still debate minor details about {n}.",
    "{n} was the subject of a newspaper column in {y}.",
    "Several photographs of {n} survive from {y}.",
    "Local guides sometimes mention {n} to visitors.",
    "An exhibition about {n} opened in {y}.",
    "Letters describing {n} are kept in a public library.",
    "Scholars cite {n} in studies of the region.",
    "{n} is listed in a reference book from {y}.",
    "Visitors from {o} once wrote about {n}.",
    "A documentary about {n} was filmed in {o} in {y}.",
    "The name {n} is sometimes misspelled in old records.",
    "A committee reviewed the records about {n} in {y}.",
)
EVENT_TITLE = "{y} {c} gathering"
EVENT_SENTENCES = (
    "The {y} gathering in {c} drew a large crowd.",
    "Among the guests were {a} and {b}.",
    "{a} gave a short speech about the history of the fair.",
    "Reports from the gathering also mention {a}.",
    "{a} and {b} were photographed together at the event.",
    "Organisers thanked {a} for lending support.",
    "The programme listed {a} among the speakers.",
    "Music at the gathering was played by {a}.",
)

# Building blocks of generated names (consonant-initial: "a {name}" reads right).
ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr",
          "kr", "st", "tr", "th", "sh")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
CODAS = ("", "", "", "n", "r", "l", "s")


def value_final(templates: tuple[str, ...]) -> tuple[str, ...]:
    """The phrasings that end on the value: passages use only these, so copying an answer
    from context is one skill (find the sentence, take its last word), not one per attribute;
    pretraining bios use every phrasing."""
    return tuple(t for t in templates if t.endswith("{v}."))


def sentence_case(text: str) -> str:
    return text[:1].upper() + text[1:]


def embedded(template: str) -> str:
    """A template placed after a lead-in ("Older records state that ..."): its first word is
    lowercased unless it is a placeholder for a name."""
    return template if template.startswith("{") else template[:1].lower() + template[1:]
