"""The real GPU's numbers, replayed on the fake: `bench/real_gpu.py --checks timing,qos,mps` (its driver
probes run on both) on a fake H200, with MPS started by the fake's stand-in control daemon, and the
SHAPE of what an NVIDIA H200 measured asserted (docs/fakegpu.md, "Time model"):

- a service (one 250 us kernel every 3 ms) beside batch kernels of 500, 2000 and 8000 us waits about
  one time slice, not for the batch's kernel or queue;
- the best-effort class's yield does not make the service meaningfully faster than beside an
  unhooked batch (time slices, not queues, decide its wait);
- under MPS, beside a batch at below-normal priority capped at 50% of the threads, the service keeps
  about its latency alone and the batch most of its rate;
- MPS mode as shipped (the hook sets each container's MPS client from its limits, over the
  container's own environment) meets issue 25's targets: the latency-critical tail within 2x of its
  tail alone (p99 on the real GPU), the best-effort batch at least half its rate; and a standard
  container keeps its share within 2 points beside best-effort work.

Host timings on a loaded 2-core machine only grow, so bounds are generous where they could; the
exact simulated numbers are asserted with CUDA events in test_timeline.py. Where the H200's numbers
are a p99, the replay holds the tail at p90: its rarest 1% are the host's pauses, not the model's
(a CI run beside the sandbox tests: 6.2 ms p99 and 43 ms max for a service whose p50 was 0.41 ms,
0.63 ms p99 on the idle machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fakegpu

# Its p99 bounds do not hold beside make check's other workers on 2 cores (a run failed so).
pytestmark = pytest.mark.alone

ROOT = Path(__file__).resolve().parents[2]
# The time slice and switch the fake's defaults use (docs/fakegpu.md), in ms.
SLICE_MS = 1.2
SWITCH_MS = 0.1


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    fakegpu.build()
    hook = fakegpu.build_hook()
    tmp = tmp_path_factory.mktemp("replay")
    h200 = fakegpu.example_gpu(
        0, model="NVIDIA H200", memory_mib=143771, sm_count=132, compute_capability="9.0"
    )
    config = fakegpu.write_config(tmp / "gpus.conf", [h200])
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_", "NVIDIA_", "LD_PRELOAD", "TESSERA_"))
    }
    env = fakegpu.client_env(config, tmp / "state", base)
    # The stand-in nvidia-cuda-mps-control, found on the PATH as the real one is.
    env["PATH"] = f"{fakegpu.BIN_DIR}:{env.get('PATH', '')}"
    out = tmp / "results.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.real_gpu",
            "--hook",
            str(hook),
            "--checks",
            "timing,qos,mps",
            "--json",
            str(out),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results: dict[str, dict[str, Any]] = {}
    for line in out.read_text().splitlines():
        results.update(json.loads(line))
    errors = {name: r for name, r in results.items() if "error" in r}
    assert not errors, errors
    return results


def test_a_service_beside_batch_kernels_waits_one_time_slice_not_the_kernel(
    table: dict[str, dict[str, Any]],
) -> None:
    alone = table["timing service alone"]
    assert alone["p50_ms"] < 1.0, alone
    for kernel_us in (500, 2000, 8000):
        beside = table[f"timing service beside {kernel_us} us batch kernels"]
        wait = beside["p50_ms"] - alone["p50_ms"]
        # The H200: 1.1-1.4 ms more (less beside 500 us kernels, whose batch runs out of queued work
        # within the slice more often); never the 8 ms kernel.
        assert 0.5 <= wait <= SLICE_MS + SWITCH_MS + 1.5, (kernel_us, alone, beside)
        batch = table[f"timing service beside {kernel_us} us batch kernels: batch"]
        # It loses the service's kernels and the switches (the H200: 0.88-0.90 of its rate alone); the
        # host's pauses on a loaded machine can make its stretch alone the slower one.
        assert 0.6 <= batch["beside_over_alone"] <= 1.25, (kernel_us, batch)


def test_the_best_effort_yield_does_not_shorten_the_wait(table: dict[str, dict[str, Any]]) -> None:
    unhooked = table["qos driver: latency-critical beside unhooked batch"]
    best_effort = table["qos driver: latency-critical beside best-effort batch"]
    alone = table["qos driver: latency-critical alone"]
    # The H200: p99 2.05 ms beside the best-effort batch, 1.71 beside the unhooked one.
    assert best_effort["p50_ms"] >= 0.7 * unhooked["p50_ms"], (alone, unhooked, best_effort)
    assert best_effort["p50_ms"] - alone["p50_ms"] >= 0.5, (alone, best_effort)


def test_under_mps_a_capped_low_priority_batch_leaves_the_service_its_latency(
    table: dict[str, dict[str, Any]],
) -> None:
    assert table["mps daemon"]["rc"] == 0, table["mps daemon"]
    alone = table["qos driver under MPS: latency-critical alone"]
    for percentage in ("50", "25"):
        name = f"qos driver under MPS: latency-critical beside batch below normal, {percentage}% threads"
        beside, batch = table[name], table[f"{name}: batch"]
        # The H200 at 50%: p50 0.379 / p99 0.434 ms against 0.296 / 0.336 alone; the batch at 1.0.
        assert beside["p50_ms"] <= 2 * alone["p50_ms"], (percentage, alone, beside)
        assert beside["p90_ms"] <= 2 * alone["p90_ms"] + 0.5, (percentage, alone, beside)
        assert batch["beside_over_alone"] >= 0.5, (percentage, batch)
    # Holding every SM, the batch makes the service wait for its kernels' ends, priority or not.
    full = table["qos driver under MPS: latency-critical beside batch at priority below normal"]
    assert full["p50_ms"] - alone["p50_ms"] >= 0.3, (alone, full)


def test_mps_mode_as_shipped_meets_the_targets(table: dict[str, dict[str, Any]]) -> None:
    alone = table["mps mode driver: latency-critical alone"]
    name = "mps mode driver: latency-critical beside best-effort batch, 50% threads"
    beside, batch = table[name], table[f"{name}: batch"]
    # The H200: p99 0.789 ms against 0.652 alone (1.21x); the batch at 1.0 of its rate.
    assert beside["p90_ms"] <= 2 * alone["p90_ms"] + 0.5, (alone, beside)
    assert batch["beside_over_alone"] >= 0.5, batch


def test_a_standard_container_keeps_its_share_beside_best_effort(table: dict[str, dict[str, Any]]) -> None:
    alone = table["qos driver: standard 30% alone"]["steps_per_s"]
    beside = table["qos driver: standard 30% beside best-effort batch"]["steps_per_s"]
    # 1000 us kernels at 30%: 300 a second is its whole share; within 2 points is 280 (the H200: 312
    # alone, 313 beside).
    assert beside >= alone * (28 / 30), (alone, beside)
