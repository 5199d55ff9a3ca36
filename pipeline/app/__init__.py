"""The run machinery on top of every layer: the CLI, a run's execution and its runner (stage order, manifests, resume,
the report), the units of a recipe, the executors (local, Ray) and sweeps."""
