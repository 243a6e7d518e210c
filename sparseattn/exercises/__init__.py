"""Exercises of the book, one module per chapter (``chNN_<topic>.py``): scaffolds with a marked blank, their
solutions, and ``check_<name>(fn)`` functions that run a candidate (Triton fragments in the interpreter, on
small shapes) and raise AssertionError with a helpful message when it is wrong."""
