"""Benchmarks of the product and its tools, each run from the repository root as
``python -m bench.<name>`` (docs/benchmarks.md has each one's command and results)."""
