"""Every exercise of the book: its check accepts the solution and rejects the scaffold (a blank still in
place) and every listed mistake, so a check can fail; checks run in the Triton interpreter on any machine.

Exercises are found in every ``sparseattn/exercises/chNN_*.py`` module's ``EXERCISES`` list (the
convention in ``sparseattn/exercises/__init__.py``), so a new chapter's exercises are tested here without
editing this file."""
import importlib
import pkgutil

import pytest

import sparseattn.exercises as X

MODULES = sorted(m.name for m in pkgutil.iter_modules(X.__path__) if m.name.startswith("ch"))


def _exercises():
    out = []
    for name in MODULES:
        mod = importlib.import_module(f"sparseattn.exercises.{name}")
        for ex in getattr(mod, "EXERCISES", []):
            out.append(pytest.param(ex, id=f"{name}.{ex.name}"))
    return out


@pytest.mark.parametrize("name", MODULES)
def test_every_chapter_module_lists_its_exercises(name):
    mod = importlib.import_module(f"sparseattn.exercises.{name}")
    exs = getattr(mod, "EXERCISES", None)
    assert exs, f"sparseattn.exercises.{name} must list its exercises in EXERCISES (see the package docstring)"
    assert all(isinstance(e, X.Exercise) for e in exs)


@pytest.mark.parametrize("ex", _exercises())
def test_check_accepts_the_solution(ex, capsys):
    ex.check(ex.solution)
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("ex", _exercises())
def test_check_rejects_the_scaffold_and_every_mistake(ex):
    with pytest.raises(AssertionError, match="blank"):
        ex.check(ex.scaffold)
    assert ex.mistakes, f"{ex.name}: list at least one wrong variant, so the check is shown to fail"
    for wrong in ex.mistakes:
        with pytest.raises(AssertionError):
            ex.check(wrong)


@pytest.mark.parametrize("ex", _exercises())
def test_scaffold_differs_from_the_solution_only_in_its_blanks(ex):
    """The page shows the scaffold: it must be the solution with some lines blanked, nothing else."""
    scaffold = X.show(ex.scaffold).text.splitlines()
    solution = X.show(ex.solution).text.splitlines()
    assert len(scaffold) == len(solution), f"{ex.name}: scaffold and solution have different lengths"
    differ = [(a, b) for a, b in zip(scaffold, solution) if a != b]
    assert differ, f"{ex.name}: the scaffold has no blank"
    for a, b in differ:
        assert "blank(" in a or a.split("(")[0].strip().startswith("def "), \
            f"{ex.name}: a scaffold line differs from the solution without a blank: {a!r} vs {b!r}"


def test_blank_errors_become_assertion_errors_naming_the_exercise():
    def candidate():
        X.blank("the hint")
    with pytest.raises(AssertionError, match="demo: fill in the blank: the hint"):
        X.run("demo", candidate)
    with pytest.raises(AssertionError, match="demo: the candidate raised ZeroDivisionError"):
        X.run("demo", lambda: 1 / 0)


def test_assert_close_reports_nan_and_the_worst_element():
    import torch
    X.assert_close(torch.tensor([1.0, float("-inf")]), torch.tensor([1.0, float("-inf")]), "same")
    with pytest.raises(AssertionError, match="NaN at"):
        X.assert_close(torch.tensor([float("nan")]), torch.tensor([1.0]), "nan")
    with pytest.raises(AssertionError, match=r"2 at \(1,\), expected 3"):
        X.assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), "off")


def test_checks_run_in_the_interpreter_where_triton_compiles_for_a_gpu():
    """On a GPU machine Triton's own helpers (tl.max, tl.zeros, ...) are compiled-only; a check must still
    run its interpreted harness there, and leave the compiled helpers in place afterwards. Simulated in a
    fresh process that believes a GPU is present (no kernel is launched on it)."""
    from conftest import run_fresh_python
    run_fresh_python(
        "import torch; torch.cuda.is_available = lambda: True\n"
        "import sparseattn._runtime as R; assert R.select_backend() == 'cuda'\n"
        "import triton.language as tl; before = tl.max\n"
        "from sparseattn.exercises import all_exercises\n"
        "for ex in all_exercises():\n"
        "    ex.check(ex.solution)\n"
        "    for bad in ex.mistakes:\n"
        "        try:\n"
        "            ex.check(bad)\n"
        "        except AssertionError:\n"
        "            continue\n"
        "        raise SystemExit(f'{ex.name}: a mistake passed')\n"
        "assert tl.max is before, 'the compiled helpers were not restored'\n")


def test_interpreter_scalars_survive_numpy_2_4():
    """NumPy 2.4 made ``int(one_element_array)`` a TypeError (2.3 warns with a DeprecationWarning); Triton
    3.6's interpreter does that for a loop bound loaded from memory. With the warning turned into an error
    (what 2.4+ does), a check whose kernel loops to a loaded count still runs: the package's interpreter
    patch reads the one element instead."""
    import warnings

    import numpy as np
    from sparseattn.exercises import ch01_logical_sparsity as ex
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            int(np.array([3]))
        except (DeprecationWarning, TypeError):
            pass
        else:  # pragma: no cover - a NumPy that still converts silently cannot show the failure
            pytest.skip("this NumPy converts one-element arrays to int without a warning")
        ex.check_visit(ex.visit_solution)


def test_a_check_leaves_triton_as_a_gpu_process_needs_it():
    """Live on a GPU, an exercise check runs its kernel in the interpreter, and a widget compiles GPU kernels
    afterwards in the same process. Triton 3.6 re-patches ``tl.load``, ``tensor.__add__``, ... at every
    nested interpreted call and never restores them (on the H200 the next GPU compile then failed with
    "'block_argument' object has no attribute 'get_element_ty'"). In a fresh process that has chosen the
    GPU backend (TRITON_INTERPRET unset), a check of a kernel with nested helper calls must leave every
    attribute of Triton's language modules and of ``tl.tensor`` as it found it."""
    from conftest import run_fresh_python
    run_fresh_python(
        "import sys, triton.language as tl\n"
        "from sparseattn import _runtime\n"
        "_runtime._BACKEND = 'cuda'\n"
        "from sparseattn.exercises import ch05_prefill as ex\n"
        "def snap():\n"
        "    mods = [m for n, m in list(sys.modules.items()) if n.startswith('triton.language') and m]\n"
        "    return {(id(o), k): v for o in mods + [tl.core.tensor] for k, v in list(vars(o).items())}\n"
        "a = snap()\n"
        "ex.check_online_softmax_step(ex.online_softmax_step_solution)\n"
        "b = snap()\n"
        "changed = [k for k in a if k in b and a[k] is not b[k]]\n"
        "assert not changed, f'{len(changed)} Triton attributes left patched'\n")
