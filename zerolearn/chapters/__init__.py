"""The book's chapters, one folder each (``ch00`` to ``ch07``), holding their exercises.

Each exercise is two files. The reader's part, ``<name>.py``, is exactly what the
reader writes: the function's signature and docstring and, between ``# BEGIN
SOLUTION`` and ``# END SOLUTION``, the reference solution (the reader's copy of the
chapter has ``raise NotImplementedError`` there). Its check, ``<name>_check.py``, holds
the trial that runs the reader's function, the known bugs of its kind and the
exercise's registration. The checker, :mod:`zerolearn.exercises`, imports every check.
"""
