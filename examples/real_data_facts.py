"""Facts read off a Wikipedia lead paragraph by regular expressions, for examples/real_data.py.

Facts (all from the paragraph's FIRST sentence, "SUBJECT[, aside,] is|are|was|were COMPLEMENT",
whose SUBJECT names the article's title; `term` = SUBJECT without its article):
- definition: (term, description), the description = COMPLEMENT up to the first ';' (cut at
  the last comma before word 25 when longer, and then ending in a noun as a noun phrase does),
  starting with a/an/the when singular;
- noun phrase: COMPLEMENT's article + words up to the first comma, preposition other than "of",
  relative pronoun, conjunction, or, after the first word, a participle or adverb (-ed, -ing, -ly,
  or a listed irregular one); >= 3 words, ending in a noun: not in an adjective suffix, a
  nationality, a number or a listed determiner, quantifier, adverb or suffixless adjective ("the
  three species of large" is cut before its noun and dropped); its head word is the last before
  "of" (after "of" for generic words: "a type of song" -> song);
- creator: "<work noun> [... directed|written|painted|composed] by [the] [Nationality [and
  Nationality]] [role words] NAME" -> (term, relation author|director|painter|composer (the verb
  nearest "by", else the work noun), NAME less a leading capitalized -ist role); none
  when NAME is a nationality ("by Irish playwright and author ...": a modifier, not a name);
- capital: "... is [the] capital [city] [and ... city] of Y" -> (Y, term); and "Its capital [and
  largest city] is Z" in any sentence -> (title, Z);
- year: COMPLEMENT starts "a|an YYYY" and has a noun phrase -> (term, YYYY);
- alias: an aside "[also|commonly|...] known as|called ALIAS" -> (term, ALIAS).
A question is dropped when it contains a word of its answer (first 5 letters of words >= 4
letters), or when its source sentence straddles two 100-word passages.
"""

from __future__ import annotations

import re

_ABBREV = re.compile(r"(?:\b[A-Z]|\b(?:St|Mt|Dr|Mr|Mrs|Jr|Sr|c|ca|vs|No|etc|approx|i\.e|e\.g))\.$")
_COPULA = re.compile(r"\s(is|are|was|were)\s")
_STOP = {"in", "on", "at", "by", "for", "from", "with", "to", "that", "which", "who", "whose",
         "where", "and", "or", "but", "as", "is", "are", "between", "within", "into", "near",
         "among", "about", "over", "under", "across", "along", "around", "than", "such",
         "known", "called", "found", "made", "through", "without", "during", "after", "before",
         "since", "until", "against", "via", "throughout", "toward", "towards", "upon", "like",
         "unlike", "despite", "above", "below", "beyond", "behind", "when", "while", "whereas",
         "how", "has", "have", "had", "worn", "built", "held", "grown", "given", "seen", "written",
         "taken", "born", "kept", "fought", "drawn", "driven", "spoken", "told", "paid", "sold",
         "led", "won", "shown"}
_ING_NOUNS = {"painting", "building", "clothing", "wedding", "king", "ring", "string", "thing",
              "wing", "spring", "ceiling", "being", "meaning", "writing", "printing", "drawing",
              "engraving", "morning", "evening", "housing", "swimming", "skiing", "boxing"}
_GENERIC = {"type", "types", "form", "forms", "kind", "style", "member", "part", "genre", "group",
            "collection", "series", "family", "set", "branch", "piece", "work", "class", "variety",
            "field", "system", "range", "body", "one", "example", "method", "term", "way", "use"}
# Words that cannot end a noun phrase: determiners, quantifiers, numerals, adverbs, and adjectives
# that no suffix of `_ADJ_SUFFIX` marks. A phrase cut after one has lost its noun ("a group of
# small, angiosperm, fruit-bearing trees" -> "a group of small").
_MODIFIERS = set("""
    a an the this that these those some any many much more most few fewer several all both each
    every other another such various numerous certain enough own same whole half only
    one two three four five six seven eight nine ten eleven twelve hundred thousand million
    billion first second third fourth fifth
    also often once twice almost not very well still
    large larger largest small smaller smallest big bigger biggest little long longer longest
    short tall taller tallest high higher highest low lower lowest old older oldest new young
    great greater greatest good better best bad worse worst main major minor free full common
    similar popular prevalent abundant adjacent distant dominant important significant different
    independent due dead wild green black white red blue yellow cold hot warm dry wet rich poor
    fine early late modern ancient simple correct wrong compact discrete familiar intermediate
    invalid predatory widespread worldwide underwater upward halfway woody bushy""".split())
