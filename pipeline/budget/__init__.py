"""Memory: the one owner of what a stage needs (formulas.py) and of what a stage decides at run time from the memory
it can see (runtime.py). It stands below the quantization methods, which use it; what `compress check` predicts per
stage, which asks those methods, is pipeline/estimate.py."""
