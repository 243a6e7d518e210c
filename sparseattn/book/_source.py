"""Package code on the page: :func:`source` shows the real source of a function or Triton kernel (read with
``inspect`` from the installed package, never copied into a notebook), whole or one section at a time.

A *section* is the run of lines after a marker comment ``# ---- <title> ----`` up to the next marker (or the
end of the function): the kernels mark their phases this way, so a chapter can annotate a kernel phase by
phase while the code it shows stays the code that runs.
"""
from __future__ import annotations

import html
import inspect
import re
import textwrap
from typing import List, Optional, Tuple

_MARKER = re.compile(r"^\s*# -{3,}\s*(.*?)\s*-*\s*$")


def _unwrap(obj):
    """The Python function behind a ``@triton.jit`` / ``@triton.heuristics`` / autotuned kernel."""
    seen = 0
    while not inspect.isfunction(obj) and hasattr(obj, "fn") and seen < 8:
        obj = obj.fn
        seen += 1
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)):
        raise TypeError(f"source() takes a function, class, module or Triton kernel, got {type(obj).__name__}")
    return obj


def sections(obj) -> List[Tuple[str, int, int]]:
    """``(title, first line, end line)`` (0-based, end exclusive) of every marked section of ``obj``'s source;
    the lines before the first marker form a section titled ``""``."""
    lines = inspect.getsource(_unwrap(obj)).splitlines()
    marks = [(i, m.group(1)) for i, line in enumerate(lines) if (m := _MARKER.match(line))]
    out, start, title = [], 0, ""
    for i, t in marks:
        out.append((title, start, i))
        start, title = i, t
    out.append((title, start, len(lines)))
    return [s for s in out if s[2] > s[1]]


class Source:
    """Highlighted source text that renders as HTML in a notebook or the static book (``.text`` holds it)."""

    def __init__(self, text: str, title: str = "", first_line: int = 1, path: str = ""):
        self.text, self.title, self.first_line, self.path = text, title, first_line, path

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
            body = highlight(self.text, PythonLexer(), HtmlFormatter(nowrap=True))
        except ImportError:  # pragma: no cover - pygments ships with Jupyter and Sphinx
            body = html.escape(self.text)
        where = f"{html.escape(self.path)}, from line {self.first_line}" if self.path else ""
        head = f'<div class="sa-source-title">{html.escape(self.title)} <small>{where}</small></div>' \
            if (self.title or where) else ""
        return (f'<div class="sa-source">{head}<div class="highlight"><pre style="white-space: pre; '
                f'overflow-x: auto">{body}</pre></div></div>')

    def __repr__(self) -> str:
        return self.text


def source(obj, section: Optional[str] = None, *, start: Optional[str] = None, stop: Optional[str] = None,
           dedent: bool = True) -> Source:
    """The source of ``obj`` (a function, class, module or Triton kernel) as a displayable :class:`Source`.

    ``section``: the start of a section title (``"which rows"`` selects ``# ---- which rows this program
    owns ----``); the lines from that marker to the next. ``start``/``stop``: the lines from the first one
    containing ``start`` up to (not including) the next one containing ``stop`` (``stop=None``: to the end),
    for code without markers. Raises ValueError naming what was not found, so a chapter whose anchor
    disappeared from the code fails its build instead of showing the wrong lines."""
    fn = _unwrap(obj)
    lines, first = inspect.getsourcelines(fn)
    path = inspect.getsourcefile(fn) or ""
    short = path[path.rfind("sparseattn/"):] if "sparseattn/" in path else path
    title = getattr(fn, "__qualname__", getattr(fn, "__name__", ""))
    if section is not None and (start is not None or stop is not None):
        raise ValueError("give either section or start/stop, not both")
    if section is not None:
        found = [s for s in sections(fn) if s[0].startswith(section)]
        if len(found) != 1:
            names = [s[0] for s in sections(fn) if s[0]]
            raise ValueError(f"section must start one section title of {title} exactly once; "
                             f"got {section!r}, titles: {names}")
        t, a, b = found[0]
        lines, first, title = lines[a:b], first + a, f"{title}: {t}"
    elif start is not None or stop is not None:
        a = 0
        if start is not None:
            hits = [i for i, line in enumerate(lines) if start in line]
            if not hits:
                raise ValueError(f"start={start!r} is on no line of {title}")
            a = hits[0]
        b = len(lines)
        if stop is not None:
            hits = [i for i, line in enumerate(lines) if stop in line and i > a]
            if not hits:
                raise ValueError(f"stop={stop!r} is on no line of {title} after line {first + a}")
            b = hits[0]
        lines, first = lines[a:b], first + a
        title = f"{title}, lines {first}-{first + len(lines) - 1}"
    text = "".join(lines).rstrip("\n")
    return Source(textwrap.dedent(text) if dedent else text, title, first, short)
