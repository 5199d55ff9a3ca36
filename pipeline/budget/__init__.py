"""Memory and disk: the one owner of what a stage needs (formulas.py), what `compress check` predicts (estimate.py)
and what a stage decides at run time (runtime.py)."""
