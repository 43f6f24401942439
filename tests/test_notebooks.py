"""The Colab / TPU-VM notebooks as committed: valid, without outputs, parseable, and installing
only what the user supplies. Running them is tested in test_pipeline.py (quickstart, inference)."""

from pathlib import Path

import nbformat

REPO = Path(__file__).parent.parent


def test_notebooks_are_committed_without_outputs():
    for path in sorted((REPO / "colab").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
                compile(cell.source, path.name, "exec")  # tpu_train.ipynb needs a TPU: at least it parses
    assert {p.stem for p in (REPO / "colab").glob("*.ipynb")} == {"quickstart", "inference", "tpu_train"}


def test_notebooks_install_only_what_the_user_has():
    """No notebook pip-installs from a guessed repository address: the install cell (the same in
    all three) takes JAXRAG_SOURCE, empty by default, or an uploaded wheel / checkout, else stops
    with a message."""
    install = None
    for path in sorted((REPO / "colab").glob("*.ipynb")):
        cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        text = "\n".join(cells)
        assert "github.com" not in text and 'JAXRAG_SOURCE = ""' in text, path.name
        cell = next(c for c in cells if "pip" in c and "install" in c)
        assert "raise RuntimeError" in cell and "jaxrag-*.whl" in cell, path.name
        assert install in (None, cell), f"{path.name}: install cell differs from the other notebooks'"
        install = cell
