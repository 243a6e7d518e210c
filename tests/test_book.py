"""The book's notebooks, read as source (no execution): the install cell derives from _config.yml, no kernels
are defined in notebooks, live widgets are hidden from the static build, code cells fit in 88 columns, demo
cells assert what they print, and every chapter has the shape of /work/shared/CHAPTER-TEMPLATE.md (claim,
what you will learn, summary, 3-5 exercises, further reading; kernel chapters show the real kernel source and
check a fill-in exercise). Chapters are found by globbing, so a new chapter is checked without editing this
file."""
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "book" / "tools"))
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOTEBOOKS = CHAPTERS + sorted((ROOT / "book").glob("*.ipynb"))
#: Chapters that explain a kernel: they show its source from sparseattn/kernels and end with a fill-in
#: Triton exercise checked in the interpreter.
KERNEL_CHAPTERS = {"05", "06", "07"}
MAX_LINE = 88


def _cells(path):
    nb = json.loads(path.read_text())
    return [(c["cell_type"], "".join(c["source"]), c.get("metadata", {}).get("tags", [])) for c in nb["cells"]]


def _markdown(path) -> str:
    return "\n".join(src for kind, src, _ in _cells(path) if kind == "markdown")


def _code(path, visible_only=False):
    return [(src, tags) for kind, src, tags in _cells(path)
            if kind == "code" and not (visible_only and "remove-cell" in tags)]


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
    for src, tags in _code(path):
        assert "triton.jit" not in src and "@triton" not in src
        if "book.interact(" in src:
            assert "remove-cell" in tags, "live widget cells are hidden in the book"
    assert any("book.setup()" in src for src, _ in _code(path)), "use the shared setup"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_code_cells_fit_in_88_columns(path):
    long = [(i, line) for i, (src, _) in enumerate(_code(path)) for line in src.splitlines()
            if len(line) > MAX_LINE]
    assert not long, f"{path.name}: code lines over {MAX_LINE} characters: " + "; ".join(
        f"cell {i}: {line[:60]}... ({len(line)})" for i, line in long[:5])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_demo_cells_assert_what_they_print(path):
    """A visible cell that prints makes a claim: it must also assert (``assert``, ``book.claim``, or an
    exercise check, which raises when wrong)."""
    bad = [src.splitlines()[0] for src, _ in _code(path, visible_only=True)
           if "print(" in src and not re.search(r"\bassert\b|book\.claim\(|\.check_\w+\(", src)]
    assert not bad, f"{path.name}: cells print without asserting: {bad[:3]}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_has_the_template_shape(path):
    md = _markdown(path)
    first = next(src for kind, src, _ in _cells(path) if kind == "markdown")
    assert "**Claim.**" in first, f"{path.name}: the title cell states the chapter's claim ('**Claim.** ...')"
    for heading in ("What you will learn", "Summary", "Exercises", "Further reading"):
        assert re.search(rf"^## {heading}\s*$", md, re.M), f"{path.name}: no '## {heading}' section"
    learn = md.split("## What you will learn", 1)[1].split("\n## ", 1)[0]
    n_learn = len(re.findall(r"^[-*] ", learn, re.M))
    assert 3 <= n_learn <= 5, f"{path.name}: {n_learn} learning goals (want 3-5)"
    summary = md.split("## Summary", 1)[1].split("\n## ", 1)[0]
    assert 3 <= len(re.findall(r"^[-*] ", summary, re.M)) <= 5, f"{path.name}: the summary has 3-5 points"
    exercises = md.split("## Exercises", 1)[1].split("\n## Further reading", 1)[0]
    n_ex = len(re.findall(r"^\d+\. ", exercises.split("```")[0], re.M))
    assert 3 <= n_ex <= 5, f"{path.name}: {n_ex} exercises (want 3-5, a numbered list)"
    assert "{term}`" in md, f"{path.name}: link the glossary ({{term}}`...`) where a term is first used"
    assert "{py:" in md, f"{path.name}: link function names to the API reference ({{py:func}}`...`)"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_exercises_show_a_scaffold_check_the_solution_and_collapse_it(path):
    code = _code(path, visible_only=True)
    checks = [src for src, _ in code if re.search(r"\.check_\w+\(\s*ex\.\w+_solution\s*\)", src)]
    if path.name[:2] in KERNEL_CHAPTERS:
        assert checks, f"{path.name}: a kernel chapter runs a fill-in exercise's check on its solution"
    if checks:
        assert any("_scaffold)" in src and "source(" in src for src, _ in code), \
            f"{path.name}: show the scaffold's source"
        hidden = [tags for src, tags in code if "_solution)" in src and "source(" in src]
        assert hidden and all({"hide-output", "hide-input", "hide-cell"} & set(t) for t in hidden), \
            f"{path.name}: the solution is shown collapsed (tag its cell hide-output)"


@pytest.mark.parametrize("path", [p for p in CHAPTERS if p.name[:2] in KERNEL_CHAPTERS], ids=lambda p: p.name)
def test_kernel_chapters_show_the_real_kernel_source(path):
    src = "\n".join(s for s, _ in _code(path, visible_only=True))
    shown = re.findall(r"book\.source\((\w+)\.", src)
    imports = re.findall(r"from sparseattn\.kernels import ([\w, ]+)", src)
    kernel_modules = {m.split(" as ")[-1].strip() for line in imports for m in line.split(",")}
    assert kernel_modules and set(shown) & kernel_modules, \
        f"{path.name}: show the kernel with book.source(<module from sparseattn.kernels>.<kernel>, ...)"


def test_viz_draws_no_plotly_tables():
    """Plotly tables scroll rows out of sight inside a fixed-height figure: tables are viz.Table (HTML)."""
    for path in (ROOT / "sparseattn" / "viz").glob("*.py"):
        assert "go.Table" not in path.read_text(), f"{path.name}: use sparseattn.viz.Table"


def test_import_sparseattn_does_not_import_plotly_or_touch_the_gpu():
    from conftest import run_fresh_python
    code = ("import sys, sparseattn; "
            "assert 'plotly' not in sys.modules and 'ipywidgets' not in sys.modules; "
            "assert 'sparseattn.kernels.prefill_fwd' not in sys.modules; "
            "import torch; assert not torch.cuda.is_initialized(); "
            "import os; assert 'TRITON_INTERPRET' not in os.environ")
    run_fresh_python(code)


def test_book_and_exercises_import_without_plotly():
    """The GPU machine has no plotly: the exercises and the book helpers other than figures must import."""
    from conftest import run_fresh_python
    run_fresh_python("import sys; sys.modules['plotly'] = None; sys.modules['ipywidgets'] = None; "
                     "from sparseattn import book, exercises; from sparseattn.exercises import ch05_prefill; "
                     "book.source(ch05_prefill.online_softmax_step_scaffold)")
