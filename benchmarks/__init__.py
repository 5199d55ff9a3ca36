"""Benchmarks: scripts run as modules from the repository root, e.g. `python -m benchmarks.speed_vs_reference`
(README.md here lists them). They use the pipeline's public functions only; extra dependencies:
`pip install -e .[bench]`."""
