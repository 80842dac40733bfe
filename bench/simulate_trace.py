"""Packing experiment on the Alibaba GPU trace (FGD paper protocol) for every policy, and timings.

Usage::

    .venv/bin/python -m bench.simulate_trace --traces ../shared/traces/alibaba-gpu-v2023 \\
        [--variants default,gpushare40,...] [--seeds 42,43,44] [--jobs 2] [--json out/simulate-trace.json]

For each trace variant (openb_pod_list_<variant>.csv on openb_node_list_gpu_node.csv) and seed, runs
the packing experiment of every policy through ``simulator`` and prints, as Markdown, the mean
over seeds of the allocation rate and the unallocated GPUs at 90/95/100% arrived load, and
fragmentation's cut in unallocated GPUs against binpack and against the best other policy. With
``--time`` it also runs the time experiment on the default trace. Wall and CPU time of each
(variant, seed) run of all policies, and the mean time per placement decision, are printed too.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from simulator import report
from simulator.command import POLICY_NAMES, REPO_SPEED_PROFILES
from simulator.experiment import Experiment, Options, SystemResult, run_all
from simulator.inputs import load_inputs
from tessera.placement import SpeedProfiles

LOADS = (90, 95, 100)


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def cut(new: float, old: float) -> float:
    return 100 * (old - new) / old if old else 0.0


def packing_rows(runs: list[list[SystemResult]]) -> tuple[list[str], dict[str, float]]:
    """Markdown rows (mean over seeds) and each policy's mean unallocated % at 100%."""
    rows = []
    unallocated_100: dict[str, float] = {}
    for i, first in enumerate(runs[0]):
        name = first.system.name
        packings = [run[i].packing for run in runs]
        assert all(p is not None for p in packings)
        alloc = [p.allocation_at(100) for p in packings if p]
        cells = []
        for load in LOADS:
            percents = [p.unallocated_at(load)[0] for p in packings if p]
            gpus = [p.unallocated_at(load)[1] for p in packings if p]
            cells.append(f"{statistics.mean(percents):.2f} / {statistics.mean(gpus):.0f}")
        unallocated_100[name] = statistics.mean(100 - a for a in alloc)
        spread = f" ± {statistics.stdev(alloc):.2f}" if len(alloc) > 1 else ""
        decision = statistics.mean(p.mean_decision_ms for p in packings if p)
        mean = statistics.mean(alloc)
        rows.append(f"| {name} | {mean:.2f}{spread} | {' | '.join(cells)} | {decision:.2f} |")
    return rows, unallocated_100


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", type=Path, required=True, help="folder of the trace's CSV files")
    parser.add_argument("--variants", default="default", help="comma-separated pod list variants")
    parser.add_argument("--seeds", default="42", help="comma-separated seeds")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--time", action="store_true", help="also run the time experiment on each variant")
    parser.add_argument("--json", type=Path, help="write every run's report here")
    args = parser.parse_args()
    profiles = SpeedProfiles.from_yaml(REPO_SPEED_PROFILES.read_text())
    policies = tuple(args.policies.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    everything: dict[str, Any] = {}
    for variant in args.variants.split(","):
        inputs = load_inputs(
            args.traces / "openb_node_list_gpu_node.csv", args.traces / f"openb_pod_list_{variant}.csv"
        )
        runs: list[list[SystemResult]] = []
        experiments = (Experiment.PACKING, Experiment.TIME) if args.time else (Experiment.PACKING,)
        for seed in seeds:
            options = Options(policies, experiments, seed=seed)
            wall, cpu = time.perf_counter(), cpu_seconds()
            results = run_all(inputs, options, profiles, args.jobs)
            wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
            runs.append(results)
            everything[f"{variant}/{seed}"] = report.to_json(inputs, options, results)
            decisions = sum(
                (r.packing.pods if r.packing else 0) + (r.time.decisions if r.time else 0) for r in results
            )
            sys.stdout.write(
                f"<!-- {variant} seed {seed}: {len(policies)} policies, {decisions} placement decisions, "
                f"wall {wall:.0f} s, CPU {cpu:.0f} s with --jobs {args.jobs} -->\n"
            )
            sys.stdout.flush()
        rows, unallocated = packing_rows(runs)
        sys.stdout.write(
            f"\n**{variant}** ({len(inputs.workload.pods)} pods, seeds {args.seeds}): allocation rate at "
            "100% arrived, unallocated GPUs (% / GPUs) by arrived load, mean ms per decision\n\n"
            "| policy | alloc % at 100% | unalloc at 90% | at 95% | at 100% | ms/decision |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
        )
        if "fragmentation" in unallocated:
            fgd = unallocated["fragmentation"]
            others = {k: v for k, v in unallocated.items() if k != "fragmentation"}
            best = min(others, key=lambda k: others[k]) if others else None
            line = f"\nfragmentation leaves {fgd:.2f}% unallocated"
            if "binpack" in others:
                line += f"; {cut(fgd, others['binpack']):.0f}% fewer than binpack ({others['binpack']:.2f}%)"
            if best is not None:
                line += f"; best other: {best} ({others[best]:.2f}%, cut {cut(fgd, others[best]):.0f}%)"
            sys.stdout.write(line + "\n")
        if args.time:
            for i, first in enumerate(runs[0]):
                times = [t for run in runs if (t := run[i].time) is not None]
                jct = statistics.mean(t.mean_jct for t in times)
                p99 = statistics.mean(t.p99_jct for t in times)
                wait = statistics.mean(t.mean_queueing for t in times)
                sys.stdout.write(
                    f"time {first.system.name}: mean JCT {jct:.0f} s, p99 {p99:.0f} s, "
                    f"mean wait {wait:.0f} s\n"
                )
        sys.stdout.flush()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
