"""Instructions the hook adds per call, counted by callgrind (valgrind) on the fake GPU: a
zero-length kernel launch without a compute quota, the same with a compute quota and nothing to
wait for (without a class, then in each QoS class on a GPU with a coordination area), and a 1 MiB
cuMemAlloc_v2/cuMemFree_v2 pair under a memory quota.

    .venv/bin/python -m bench.hook_callgrind [--small 200] [--large 2000] [--json]

bench/hook_calls.c runs unhooked and with LD_PRELOAD of the hook under
``valgrind --tool=callgrind --toggle-collect=counted_*``: only what runs inside the client's
measured loop is counted, every instruction of it (the hook, the driver calls the hook makes, the
fake driver's own work), in the calling thread only (not the hook's monitor thread). Per call:
((hooked - unhooked) at N=large - (hooked - unhooked) at N=small) / (large - small), so that what
the first calls cost once (resolving symbols, joining the region) cancels. Counts are deterministic
for a given build of the hook, the fake driver and glibc, but for how many launches are measured
(one in 64, or after 1 ms of estimated work: under valgrind a zero-length kernel's events time the
slowed launch itself, about 18 us, so the work bound comes first, a little sooner or later from run
to run): a few instructions per launch.

The compute quota is 90%: the same slowed timing makes each launch's estimate about half of its
period under valgrind, so at 50% the launches would wait for the bucket, which is not the case
counted here ("nothing to wait for").

Prints a Markdown table (the one in docs/benchmarks.md), or with --json one object
{case: instructions per call}."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import fakegpu
from bench.hook_bench import build  # the same client, built the same way

VALGRIND = "valgrind"


@dataclass(frozen=True)
class Case:
    key: str
    title: str
    mode: str
    variables: dict[str, str]
    # Runs with a coordination area (TESSERA_COORDINATION in the work dir): the QoS classes' path.
    coordinated: bool = False


CASES = (
    Case("launch", "cuLaunchKernel, zero-length (no compute quota)", "count-launch", {}),
    Case(
        "launch_quota",
        "cuLaunchKernel, zero-length (compute quota 90%, nothing to wait for)",
        "count-launch",
        {"TESSERA_CORES": "90"},
    ),
    Case("alloc_free", "cuMemAlloc_v2 + cuMemFree_v2, 1 MiB (memory quota)", "count-alloc", {}),
    Case(
        "launch_standard",
        "cuLaunchKernel, zero-length (compute quota, standard with a coordination area: publishes its span)",
        "count-launch",
        {"TESSERA_CORES": "90"},
        coordinated=True,
    ),
    Case(
        "launch_latency_critical",
        "cuLaunchKernel, zero-length (compute quota, latency-critical: publishes its span)",
        "count-launch",
        {"TESSERA_CORES": "90", "TESSERA_QOS": "latency-critical"},
        coordinated=True,
    ),
    Case(
        "launch_best_effort",
        "cuLaunchKernel, zero-length (best-effort, no higher class on the GPU: nothing to wait for)",
        "count-launch",
        {"TESSERA_CORES": "90", "TESSERA_QOS": "best-effort"},
        coordinated=True,
    ),
    Case(
        "launch_elastic",
        "cuLaunchKernel, zero-length (compute quota, elastic standard with a coordination area)",
        "count-launch",
        {"TESSERA_CORES": "90", "TESSERA_ELASTIC": "1"},
        coordinated=True,
    ),
)


def environment(work: Path, name: str, *, hooked: bool, case: Case) -> dict[str, str]:
    config = fakegpu.write_config(work / "gpus.conf", [fakegpu.example_gpu(0, memory_mib=81920)])
    env = fakegpu.client_env(config, work / f"state-{name}")
    env.pop("LD_PRELOAD", None)
    if hooked:
        env["LD_PRELOAD"] = str(fakegpu.HOOK_LIBRARY)
        env["TESSERA_MEMORY_LIMIT"] = "64g"
        env["TESSERA_REGION"] = str(work / f"region-{name}")
        env.update(case.variables)
        if case.coordinated:
            env["TESSERA_COORDINATION"] = str(work / f"coordination-{name}")
    return env


def instructions(binary: Path, mode: str, calls: int, env: dict[str, str], out: Path) -> int:
    """Instructions executed inside the client's counted loop (all of them, hook and driver)."""
    subprocess.run(
        [
            VALGRIND,
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=counted_launches",
            "--toggle-collect=counted_allocs",
            f"--callgrind-out-file={out}",
            str(binary),
            mode,
            str(calls),
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    match = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
    if not match:
        raise RuntimeError(f"no instruction total in {out}")
    return int(match.group(1))


def measure(small: int, large: int) -> dict[str, float]:
    """Instructions the hook adds per call, for each case of CASES."""
    if large <= small:
        raise ValueError("--large must exceed --small")
    if not shutil.which(VALGRIND):
        raise RuntimeError("valgrind not found (Debian: apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        binary = build(work)
        added: dict[str, float] = {}
        for case in CASES:
            extra = []
            for calls in (small, large):
                counts = {}
                for hooked in (False, True):
                    name = f"{case.key}-{calls}-{'hooked' if hooked else 'unhooked'}"
                    env = environment(work, name, hooked=hooked, case=case)
                    counts[hooked] = instructions(binary, case.mode, calls, env, work / f"{name}.out")
                extra.append(counts[True] - counts[False])
            added[case.key] = (extra[1] - extra[0]) / (large - small)
        return added


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--large", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print {case: instructions per call}")
    args = parser.parse_args()
    added = measure(args.small, args.large)
    if args.json:
        print(json.dumps(added))
        return
    print(f"| call (callgrind, N = {args.small} and {args.large}) | instructions added per call |")
    print("|---|---|")
    for case in CASES:
        print(f"| {case.title} | {added[case.key]:.0f} |")


if __name__ == "__main__":
    main()
