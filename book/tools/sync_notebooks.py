"""Write every notebook's first cell (the Colab install cell) from `repository` in _config.yml.

The repository URL lives in _config.yml alone; this script derives the install cell from it, and
tests/test_book.py fails when a notebook's cell is out of date. Run: python book/tools/sync_notebooks.py
"""
import pathlib
import re
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[2]


def repository() -> tuple:
    text = (ROOT / "_config.yml").read_text()
    block = text[text.index("repository:"):]
    url = re.search(r"^\s+url:\s*(\S+)", block, re.M).group(1)
    branch = re.search(r"^\s+branch:\s*(\S+)", block, re.M).group(1)
    return url, branch


def install_cell_source() -> str:
    url, branch = repository()
    return (
        "# Colab or a fresh kernel: install sparseattn from its repository, keeping the\n"
        "# installed torch/triton (written by book/tools/sync_notebooks.py from _config.yml).\n"
        "import importlib.util, subprocess, sys\n"
        "if importlib.util.find_spec(\"sparseattn\") is None:\n"
        "    pip = [sys.executable, \"-m\", \"pip\", \"install\", \"-q\"]\n"
        f"    src = \"sparseattn @ git+{url}@{branch}\"\n"
        "    subprocess.check_call(pip + [\"--no-deps\", src])\n"
        "    subprocess.check_call(pip + [\"plotly>=5.20\", \"ipywidgets>=8\"])"
    )


def install_cell():
    cell = nbformat.v4.new_code_cell(install_cell_source())
    cell.metadata["tags"] = ["remove-cell"]  # live notebooks show it; the static book does not
    return cell


def sync(path: pathlib.Path) -> bool:
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0] if nb.cells else None
    want = install_cell_source()
    if first is not None and first.cell_type == "code" and first.source == want:
        return False
    if first is not None and first.cell_type == "code" and "sync_notebooks" in first.source:
        first.source = want
    else:
        nb.cells.insert(0, install_cell())
    nbformat.write(nb, path)
    return True


if __name__ == "__main__":
    changed = [p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if sync(p)]
    print("updated:", ", ".join(changed) if changed else "nothing")
    sys.exit(0)
