"""Exercises of the book, one module per chapter (``chNN_<topic>.py``): each exercise's scaffold (a function
or ``@triton.jit`` fragment with a marked blank), its solution, and a ``check_<name>(fn)`` that runs a
candidate (Triton fragments in the interpreter, on small shapes) and raises AssertionError with a helpful
message when it is wrong."""