_ADJ_SUFFIX = re.compile(r"(?:al|ic|ous|ive|ful|less|able|ible|ary|ed|ern|-)$")
# Nationalities and peoples as adjectives ("American", "Irish", "Japanese"): capitalized words
# with a demonym's ending, and the common ones without one.
_NATIONALITY = re.compile(r"(?!Ocean|Vatican)[A-Z][\w-]*(?:ian|ean|can|ese|ish)|French|Dutch|Czech|"
                          r"Greek|Thai|Swiss|Roman|German|Norman|Arab")
_LY_NOUNS = {"family", "assembly", "butterfly", "lily", "supply", "monopoly", "ally"}
_NAME = (r"[A-Z][\w'’.-]*"  # capitalized words, with the particles of names between them
         r"(?:\s(?:(?:de|da|di|del|van|von|der|den|du|la|le|y|bin|ibn)\s)*[A-Z][\w'’.-]*)*")
_WORKS = {"author": r"novel|novella|poem|epic|play|tragedy|comedy|book|story|stories",
          "director": r"film|movie", "painter": r"painting|fresco|portrait|mural",
          "composer": r"symphony|concerto|oratorio|ballet|opera"}
_VERBS = {"directed": "director", "written": "author", "painted": "painter", "composed": "composer"}
_CREATOR = re.compile(rf"\b(?P<noun>{'|'.join(_WORKS.values())})s?\b(?P<mid>(?: [\w-]+){{0,4}}?)"
                      rf" by (?:(?:the )?(?:[A-Z][\w-]+ (?:and [A-Z][\w-]+ )?)?(?:[a-z]+ ){{1,4}}(?=[A-Z]))?"
                      rf"(?P<name>{_NAME})")
_CAPITAL = re.compile(rf"(?:^|\band )the capital(?: city)?(?: and [\w -]+? city)? of "
                      rf"(?P<of>(?:the )?{_NAME})(?=[,.;]|$)")
_ITS_CAPITAL = re.compile(rf"\bIts capital(?: and (?:largest|most populous) city)? is (?P<cap>{_NAME})")
_ALIAS = re.compile(r"^,?\s*(?:\([^)]*\),?\s*)?"
                    r"(?P<how>(?:also |more |most |commonly |often |sometimes )*"
                    r"(?:known as|called))\s+(?P<alias>[^,()]+?)\s*(?:,|\)|$| or | in )")


def sentences(text: str) -> list[str]:
    """Sentences of each line, split at [.!?] + space + capital, not after an initial or an
    abbreviation; whitespace normalized."""
    out = []
    for line in text.splitlines():
        for i, piece in enumerate(re.split(r"(?<=[.!?])\s+(?=[A-Z\"“(])", " ".join(line.split()))):
            if i and _ABBREV.search(out[-1]):
                out[-1] += " " + piece
            elif piece:
                out.append(piece)
    return out


def stems(text: str) -> set[str]:
    return {w[:5].lower() for w in re.findall(r"\w+", text) if len(w) >= 4}


def leaks(question: str, answer: str) -> bool:
    return bool(stems(question) & stems(answer))


def noun_phrase(complement: str) -> str | None:
    words = complement.split()
    if not words or words[0].lower() not in ("a", "an", "the"):
        return None
    out = [words[0]]
    for w in words[1:]:
        bare = w.rstrip(",;.:")
        if bare.lower() in _STOP or bare.startswith("(") or (len(out) >= 2 and (
                re.fullmatch(r"[a-z]+ed", bare) or re.fullmatch(r"[a-z]+ly", bare)
                and bare not in _LY_NOUNS or re.fullmatch(r"[a-z]+ing", bare)
                and bare not in _ING_NOUNS)):
            break
        out.append(bare)
        if bare != w:
            break
    while len(out) > 1 and out[-1].lower() in ("of", "the", "a", "an"):
        out.pop()
    return " ".join(out) if len(out) >= 3 and ends_in_noun(out[-1]) else None


