"""One run's fuzzing budget and seed, for the Hypothesis targets (tests/fuzz) and the hook's libFuzzer
targets (tests/hook/test_fuzz.py); pytest's header prints both (tests/conftest.py).

- ``TESSERA_FUZZ_EXAMPLES``: inputs per Hypothesis target. 1,000 unless set: `make test` (CI) spends
  seconds per target, not minutes; `make fuzz` runs 10,000, `make check` 100.
- ``TESSERA_FUZZ_SEED``: the run's seed, new each run unless set, so that CI tries new inputs every
  run and any run repeats from the seed its header printed (with the same number of examples).
"""

from __future__ import annotations

import os
import secrets

EXAMPLES = int(os.environ.get("TESSERA_FUZZ_EXAMPLES", "1000"))
# libFuzzer takes a positive seed (0 asks it for a random one, which would not be printed).
SEED = int(os.environ.get("TESSERA_FUZZ_SEED") or secrets.randbelow(2**31 - 1) + 1)
# The same seed in `make check`'s worker processes, which pytest starts after importing this.
os.environ["TESSERA_FUZZ_SEED"] = str(SEED)


def header() -> str:
    return (
        f"fuzz: {EXAMPLES} examples per target, seed {SEED} "
        f"(repeat with TESSERA_FUZZ_SEED={SEED} TESSERA_FUZZ_EXAMPLES={EXAMPLES})"
    )
