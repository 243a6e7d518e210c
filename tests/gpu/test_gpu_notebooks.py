"""Every notebook of the book, executed live on a GPU in a Jupyter kernel (nbclient), as a reader on a GPU box
would run it — then every widget's *Run* button pressed for several settings (``book.press_widgets``: each
widget function called with the defaults and with one parameter at a time moved to another option, so the
live re-measurements run too). "Live on a GPU" is checked here, not assumed.

Needs a CUDA GPU (skips without one) and a Jupyter kernel with plotly and ipywidgets. The GPU image has none
of them: ``tests/gpu/fetch_notebook_wheels.sh`` downloads the wheels (``tests/gpu/notebook-wheels.txt``) into
``.whl/``; carry it and install it first, e.g.

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 -m pytest tests/gpu/test_gpu_notebooks.py -x -v

Each notebook runs in its own kernel (its directory as the working directory, as the book build does) with
``SPARSEATTN_BOOK_BUILD`` unset, so ``book.setup()`` chooses the live mode: widgets are built and registered.
The per-notebook time goes to the test's output, so a slow chapter is visible.
"""
import os
import pathlib
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.ipynb"))
PRESSES_PER_WIDGET = 3
PRESS_CELL = (
    "from sparseattn import book\n"
    f"presses = book.press_widgets({PRESSES_PER_WIDGET})\n"
    "print(f'PRESSED {presses} of {len(book.WIDGETS)} widgets')"
)

#: Rehearse on a machine without a GPU (the kernels then run in the interpreter and the widgets take their
#: small CPU paths): the same machinery, run where the GPU is not; not part of CI.
ON_CPU = os.environ.get("SPARSEATTN_NOTEBOOKS_ON_CPU", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs a CUDA GPU")


def _client(nb, cwd: pathlib.Path):
    try:
        from nbclient import NotebookClient
    except ImportError:  # pragma: no cover - the message says how to get them
        pytest.fail("nbclient/ipykernel are not installed: run tests/gpu/fetch_notebook_wheels.sh where pip "
                    "reaches PyPI, carry .whl and install it (see this module's docstring)")
    for mod in ("plotly", "ipywidgets"):
        try:
            __import__(mod)
        except ImportError:
            pytest.fail(f"{mod} is not installed: the notebooks draw with it (see this module's docstring)")
    return NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=False,
                          resources={"metadata": {"path": str(cwd)}})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_live_and_every_widget_runs(path, monkeypatch, capsys):
    import nbformat
    monkeypatch.delenv("SPARSEATTN_BOOK_BUILD", raising=False)  # the kernel inherits the live mode
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(path, as_version=4)
    n_widgets = sum("book.interact(" in "".join(c.source) for c in nb.cells if c.cell_type == "code")
    nb.cells.append(nbformat.v4.new_code_cell(PRESS_CELL))
    t0 = time.perf_counter()
    _client(nb, path.parent).execute()
    elapsed = time.perf_counter() - t0
    first = "".join(o.get("text", "") for o in nb.cells[next(i for i, c in enumerate(nb.cells)
                                                           if "book.setup()" in c.source)].outputs)
    want = "GPU:" if torch.cuda.is_available() else "no GPU"
    assert want in first, f"{path.name}: book.setup() says {first!r}"
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    pressed = int(out.split("PRESSED ")[1].split()[0])
    assert f"of {n_widgets} widgets" in out, f"{path.name}: {n_widgets} book.interact cells, {out!r}"
    assert pressed >= n_widgets, out  # every widget at least at its defaults
    with capsys.disabled():
        print(f"\n{path.name}: ran live in {elapsed:.0f} s, {pressed} widget presses")
