"""Live resize in the hook, on the fake GPU: how long a running process takes to follow its limits
file once the device plugin replaced it (by a rename).

* memory: a process holds its whole 1024 MiB quota in 256 MiB blocks; the file is replaced by one
  with 2048 MiB and the process is told at once; it asks for a block every 5 ms until one is
  granted (the test client's `await`). Reported: the time to the first block, and to the fourth.
* compute: a process launches 1 ms kernels flat out at 30%; at 3 s the file is replaced by one
  with 60%. Reported: the first 250 ms window after the replacement whose share is 50% or more.

    .venv/bin/python -m bench.resize_follow [--rounds 5]

Prints the Markdown tables in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import fakegpu
from bench.qos_latency import build_client  # the same hook client, built the same way
from hook.limits import DeviceLimit, write_limits

MIB = 2**20
KERNEL, KERNEL_SECONDS = "sleep_us_1000", 1e-3
WINDOW = 0.25


def env_for(work: Path, config: Path, limits: Path) -> dict[str, str]:
    env = fakegpu.client_env(config, work / "state")
    env.update(LD_PRELOAD=str(fakegpu.HOOK_LIBRARY), TESSERA_LIMITS_FILE=str(limits))
    return env


def memory_round(client: Path) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec = fakegpu.example_gpu(0)
        config = fakegpu.write_config(work / "gpus.conf", [spec])
        limits = work / "limits.d" / "limits"
        region = str(work / "region")
        write_limits(limits, [DeviceLimit(spec.uuid, 1024 * MIB, 0)], region=region)
        script = ["alloc", "256m"] * 4 + ["wait-stdin"] + ["await", "alloc", "256m", "30"] * 4
        process = subprocess.Popen(
            [str(client), "dlsym", *script],
            env=env_for(work, config, limits),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # the hook's line about the new quotas
            text=True,
        )
        assert process.stdin is not None and process.stdout is not None
        lines = [process.stdout.readline().strip() for _ in range(5)]
        assert lines[-1] == "waiting", lines
        write_limits(limits, [DeviceLimit(spec.uuid, 2048 * MIB, 0)], region=region)
        process.stdin.write("go\n")
        process.stdin.flush()
        out, _ = process.communicate(timeout=120)
        taken = [float(line.split()[2]) for line in out.splitlines() if line.startswith("ok")]
        assert len(taken) == 4, out
        return taken[0], sum(taken)


def compute_round(client: Path) -> float | None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec = fakegpu.example_gpu(0)
        config = fakegpu.write_config(work / "gpus.conf", [spec])
        limits = work / "limits.d" / "limits"
        region = str(work / "region")
        write_limits(limits, [DeviceLimit(spec.uuid, 1024 * MIB, 30)], region=region)
        process = subprocess.Popen(
            [str(client), "dlsym", "launch", KERNEL, "100000000", "8"],
            env=env_for(work, config, limits),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # the hook's line about the new quotas
            text=True,
        )
        assert process.stdout is not None
        ticks: list[tuple[float, int]] = []
        resized_at = None
        for line in process.stdout:
            if not line.startswith("tick"):
                continue
            _, t, n = line.split()
            ticks.append((float(t), int(n)))
            if resized_at is None and float(t) >= 3.0:
                write_limits(limits, [DeviceLimit(spec.uuid, 1024 * MIB, 60)], region=region)
                resized_at = float(t)
        process.wait(timeout=60)
        assert resized_at is not None
        for i, (t0, n0) in enumerate(ticks):
            later = [(t, n) for t, n in ticks[i + 1 :] if t - t0 >= WINDOW]
            if t0 < resized_at or not later:
                continue
            t1, n1 = later[0]
            if 100.0 * (n1 - n0) * KERNEL_SECONDS / (t1 - t0) >= 50:
                return t1 - resized_at
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        client = build_client(Path(tmp))
        print("| round | first block after the file's replacement, ms | all four blocks, ms |")
        print("|---|---|---|")
        for i in range(args.rounds):
            first, four = memory_round(client)
            print(f"| {i + 1} | {first * 1000:.0f} | {four * 1000:.0f} |")
        print()
        print("| round | first window at >= 50% after the replacement (30% -> 60%), s |")
        print("|---|---|")
        for i in range(args.rounds):
            followed = compute_round(client)
            print(f"| {i + 1} | {'not within the run' if followed is None else f'{followed:.2f}'} |")


if __name__ == "__main__":
    main()
