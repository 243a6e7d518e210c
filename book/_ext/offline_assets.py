"""Sphinx extension: make the built book render with no network.

At build start it (1) marks the process as a static book build (``SPARSEATTN_BOOK_BUILD=1``; notebook kernels
inherit it, so ``sparseattn.book`` picks the static plotly renderer and skips live widgets) and (2) fills
``_vendor/`` (served as static files) with pinned JavaScript: plotly.min.js from the installed plotly
package, and MathJax 3, RequireJS and the Jupyter widgets html-manager from the npm registry (``npm pack``).
Nothing is committed; a rebuild reuses what is there.
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


def _on_config_inited(app, config):
    os.environ["SPARSEATTN_BOOK_BUILD"] = "1"
    fetch_assets(pathlib.Path(app.srcdir) / "_vendor")


def setup(app):
    app.connect("config-inited", _on_config_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
