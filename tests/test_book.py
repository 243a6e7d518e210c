"""The book's notebooks: the install cell derives from _config.yml, no kernels are defined in notebooks,
live widgets are hidden from the static build."""
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "book" / "tools"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_repository_url_has_one_source():
    from sync_notebooks import repository
    from sparseattn import book
    url, branch = repository()
    assert (book.REPOSITORY, book.BRANCH) == (url, branch)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_install_cell_is_in_sync(path):
    from sync_notebooks import install_cell_source
    nb = json.loads(path.read_text())
    first = "".join(nb["cells"][0]["source"])
    assert first == install_cell_source(), "run: python book/tools/sync_notebooks.py"
    assert "remove-cell" in nb["cells"][0]["metadata"].get("tags", [])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_define_no_kernels_and_hide_widgets(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        assert "triton.jit" not in src and "@triton" not in src
        if cell["cell_type"] == "code" and "book.interact(" in src:
            assert "remove-cell" in cell["metadata"].get("tags", []), "live widget cells are hidden in the book"
    assert any("book.setup()" in "".join(c["source"]) for c in nb["cells"]), "use the shared setup"


def test_import_sparseattn_does_not_import_plotly_or_touch_the_gpu():
    from conftest import run_fresh_python
    code = ("import sys, sparseattn; "
            "assert 'plotly' not in sys.modules and 'ipywidgets' not in sys.modules; "
            "assert 'sparseattn.kernels.prefill_fwd' not in sys.modules; "
            "import torch; assert not torch.cuda.is_initialized(); "
            "import os; assert 'TRITON_INTERPRET' not in os.environ")
    run_fresh_python(code)
