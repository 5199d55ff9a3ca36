"""Research: investigations behind the figures, run as modules from the repository root, e.g.
`python -m research.draft_long` (research/README.md indexes them: question, answer, command). They use the
pipeline's public functions only; extra dependencies: `pip install -e .[bench]`."""
