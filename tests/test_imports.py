"""The package's import graph: layers import only downwards, and no module imports itself back through others.

Read from the source (every ``import`` statement, including the lazy ones inside functions), so a new import
that breaks the layering fails here before anyone trips over a cycle at run time.
"""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "sparseattn"

# lowest first; a module may import its own layer (without a cycle) or any lower one
LAYERS = [
    {"_checks", "_runtime", "_fast_launch"},
    {"patterns"},
    {"predicates", "maskc"},
    {"kernels"},
    {"_tiles"},
    {"interop"},
    {"layout", "paged"},
    {"reference"},
    {"routing", "balance"},
    {"ops"},
    {"roofline"},
    {"bench"},
    {"book", "viz", "exercises", "_catalogue"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: pathlib.Path):
    """Absolute names of the sparseattn modules ``path`` imports (``from . import x`` resolved to ``pkg.x``)."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if _is_type_checking(node) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "sparseattn"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "sparseattn":
                continue
            for a in node.names:  # `from . import ops` imports the module sparseattn.ops, not the package
                sub = PKG.parent / (target + "." + a.name).replace(".", "/")
                out.add(target + "." + a.name if sub.with_suffix(".py").exists() or sub.is_dir() else target)
    return mod, out


def _graph():
    graph = {}
    for path in PKG.rglob("*.py"):
        mod, deps = _imports(path)
        graph[mod] = {d for d in deps if d != mod}
    return graph


def _unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_has_a_layer():
    for mod in _graph():
        unit = _unit(mod)
        assert unit == "" or unit in LAYER_OF, f"{mod}: add its unit {unit!r} to LAYERS"


def test_imports_only_go_down():
    bad = []
    for mod, deps in _graph().items():
        if mod == "sparseattn":  # the facade re-exports the public names
            continue
        for dep in deps:
            if dep == "sparseattn":  # the facade imports ops and everything below it
                if LAYER_OF[_unit(mod)] <= LAYER_OF["ops"]:
                    bad.append(f"{mod} imports the package facade")
                continue
            if _unit(dep) == _unit(mod):
                continue
            if LAYER_OF[_unit(dep)] > LAYER_OF[_unit(mod)]:
                bad.append(f"{mod} (layer {LAYER_OF[_unit(mod)]}) imports {dep} (layer {LAYER_OF[_unit(dep)]})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    # package __init__ modules import their submodules; a submodule importing its package's __init__ is a
    # cycle only through that edge, so resolve "pkg" -> its own imports when looking for cycles
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in graph.get(m, ()):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    cycles = [c for c in cycles if "sparseattn" not in c]  # the facade is imported by users, not by modules
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("bad_edge", [("layout", "ops"), ("kernels", "layout")])
def test_the_check_can_fail(bad_edge, monkeypatch, tmp_path):
    """Plant an upward import in a copy of the graph: the layer check must report it."""
    lo, hi = bad_edge
    assert LAYER_OF[lo] < LAYER_OF[hi]
    graph = _graph()
    some = next(m for m in graph if _unit(m) == lo)
    graph[some] = graph[some] | {f"sparseattn.{hi}"}
    bad = [d for d in graph[some] if d != "sparseattn" and _unit(d) != lo and LAYER_OF[_unit(d)] > LAYER_OF[lo]]
    assert bad
