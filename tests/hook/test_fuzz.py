"""The hook's parsers of external input under libFuzzer with AddressSanitizer and
UndefinedBehaviorSanitizer: the limits file (``hook/src/limits.c``) and the shared region
(``hook/src/snapshot.c``). Each target runs HOOK_FUZZ_RUNS inputs (default 50,000: a second or two;
CI needs at least 10,000), seeded from ``hook/fuzz/seeds`` and from the run's seed
(tests/fuzzing.py); a crash, a sanitizer report, a leak or an input slower than FUZZ_TIMEOUT fails
the test with libFuzzer's report. A longer run: ``HOOK_FUZZ_RUNS=10000000``, or
``make -C hook fuzz FUZZ_RUNS=-1`` (until stopped). Needs clang and its runtime libraries
(``hack/install-sandbox-deps.sh`` installs them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzzing import SEED
from tests.hook.conftest import ROOT

HOOK = ROOT / "hook"
RUNS = int(os.environ.get("HOOK_FUZZ_RUNS", "50000"))
FUZZ_TIMEOUT = 5
MAX_LEN = 4096  # as hook/Makefile gives its targets
TARGETS = ["limits", "region"]


@pytest.fixture(scope="module")
def fuzzers() -> Path:
    if shutil.which("clang") is None:
        pytest.fail("clang is not installed: run hack/install-sandbox-deps.sh (as root)")
    subprocess.run(
        ["make", "-s", "-C", str(HOOK), f"PYTHON={sys.executable}", "fuzz-build"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return HOOK / "build" / "fuzz"


@pytest.mark.parametrize("target", TARGETS)
def test_fuzzer_finds_nothing(target: str, fuzzers: Path, tmp_path: Path) -> None:
    seeds = HOOK / "fuzz" / "seeds" / target
    assert sorted(seeds.iterdir()), f"no seeds in {seeds}"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    done = subprocess.run(
        [
            str(fuzzers / f"{target}_fuzz"),
            f"-runs={RUNS}",
            f"-timeout={FUZZ_TIMEOUT}",
            f"-max_len={MAX_LEN}",
            "-rss_limit_mb=2048",
            f"-seed={SEED}",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
            str(seeds),
        ],
        capture_output=True,
        text=True,
        timeout=None if RUNS < 0 else max(300, RUNS // 100),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    ran = re.search(r"Done (\d+) runs", done.stderr)
    assert ran is not None and int(ran.group(1)) >= RUNS, done.stderr[-2000:]
