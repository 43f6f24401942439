"""The documentation points at files the repository has: every relative link and every
`path/file` reference in README.md, docs/, the results and launcher READMEs and the notebooks'
text resolves, and the README stays a few screens long."""

import re
from pathlib import Path

import nbformat

REPO = Path(__file__).parent.parent
# Links: [text](target); references: a path under one of the repository's top-level folders
# (`jaxrag/eval/seeds.py`, `configs/qwen.py:tiny`, `results/embedded/world-v7/seed*`), not part
# of a longer path, a URL or a `commit:path` (hence the look-behind).
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TOP = ("jaxrag", "configs", "tests", "docs", "results", "launch", "colab", "benchmarks", "examples", r"\.ci")
PATH = re.compile(rf"(?<![\w./:-])((?:{'|'.join(TOP)})/[\w./*-]*)")
MISSING_FILES = ("DESIGN.md", "seeds/")  # never in the repository: docs/method.md replaces them


def documents() -> list[Path]:
    found = [REPO / "README.md", REPO / "colab" / "README.md", REPO / "launch" / "README.md"]
    found += sorted((REPO / "docs").rglob("*.md"))
    found += sorted(p for p in (REPO / "results").rglob("*.md") if p.name in ("README.md", "HISTORY.md"))
    return found + sorted((REPO / "colab").glob("*.ipynb"))


def text_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = nbformat.read(path, as_version=4).cells
        return "\n".join(c.source for c in cells if c.cell_type == "markdown")
    return path.read_text()


def broken_references(path: Path, text: str) -> list[str]:
    """Each link or path reference in `text` (of the file `path`) that names no file or folder."""
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(f"link {target}")
    for ref in PATH.findall(text):
        ref = ref.rstrip(".")  # a path that ends a sentence
        hits = list(REPO.glob(ref)) if "*" in ref else [REPO / ref] if (REPO / ref).exists() else []
        if not hits:
            broken.append(f"path {ref}")
    broken += [f"mentions {name}" for name in MISSING_FILES if name in text]
    return broken


def test_every_link_and_path_in_the_documentation_resolves():
    docs = documents()
    assert REPO / "docs" / "method.md" in docs and len(docs) >= 10
    broken = {str(p.relative_to(REPO)): b for p in docs if (b := broken_references(p, text_of(p)))}
    assert broken == {}


def test_the_check_finds_what_is_broken(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("")
    text = ("[ok](there.md#part) [web](https://arxiv.org/abs/2504.01018) [gone](missing.md)\n"
            "`jaxrag/pipeline/config.py`, `configs/qwen.py:tiny`, `results/embedded/world-v7/seed*`, "
            "`jaxrag/nothing.py`, `W/results.json`, `git show abc1234:results/old/README.md`, "
            "see jaxrag/eval/. See DESIGN.md.")
    assert broken_references(page, text) == ["link missing.md", "path jaxrag/nothing.py", "mentions DESIGN.md"]


def test_readme_is_a_few_screens():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 320, f"README.md has {len(lines)} lines: move detail into docs/"
    assert max(map(len, lines)) <= 200


def test_quickstart_is_two_commands_and_the_second_is_ci():
    """The README's Quickstart: the first command sets up and runs the embedded default, the
    second sets up and runs the suite exactly as `.ci/run` does (which then runs its own steps)."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = block.replace("\\\n", "").splitlines()
    commands = [" ".join(c.split()) for c in commands if c.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("python -m jaxrag.train --config configs/qwen.py:tiny --workdir runs/tiny")
    steps = [" ".join(line.split()) for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]
    # the suite's command, then the tests too slow for it (pyproject's ci_step marker), time-bounded
    assert steps[0] == commands[1] and len(steps) > 1
    assert all(step.startswith("timeout ") and " python -m pytest -m ci_step " in step for step in steps[1:])
