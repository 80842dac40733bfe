"""The hook's cost on the fake GPU: added ns per cuLaunchKernel (no compute quota) and per
cuMemAlloc_v2 (with a memory quota), hooked against unhooked, p50 and p99; and start-up with 64
processes loading the hook at once (spawn to first allocation done).

    .venv/bin/python -m bench.hook_bench [--calls 200000] [--processes 64] [--rounds 5]

Prints a Markdown table (the one in docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import fakegpu

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def build(work: Path) -> Path:
    fakegpu.build_hook()
    fake = fakegpu.build()
    binary = work / "hook_calls"
    subprocess.run(
        [
            "cc",
            "-O2",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{fakegpu.find_headers_dir('cuda.h')}",
            "-o",
            str(binary),
            str(ROOT / "bench" / "hook_calls.c"),
            f"-L{fake}",
            "-lcuda",
        ],
        check=True,
    )
    return binary


def environment(work: Path, *, hooked: bool, **variables: str) -> dict[str, str]:
    config = fakegpu.write_config(work / "gpus.conf", [fakegpu.example_gpu(0, memory_mib=81920)])
    env = fakegpu.client_env(config, work / "state")
    env.pop("LD_PRELOAD", None)
    if hooked:
        env["LD_PRELOAD"] = str(fakegpu.HOOK_LIBRARY)
    env.update(variables)
    return env


def latencies(binary: Path, mode: str, calls: int, env: dict[str, str]) -> list[int]:
    out = subprocess.run([str(binary), mode, str(calls)], env=env, check=True, capture_output=True, text=True)
    return [int(line) for line in out.stdout.split()]


def startup(binary: Path, processes: int, env: dict[str, str]) -> list[int]:
    started = []
    for _ in range(processes):
        started.append(
            subprocess.Popen(
                [str(binary), "startup", str(time.monotonic_ns())], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    return [int(p.communicate()[0]) for p in started]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--processes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        binary = build(work)
        rows = []
        for mode, variables in (("launch", {}), ("alloc", {"TESSERA_MEMORY_LIMIT": "64g"})):
            results: dict[bool, list[int]] = {}
            for hooked in (False, True):
                env = environment(
                    work, hooked=hooked, TESSERA_REGION=str(work / f"region-{mode}"), **variables
                )
                results[hooked] = latencies(binary, mode, args.calls, env)
            base, hook = results[False], results[True]
            rows.append(
                (
                    "cuLaunchKernel (no compute quota)"
                    if mode == "launch"
                    else "cuMemAlloc_v2 1 MiB (memory quota)",
                    percentile(base, 0.5),
                    percentile(hook, 0.5),
                    percentile(base, 0.99),
                    percentile(hook, 0.99),
                )
            )
        print(
            f"| call ({args.calls} calls, one by one) | unhooked p50 ns | hooked p50 ns | added p50 ns |"
            " unhooked p99 ns | hooked p99 ns | added p99 ns |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, b50, h50, b99, h99 in rows:
            print(
                f"| {name} | {b50:.0f} | {h50:.0f} | {h50 - b50:+.0f} |"
                f" {b99:.0f} | {h99:.0f} | {h99 - b99:+.0f} |"
            )
        print()
        startups: dict[bool, list[int]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for hooked in (False, True):
                env = environment(
                    work,
                    hooked=hooked,
                    TESSERA_MEMORY_LIMIT="64g",
                    TESSERA_REGION=str(work / f"region-startup-{round_}"),
                )
                startups[hooked] += startup(binary, args.processes, env)
        print(
            f"| start-up, {args.processes} processes at once x {args.rounds} rounds"
            " (spawn to first cuMemAlloc done) | p50 ms | p99 ms |"
        )
        print("|---|---|---|")
        for hooked in (False, True):
            values = startups[hooked]
            print(
                f"| {'hooked' if hooked else 'unhooked'} | {percentile(values, 0.5) / 1e6:.2f} |"
                f" {percentile(values, 0.99) / 1e6:.2f} |"
            )
        added = [h - b for h, b in zip(sorted(startups[True]), sorted(startups[False]), strict=True)]
        print(
            f"| added by the hook (same rank) | {statistics.median(added) / 1e6:.2f} |"
            f" {percentile(added, 0.99) / 1e6:.2f} |"
        )


if __name__ == "__main__":
    main()
