"""Exercises of the book, one module per chapter (``chNN_<topic>.py``): each exercise's scaffold (a function or
``@triton.jit`` fragment with a marked blank), its solution, and a ``check_<name>(fn)`` that runs it (kernels
in the Triton interpreter when there is no GPU) and raises AssertionError with a helpful message when wrong."""