def ends_in_noun(word: str) -> bool:
    """False for a word that cannot end a noun phrase: an adjective suffix, a nationality, a
    number other than a year ("a genus of 47"), or `_MODIFIERS`; for a hyphenated word, its last
    part ("second-largest")."""
    last = word.rstrip(",;.:").rsplit("-", 1)[-1].lower()
    return not (_ADJ_SUFFIX.search(word.lower()) or _NATIONALITY.fullmatch(word)
                or re.search(r"\d", word) and not re.fullmatch(r"\d{4}s?", word) or last in _MODIFIERS)


def head(np: str) -> str:
    """The head word: before the first "of", unless that is a generic word ("a type of song")."""
    parts = np.lower().split(" of ")
    word = parts[0].split()[-1]
    return parts[1].split()[-1] if word in _GENERIC and len(parts) > 1 else word


def description(complement: str) -> str | None:
    text = re.sub(r"\s*\([^)]*\)", "", complement.split(";")[0]).rstrip(" .")
    words = text.split()
    if len(words) > 25:
        cut = " ".join(words[:25]).rfind(", ")  # not inside a number
        if cut < 0:
            return None
        text = text[:cut]
        if not ends_in_noun(text.split()[-1]):  # a cut inside a list of adjectives
            return None
    return text if len(text.split()) >= 3 else None


def paragraph_facts(index: int, title: str, raw: str) -> dict:
    """Facts of one paragraph (see the module docstring), each with the char span it came from."""
    sents, text = sentences(raw), " ".join(raw.split())
    facts = {"index": index, "title": title, "text": text}
    starts = []
    pos = 0
    for s in sents:
        pos = text.index(s, pos)
        starts.append(pos)
        pos += len(s)
    facts["sentences"] = list(zip(sents, starts))
    for s, start in facts["sentences"]:
        m = _ITS_CAPITAL.search(s)
        if m and not leaks(f"What is the capital of {title}?", m["cap"]):
            facts["capital"] = (title, m["cap"].rstrip("."), (start, start + len(s)))
    if not sents:
        return facts
    first = sents[0].rstrip(".")
    span = (starts[0], starts[0] + len(sents[0]))
    cop = _COPULA.search(first)
    if not cop or len(first[:cop.start()].split()) > 25:
        return facts
    before, verb, complement = first[:cop.start()], cop[1], first[cop.end():]
    subject = re.split(r"\s*[,(;]", before)[0]
    term = re.sub(r"^(?:The|An|A) ", "", subject)
    name = re.sub(r"\s*\(.*\)$", "", title).lower()
    if not (name in term.lower() or term.lower().startswith(name[:max(4, len(name) - 1)])):
        return facts
    facts.update(term=term, subject=subject, verb=verb, span=span, sentence=sents[0])
    plural = verb in ("are", "were")
    desc = description(complement)
    if desc and (plural or desc.split()[0].lower() in ("a", "an", "the")):
        facts["definition"] = desc
    facts["np"] = noun_phrase(complement)
    if m := _CREATOR.search(re.split(r",| that | which | adapted | based ", complement)[0]):
        mid = m["mid"].split()
        last = ([m["noun"], *mid][-1]).removesuffix("s")  # the work noun right before "by"
        rel = next((_VERBS[w] for w in reversed(mid) if w in _VERBS), None) or next(
            (r for r, pat in _WORKS.items() if re.fullmatch(pat, last)), None)
        # A capitalized role before the name is not part of it: "French Impressionist Claude Monet".
        who = re.sub(r"^(?:[A-Z][\w-]* )?[A-Z]\w*ist (?=[A-Z])", "", m["name"].rstrip("."))
        if rel and not leaks(term, who) and not _NATIONALITY.fullmatch(who):
            facts["creator"] = (rel, who)
    if (m := _CAPITAL.search(complement)) and not leaks(m["of"], term):
        facts["capital"] = (m["of"].rstrip("."), term, span)
    if (m := re.match(r"an? (\d{4}) ", complement)) and facts["np"]:
        facts["year"] = m[1]
    if m := _ALIAS.match(before[len(subject):]):
        facts["alias"] = (m["how"], re.sub(r"^(?:the|a|an) ", "", m["alias"]))
    return facts
