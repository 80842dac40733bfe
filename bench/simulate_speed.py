"""Speed-aware placement against speed-blind binpack in the time experiment, over several seeds.

Usage::

    .venv/bin/python -m bench.simulate_speed [--nodes FILE --pods FILE] [--seeds 42,43,44,45,46]

Without files it uses the embedded default (heterogeneous: T4, P100, V100, A10 and the trace's G2/G3
GPUs; pods of the classes ``llm-training`` and ``inference``). Prints, as Markdown, mean and p99 JCT,
mean wait and makespan for ``binpack`` and ``speed-aware`` per seed and the mean change.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from simulator.command import REPO_SPEED_PROFILES
from simulator.experiment import Experiment, Options, run_all
from simulator.inputs import load_inputs
from tessera.placement import SpeedProfiles


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=Path)
    parser.add_argument("--pods", type=Path)
    parser.add_argument("--seeds", default="42,43,44,45,46")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    inputs = load_inputs(args.nodes, args.pods)
    profiles = SpeedProfiles.from_yaml(REPO_SPEED_PROFILES.read_text())
    sys.stdout.write(
        f"Input: {inputs.description}\n\n"
        "| seed | policy | mean JCT s | p99 JCT s | mean wait s | makespan s |\n|---|---|---|---|---|---|\n"
    )
    cuts = []
    for seed in (int(s) for s in args.seeds.split(",")):
        options = Options(("binpack", "speed-aware"), (Experiment.TIME,), seed=seed)
        blind, aware = (r.time for r in run_all(inputs, options, profiles, args.jobs))
        assert blind is not None and aware is not None
        for name, t in (("binpack", blind), ("speed-aware", aware)):
            sys.stdout.write(
                f"| {seed} | {name} | {t.mean_jct:.0f} | {t.p99_jct:.0f} | {t.mean_queueing:.1f} "
                f"| {t.makespan:.0f} |\n"
            )
        cuts.append(100 * (blind.mean_jct - aware.mean_jct) / blind.mean_jct)
    sys.stdout.write(
        f"\nspeed-aware lowers mean JCT by {statistics.mean(cuts):.1f}% on average "
        f"(per seed: {', '.join(f'{c:.1f}%' for c in cuts)})\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
