"""Where the GPUs left unallocated in the packing experiment go, and what an offline packer would leave.

Usage::

    .venv/bin/python -m bench.simulate_headroom --traces ../shared/traces/alibaba-gpu-v2023 \\
        [--variant default] [--seeds 42] [--policies fragmentation,fgd-paper,binpack] [--load 100]

For each seed and policy, replays the FGD paper's packing experiment (``simulator``) up to
``--load`` % arrived and prints:

* the pods that failed, by class (GPUs asked, fractional or whole, bound to a GPU model or not), with
  the arrived load at the first failure of each class;
* the idle GPU capacity left, split by why: on a node whose free CPU is below what 90% of the
  workload's GPU pods ask ("CPU-starved"); on a GPU whose free share is below what 90% of its
  fractional pods ask ("residue", with the GPU's used share, which names the pods that left it);
  whole free GPUs; other partly free GPUs.

And, per seed, an offline reference that no online policy is held to: the fractional pods arrived
up to ``--load`` packed best-fit-decreasing onto GPUs (ignoring CPU and nodes); its waste if every
one of them is placed; a lower bound on that waste (each pod over half a GPU owns its GPU, whose
rest only smaller pods can fill, in any split); and the least ``max(waste, dropped)`` found by
leaving out the emptiest GPUs of that packing (at 100% arrived the GPUs left idle equal the demand
that failed, so an offline packer trades one for the other).
"""

from __future__ import annotations

import argparse
import bisect
from collections import Counter
from pathlib import Path

from simulator.inputs import load_inputs
from simulator.model import MILLI_PER_GPU, Cluster, SimPod, Workload
from simulator.packing import arrival_order
from simulator.scheduler import SimScheduler, system_named
from tessera.placement import SpeedProfiles
from tessera.placement.fragmentation import free_share

# "What 90% of the pods ask": the 10th percentile of a request.
PERCENTILE = 10


def pod_class(pod: SimPod) -> str:
    kind = "CPU-only" if not pod.num_gpu else "fractional" if pod.fractional else "whole"
    bound = " bound to " + "|".join(pod.gpu_models) if pod.gpu_models else ""
    return f"{pod.num_gpu}-GPU {kind}{bound}"


