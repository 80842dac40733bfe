"""The hook's cost per call, in instructions counted by callgrind (bench/hook_callgrind.py): a count,
not a time, so the same build of the hook, the fake driver and glibc gives the same number on any
machine, loaded or not. Measured with small call counts (start-up cancels out between them).

Valgrind is installed by hack/install-sandbox-deps.sh (`make test` runs it first)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Instructions the hook may add per call. The targets are 50 (launch without a compute
# quota), 300 (launch with one, nothing to wait for) and 400 (allocation + free). The second is not
# met yet: today's ~400-430 (docs/benchmarks.md says where they go) is held here so that it does not
# grow, until the launch path no longer asks the driver for the current context.
# Counts are exact from run to run for the first and last; the throttled launch varies by about 10
# with when the fake GPU's measurements complete. The margin is for another glibc or compiler, whose
# code around the hook's differs a little.
MARGIN = 1.10
BUDGET = {
    "launch": 50,  # cuLaunchKernel, no compute quota
    "launch_quota": 430,  # cuLaunchKernel, compute quota, nothing to wait for (target: 300)
    "alloc_free": 400,  # cuMemAlloc_v2 + cuMemFree_v2 under a memory quota
}


def test_the_hook_adds_at_most_its_instruction_budget_per_call() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "hook_callgrind.py"),
            "--json",
            "--small",
            "64",
            "--large",
            "320",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    added = json.loads(done.stdout)
    over = {case: round(added[case]) for case, budget in BUDGET.items() if added[case] > budget * MARGIN}
    assert not over, f"over budget {BUDGET} (x{MARGIN}): {over}; all: {added}"
