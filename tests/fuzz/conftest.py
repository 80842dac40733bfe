"""Hypothesis settings for the fuzzers: tests/fuzzing.py's examples per target from its seed (both in
pytest's header), no per-input deadline (a shared CI machine's pauses are not the code's), no example
database (a failure reproduces from the seed, or from the blob Hypothesis prints with it).

    TESSERA_FUZZ_EXAMPLES=200000 .venv/bin/pytest tests/fuzz    # longer, on demand
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, seed, settings

from tests.fuzzing import EXAMPLES, SEED

settings.register_profile(
    "tessera-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)
settings.load_profile("tessera-fuzz")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The run's seed on every target (Hypothesis has no global seed setting but its CLI flag).
    for item in items:
        if isinstance(item, pytest.Function) and hasattr(item.obj, "hypothesis"):
            seed(SEED)(item.obj)