def low_percentile(values: list[int]) -> int:
    return sorted(values)[len(values) * PERCENTILE // 100]


def arrived_pods(order: list[SimPod], cluster: Cluster, load: float) -> list[SimPod]:
    limit = load / 100 * cluster.total_gpus * MILLI_PER_GPU
    arrived, pods = 0, []
    for pod in order:
        arrived += pod.total_gpu_milli
        if arrived > limit:
            break
        pods.append(pod)
    return pods


def replay(cluster: Cluster, workload: Workload, policy: str, seed: int, pods: list[SimPod]) -> None:
    scheduler = SimScheduler(cluster, system_named(policy), SpeedProfiles(), workload.pods, seed)
    capacity = cluster.total_gpus * MILLI_PER_GPU
    failed: Counter[str] = Counter()
    first: dict[str, float] = {}
    arrived = 0
    for pod in pods:
        arrived += pod.total_gpu_milli
        if scheduler.place(pod) is None:
            name = pod_class(pod)
            failed[name] += pod.total_gpu_milli
            first.setdefault(name, 100 * arrived / capacity)
    starved_cpu = low_percentile([p.cpu_milli for p in workload.pods if p.num_gpu])
    residue_share = (
        low_percentile([p.gpu_milli for p in workload.pods if p.fractional]) * 100 // MILLI_PER_GPU
    )
    idle: Counter[str] = Counter()
    residue_by_use: Counter[int] = Counter()
    for node in scheduler.nodes:
        free_cpu = None if node.cpu_milli is None else node.cpu_milli - node.used_cpu_milli
        for gpu in node.gpus:
            share = free_share(gpu)
            if not share:
                continue
            if free_cpu is not None and free_cpu < starved_cpu:
                idle["CPU-starved node"] += share
            elif share < residue_share:
                idle["residue"] += share
                residue_by_use[100 - share] += share
            elif share == 100:
                idle["whole free GPU"] += share
            else:
                idle["other partly free GPU"] += share
    total_idle = sum(idle.values()) / 100
    print(f"\n### seed {seed}, {policy}: {total_idle:.1f} GPUs idle at {arrived / capacity:.1%} arrived")
    print(f"failed: {sum(failed.values()) / MILLI_PER_GPU:.1f} GPUs of demand")
    for name, milli in failed.most_common():
        print(f"  {name}: {milli / MILLI_PER_GPU:.1f} GPUs, first at {first[name]:.1f}% arrived")
    print(f"idle (CPU-starved: < {starved_cpu} mCPU free; residue: < {residue_share}% free):")
    for name, share in idle.most_common():
        print(f"  {name}: {share / 100:.1f} GPUs")
    top = ", ".join(f"{used}% used: {share / 100:.1f}" for used, share in residue_by_use.most_common(5))
    print(f"  residue by the GPU's used share: {top}")


def offline_reference(cluster: Cluster, pods: list[SimPod], seed: int) -> None:
    sizes = sorted((p.gpu_milli for p in pods if p.fractional), reverse=True)
    fills: list[int] = []
    room: list[tuple[int, int]] = []  # (room left, GPU) sorted: best fit is the first that takes it
    for size in sizes:
        at = bisect.bisect_left(room, (size, -1))
        if at < len(room):
            left, gpu = room.pop(at)
        else:
            fills.append(0)
            left, gpu = MILLI_PER_GPU, len(fills) - 1
        fills[gpu] += size
        if left > size:
            bisect.insort(room, (left - size, gpu))
    all_placed = waste = sum(MILLI_PER_GPU - f for f in fills)
    # Lower bound: pods over half a GPU each own one; the rest of it takes only pods that fit there.
    small = sorted(s for s in sizes if 2 * s <= MILLI_PER_GPU)
    pool, taken, unfilled = 0, 0, 0
    for rest in sorted(MILLI_PER_GPU - s for s in sizes if 2 * s > MILLI_PER_GPU):
        while taken < len(small) and small[taken] <= rest:
            pool += small[taken]
            taken += 1
        used = min(rest, pool)
        pool -= used
        unfilled += rest - used
    best, dropped = waste, 0
    for fill in sorted(fills):
        waste -= MILLI_PER_GPU - fill
        dropped += fill
        best = min(best, max(waste, dropped))
    capacity = cluster.total_gpus * MILLI_PER_GPU
    print(
        f"\n### seed {seed}, offline reference ({len(sizes)} fractional pods, "
        f"{sum(sizes) / MILLI_PER_GPU:.1f} GPUs): best-fit-decreasing waste "
        f"{all_placed / MILLI_PER_GPU:.1f} GPUs ({100 * all_placed / capacity:.2f}%), lower bound "
        f"{unfilled / MILLI_PER_GPU:.1f} ({100 * unfilled / capacity:.2f}%); "
        f"least max(waste, dropped) {best / MILLI_PER_GPU:.1f} GPUs ({100 * best / capacity:.2f}%)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", type=Path, required=True, help="folder of the trace's CSV files")
    parser.add_argument("--variant", default="default", help="pod list variant")
    parser.add_argument("--seeds", default="42", help="comma-separated seeds")
    parser.add_argument("--policies", default="fragmentation,fgd-paper,binpack")
    parser.add_argument("--load", type=float, default=100.0, help="arrived load (%%) to stop at")
    args = parser.parse_args()
    inputs = load_inputs(
        args.traces / "openb_node_list_gpu_node.csv", args.traces / f"openb_pod_list_{args.variant}.csv"
    )
    cluster, workload = inputs.cluster, inputs.workload
    for seed in (int(s) for s in args.seeds.split(",")):
        pods = arrived_pods(arrival_order(workload, cluster, seed, 1.3), cluster, args.load)
        for policy in args.policies.split(","):
            replay(cluster, workload, policy, seed, pods)
        offline_reference(cluster, pods, seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
