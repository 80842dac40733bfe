"""Hypothesis settings for the fuzzers: TESSERA_FUZZ_EXAMPLES inputs per target (10,000 by default, in
CI too), no per-input deadline (a shared CI machine's pauses are not the code's), no example
database (every run starts from the same seeded generator: a failure reproduces from its printout).

    TESSERA_FUZZ_EXAMPLES=200000 .venv/bin/pytest tests/fuzz    # longer, on demand
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("TESSERA_FUZZ_EXAMPLES", "10000"))

settings.register_profile(
    "tessera-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=os.environ.get("TESSERA_FUZZ_RANDOM", "") == "",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)
settings.load_profile("tessera-fuzz")
