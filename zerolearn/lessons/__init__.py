"""Code the chapters build step by step and run on spawned ranks.

Spawned processes import the function they run by name, so what a notebook
launches lives here, one module per chapter, and the notebook shows it with
``inspect.getsource``. The naive versions are lessons, not engines: the package's
engines (``zerolearn.engines``) keep only the real ones.
"""
