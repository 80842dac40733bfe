"""`tessera simulate`: compare placement policies on a simulated cluster.

Only argparse is imported at module level: the CLI builds every subcommand's parser, and the
simulator's dependencies (matplotlib above all) load when this command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tessera.cliargs import positive_int, positive_number

DEFAULT_OUT = Path("tessera-simulate-report")
# deploy/speed-profiles.yaml of the checkout this package runs from (an editable install).
REPO_SPEED_PROFILES = Path(__file__).resolve().parents[2] / "deploy" / "speed-profiles.yaml"
POLICY_NAMES = ("exclusive", "gpushare", "hami", "binpack", "spread", "fragmentation", "speed-aware")


def _fraction(text: str) -> float:
    value = positive_number(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most 1 (a share of solo throughput)")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be within 0..1")
    return value


def _use_ratio(text: str) -> Any:
    from simulator.usage import UseRatio  # noqa: PLC0415

    try:
        return UseRatio.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _policies(text: str) -> tuple[str, ...]:
    # Every system the simulator knows may be named; the default compares POLICY_NAMES.
    from simulator.scheduler import SYSTEMS  # noqa: PLC0415

    known = [s.name for s in SYSTEMS]
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        shown = ", ".join(map(repr, unknown)) or repr(text)
        raise argparse.ArgumentTypeError(f"unknown policy {shown}; choose from {', '.join(known)}")
    return names


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay a GPU workload on a simulated cluster and compare placement policies",
        description=(
            "Replay a workload on a simulated cluster through Tessera's placement core and compare "
            "policies: a packing experiment (as in the FGD paper) and a time experiment (queueing, "
            "job completion times). Without --nodes/--pods it runs the embedded default, a cluster and "
            "workload generated from published statistics of the Alibaba GPU trace."
        ),
    )
    parser.add_argument(
        "--nodes", type=Path, help="node list: Alibaba trace CSV (openb_node_list_*.csv) or Tessera YAML"
    )
    parser.add_argument(
        "--pods", type=Path, help="pod list: Alibaba trace CSV (openb_pod_list_*.csv) or Tessera YAML"
    )
    parser.add_argument(
        "--policies",
        type=_policies,
        default=POLICY_NAMES,
        help=f"comma-separated policies to compare (default: all of {','.join(POLICY_NAMES)})",
    )
    parser.add_argument(
        "--experiment",
        choices=("packing", "time", "both", "usage"),
        default="both",
        help="which experiment (default both: packing and time); usage: by requests against usage-aware "
        "placement of best-effort pods (Tessera binpack; the options below)",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="seed of the arrival order and node order (default 42)"
    )
    parser.add_argument(
        "--inflation",
        type=positive_number,
        default=1.3,
        help="packing: add pods until this multiple of GPU capacity has arrived (default 1.3)",
    )
    parser.add_argument(
        "--colocation",
        type=_fraction,
        default=0.68,
        help="time: share of solo throughput a pod keeps on a shared GPU (default 0.68, Gavel's V100 median)",
    )
    usage = parser.add_argument_group("usage experiment")
    usage.add_argument(
        "--best-effort-share",
        type=_share,
        default=0.3,
        help="share of GPU pods that are best-effort (default 0.3)",
    )
    usage.add_argument(
        "--use-ratio",
        type=_use_ratio,
        default="beta:2,3",
        help="distribution of a pod's used / requested GPU memory: beta:A,B, uniform:LOW,HIGH or fixed:X "
        "(default beta:2,3, mean 0.4)",
    )
    usage.add_argument(
        "--burst",
        type=_share,
        default=0.05,
        help="chance per measurement that a guaranteed pod uses its whole request (default 0.05)",
    )
    usage.add_argument(
        "--arrivals-per-measurement",
        type=positive_int,
        default=20,
        help="pods arriving between two measurements of GPU use (default 20)",
    )
    usage.add_argument(
        "--settle-measurements",
        type=positive_int,
        default=100,
        help="measurements after the last arrival, with use changing and evictions (default 100)",
    )
    usage.add_argument(
        "--margin-mib", type=int, default=1024, help="safety margin floor, MiB (default 1024, the extender's)"
    )
    usage.add_argument(
        "--margin-percent",
        type=float,
        default=10.0,
        help="safety margin, percent of a GPU's memory (default 10, the extender's)",
    )
    parser.add_argument(
        "--speed-profiles",
        type=Path,
        help=f"speed profiles YAML (default: {REPO_SPEED_PROFILES} when present, else every GPU 1.0)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"directory for report.json, packing.png and time.png (default ./{DEFAULT_OUT})",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=min(2, os.cpu_count() or 1),
        help="worker processes, one policy each at a time (default: 2 or the CPU count if fewer)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulator import plots, report  # noqa: PLC0415
    from simulator.experiment import Experiment, Options, progress_bar, run_all, work_units  # noqa: PLC0415
    from simulator.inputs import load_inputs  # noqa: PLC0415
    from simulator.model import InputError  # noqa: PLC0415
    from tessera.contract import ContractError  # noqa: PLC0415
    from tessera.placement import SpeedProfiles  # noqa: PLC0415

    try:
        inputs = load_inputs(args.nodes, args.pods)
        profiles_path = args.speed_profiles or (REPO_SPEED_PROFILES if REPO_SPEED_PROFILES.exists() else None)
        profiles = (
            SpeedProfiles() if profiles_path is None else SpeedProfiles.from_yaml(profiles_path.read_text())
        )
    except (InputError, ContractError) as e:
        sys.stderr.write(f"tessera simulate: error: {e}\n")
        return 2
    except OSError as e:
        sys.stderr.write(f"tessera simulate: error: {e.filename}: {e.strerror}\n")
        return 2
    if args.experiment == "usage":
        return _run_usage(args, inputs)
    experiments = {
        "packing": (Experiment.PACKING,),
        "time": (Experiment.TIME,),
        "both": (Experiment.PACKING, Experiment.TIME),
    }[args.experiment]
    if Experiment.TIME in experiments and not inputs.workload.timed:
        if args.experiment == "time":
            sys.stderr.write(
                "tessera simulate: error: the pods have no durations; the time experiment needs them\n"
            )
            return 2
        sys.stdout.write("Note: the pods have no durations; running the packing experiment only.\n")
        experiments = (Experiment.PACKING,)
    options = Options(args.policies, experiments, args.seed, args.inflation, args.colocation)
    if profiles_path is None:
        sys.stdout.write("Note: no speed profiles found; every GPU model counts as speed 1.0.\n")
    with progress_bar(work_units(inputs, options)) as show:
        results = run_all(inputs, options, profiles, args.jobs, show)
    sys.stdout.write(report.render(inputs, options, results) + "\n")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(report.dump_json(report.to_json(inputs, options, results)))
        written = [args.out / "report.json"]
        if Experiment.PACKING in experiments:
            plots.plot_packing(results, args.out / "packing.png")
            written.append(args.out / "packing.png")
        if Experiment.TIME in experiments:
            plots.plot_time(results, args.out / "time.png")
            written.append(args.out / "time.png")
    except OSError as e:
        sys.stderr.write(f"tessera simulate: error: cannot write the report: {e.filename}: {e.strerror}\n")
        return 1
    sys.stdout.write(f"\nWrote {', '.join(str(p) for p in written)}\n")
    return 0


def _run_usage(args: argparse.Namespace, inputs: Any) -> int:
    from simulator import usage  # noqa: PLC0415
    from simulator.experiment import progress_bar  # noqa: PLC0415
    from simulator.packing import arrival_order  # noqa: PLC0415
    from tessera.placement import UsageRule  # noqa: PLC0415

    try:
        rule = UsageRule(margin_mib=args.margin_mib, margin_percent=args.margin_percent)
    except ValueError as e:
        sys.stderr.write(f"tessera simulate: error: {e}\n")
        return 2
    options = usage.UsageOptions(
        seed=args.seed,
        inflation=args.inflation,
        best_effort_share=args.best_effort_share,
        use_ratio=args.use_ratio,
        burst=args.burst,
        arrivals_per_measurement=args.arrivals_per_measurement,
        settle_measurements=args.settle_measurements,
        rule=rule,
    )
    total = 2 * len(arrival_order(inputs.workload, inputs.cluster, options.seed, options.inflation))
    with progress_bar(total) as show:
        done = 0

        def count(n: int) -> None:
            nonlocal done
            done += n
            show(done)

        results = usage.run_usage(inputs.cluster, inputs.workload, options, count)
    sys.stdout.write(usage.render(inputs.description, inputs.cluster, options, results) + "\n")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "usage.json"
        path.write_text(json.dumps(usage.to_json(inputs.description, options, results), indent=2) + "\n")
    except OSError as e:
        sys.stderr.write(f"tessera simulate: error: cannot write the report: {e.filename}: {e.strerror}\n")
        return 1
    sys.stdout.write(f"\nWrote {path}\n")
    return 0
