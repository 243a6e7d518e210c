"""The bad-input catalogue (sparseattn/_catalogue.py): every row raises exactly its exception with a message
that names the argument; every public function has rows; chapter 11 renders the same rows."""
import re

import pytest

import sparseattn
from sparseattn import _catalogue as C

ROWS = C.catalogue()


@pytest.mark.parametrize("entry", ROWS, ids=[f"{e.function}-{e.argument}-{e.kind}" for e in ROWS])
def test_row(entry):
    out = C.check(entry)
    name = entry.argument.split(".")[-1]
    assert re.search(rf"\b{re.escape(name)}\b", out.message) or entry.argument in ("masks", "dst"), \
        f"the message must name the argument {entry.argument!r}: {out.message!r}"


def test_every_public_function_has_rows():
    covered = {e.function.split(".")[0] for e in ROWS} | {e.function for e in ROWS}
    public = {n for n in sparseattn.__all__ if callable(getattr(sparseattn, n)) and not n.endswith("Config")
              and n not in ("TransposedLists",)}
    public |= {"page_bounds", "select_pages_reference", "decode_reference", "BlockLayout.from_mask_mod",
               "BlockLayout.from_block_mask", "BlockLayout.from_dense", "BlockLayout.from_flex"}
    assert public <= covered, public - covered
    kinds = {e.kind for e in ROWS}
    for kind in ("not a tensor", "NaN", "zero", "negative", "on the CPU while a GPU runs the kernels"):
        assert kind in kinds


def test_the_check_can_fail():
    import torch
    wrong_type = C.BadInput("merge_states", "lse_a", "+inf", TypeError, "holds", lambda: C.merge_states(
        torch.zeros(1, 2), torch.tensor([float("inf")]), torch.zeros(1, 2), torch.zeros(1)))
    with pytest.raises(AssertionError, match="should raise TypeError, raised ValueError"):
        C.check(wrong_type)
    silent = C.BadInput("patterns.causal", "-", "nothing wrong", ValueError, "", lambda: sparseattn.patterns.causal())
    with pytest.raises(AssertionError, match="raised nothing"):
        C.check(silent)
    with pytest.raises(AssertionError, match="does not match"):
        C.check(C.BadInput("patterns.sinks", "num_sinks", "negative", ValueError, "window", lambda: C.P.sinks(-1)))


def test_device_rows_restore_the_backend():
    from sparseattn import _runtime
    before = _runtime._BACKEND
    for e in ROWS:
        if "GPU" in e.kind:
            C.check(e)
    assert _runtime._BACKEND == before


def test_table_has_one_line_per_row():
    rows = C.table(ROWS[:5])
    assert [r[:4] for r in rows] == [(e.function, e.argument, e.kind, e.exception.__name__) for e in ROWS[:5]]
