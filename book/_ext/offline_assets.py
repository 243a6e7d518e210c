"""Sphinx extension: make the built book render with no network.

At build start it (1) marks the process as a static book build (``SPARSEATTN_BOOK_BUILD=1``; notebook kernels
inherit it, so ``sparseattn.book`` picks the static plotly renderer and skips live widgets) and (2) fills
``_vendor/`` (served as static files) with pinned JavaScript: plotly.min.js from the installed plotly
package, and MathJax 3, RequireJS and the Jupyter widgets html-manager from the npm registry (``npm pack``),
plus the book's small stylesheet (:data:`BOOK_CSS`). Nothing is committed; a rebuild reuses what is there.

It also keeps every page free of JavaScript console errors: each page lists a script only once (sphinx-thebe
registers its inline configuration twice, a ``const`` declared twice is a SyntaxError), and the theme gets an
explicit light mode (pydata-sphinx-theme logs an error when no mode is configured).
"""
import os
import pathlib
import shutil
import subprocess
import tarfile
import tempfile

NPM_PACKAGES = {  # what -> (npm spec, member inside the tarball, destination under _vendor)
    "mathjax": ("mathjax@3.2.2", "package/es5", "mathjax"),
    "requirejs": ("requirejs@2.3.8", "package/require.js", "require.min.js"),
    "html-manager": ("@jupyter-widgets/html-manager@1.0.15", "package/dist/embed-amd.js", "embed-amd.js"),
}


def _npm_fetch(spec: str, member: str, dest: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["npm", "pack", spec, "--silent"], cwd=tmp, check=True, capture_output=True,
                             text=True).stdout.strip().splitlines()[-1]
        with tarfile.open(os.path.join(tmp, out)) as tar:
            tar.extractall(tmp, filter="data")
        src = pathlib.Path(tmp, member)
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True)
        else:
            shutil.copyfile(src, dest)


#: Styles for what the book's helpers print: package source (book.source) and HTML tables (viz.Table).
BOOK_CSS = """
.sa-source { margin: 0.5em 0; }
.sa-source-title { font-family: var(--pst-font-family-monospace); font-size: 0.85em; color: #555; }
.sa-source pre { font-size: 0.8em; line-height: 1.35; }
table.sa-table { border-collapse: collapse; font-size: 0.78em; margin: 0.4em 0; max-width: 100%; }
table.sa-table caption { caption-side: top; text-align: left; color: #444; padding-bottom: 4px; }
table.sa-table th, table.sa-table td { border-bottom: 1px solid #ddd; padding: 2px 6px; text-align: right;
                                   overflow-wrap: anywhere; }
table.sa-table th { vertical-align: bottom; }
table.sa-table th:first-child, table.sa-table td:first-child { text-align: left; }
table.sa-table thead th { border-bottom: 2px solid #999; }
div.cell_output pre { white-space: pre-wrap; overflow-wrap: anywhere; }
div.cell_input pre { font-size: 0.76em; }  /* an 88-column code line fits the text column at 1280 px */
"""


def fetch_assets(vendor: pathlib.Path) -> None:
    vendor.mkdir(parents=True, exist_ok=True)
    import plotly
    plotly_js = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not (vendor / "plotly.min.js").exists():
        shutil.copyfile(plotly_js, vendor / "plotly.min.js")
    for spec, member, dest in NPM_PACKAGES.values():
        target = vendor / dest
        if not target.exists():
            _npm_fetch(spec, member, target)
    css = vendor / "sparseattn.css"
    if not css.exists() or css.read_text() != BOOK_CSS:
        css.write_text(BOOK_CSS)


def _on_config_inited(app, config):
    os.environ["SPARSEATTN_BOOK_BUILD"] = "1"
    fetch_assets(pathlib.Path(app.srcdir) / "_vendor")


def _script_key(script) -> tuple:
    """What makes two page scripts the same: the file (an inline script has None or "", depending on who
    added it) and its attributes (an inline script's body among them)."""
    filename = getattr(script, "filename", script) or ""
    attrs = getattr(script, "attributes", {}) or {}
    return (str(filename), tuple(sorted((k, str(v)) for k, v in attrs.items())))


def _page_context(app, pagename, templatename, context, doctree):
    """Each script once per page, in first-seen order (a duplicated inline ``const`` is a SyntaxError), and
    an explicit light mode for the theme's script (it logs an error for an empty one)."""
    if not context.get("default_mode"):
        context["default_mode"] = "light"
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for script in scripts:
        key = _script_key(script)
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"] = kept


def setup(app):
    app.connect("config-inited", _on_config_inited)
    app.connect("html-page-context", _page_context, priority=900)
    app.add_css_file("sparseattn.css")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
