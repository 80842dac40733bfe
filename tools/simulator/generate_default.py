"""Generate the embedded default cluster and workload (``tools/simulator/data/default.yaml``).

The default is synthetic: it is drawn, with a fixed seed, from summary statistics of the Alibaba GPU
trace (cluster-trace-gpu-v2023, the FGD paper's "openb" cluster), never from its rows. The
statistics below are the published cluster composition and aggregate histograms of the pod list:

* node types: the trace's GPU node list has 1,213 nodes of 15 types (model, GPUs, vCPU, memory);
  the default keeps one node in ten of each type (types that round to nothing are kept once if
  their model would vanish otherwise);
* pods: 13.3% ask no GPU; of GPU pods 43.6% ask a fraction of one GPU (median 0.47 GPU, the
  fraction histogram below) and 1.1% ask 2, 4 or 8 whole GPUs;
* vCPU per pod and memory per vCPU follow the per-class histograms below;
* durations: log-normal with the trace's median (540 s) and 90th percentile (6,574 s), capped at
  one day so that a minute-long run replays the whole workload;
* arrivals: a Poisson process whose rate makes the offered GPU load ``LOAD`` times the cluster's
  GPUs (a busy cluster, so policies differ in queueing);
* workload classes (the trace has none; an assumption): multi-GPU pods and half of whole-GPU pods
  are ``llm-training``, fractional pods ``inference``, the rest have no class; the speed profiles
  (deploy/speed-profiles.yaml) give each class its own speed per GPU model.

Run ``python -m simulator.generate_default`` to rewrite the file; a test checks that the
shipped file is what this script produces.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import yaml

from simulator.model import MILLI_PER_GPU, SimPod

SEED = 2023
PODS = 2000
LOAD = 1.6
DURATION_MEDIAN_S = 540.0
DURATION_P90_S = 6574.0
DURATION_CAP_S = 7200.0
NODE_SCALE = 0.1

# (model, GPUs, vCPU milli, memory MiB, nodes in the trace)
TRACE_NODE_TYPES: tuple[tuple[str, int, int, int, int], ...] = (
    ("A10", 1, 128000, 1048576, 2),
    ("G2", 8, 96000, 393216, 549),
    ("G3", 8, 128000, 786432, 39),
    ("P100", 1, 8000, 61440, 3),
    ("P100", 2, 16000, 122880, 107),
    ("P100", 2, 64000, 262144, 22),
    ("P100", 2, 8000, 61440, 2),
    ("T4", 2, 104000, 524288, 387),
    ("T4", 4, 96000, 393216, 17),
    ("V100M16", 1, 8000, 32768, 19),
    ("V100M16", 4, 32000, 131072, 28),
    ("V100M16", 8, 64000, 262144, 7),
    ("V100M16", 8, 82000, 344064, 1),
    ("V100M32", 4, 48000, 376832, 9),
    ("V100M32", 8, 96000, 786432, 21),
)

CPU_ONLY_SHARE = 0.133
FRACTIONAL_SHARE_OF_GPU_PODS = 0.436
# Of GPU pods: (GPUs, share) for multi-GPU pods.
MULTI_GPU_SHARES: tuple[tuple[int, float], ...] = ((2, 0.0023), (4, 0.0021), (8, 0.0062))
# Fractional pods: (thousandths of a GPU, count in the trace's histogram).
FRACTION_HISTOGRAM: tuple[tuple[int, int], ...] = (
    (50, 7), (110, 24), (160, 74), (220, 62), (230, 140), (320, 328), (370, 47), (460, 128),
    (470, 750), (480, 19), (550, 72), (590, 75), (650, 253), (810, 1078),
)  # fmt: skip
# vCPU milli per pod class: (value, weight), the deciles of each class in the trace.
CPU_HISTOGRAM: dict[str, tuple[tuple[int, int], ...]] = {
    "cpu": ((8000, 2), (12500, 4), (32000, 4)),
    "fractional": ((3152, 4), (4000, 2), (8000, 2), (11908, 2)),
    "whole": ((3152, 1), (9810, 1), (11400, 4), (12000, 2), (16000, 2)),
    "multi": ((8000, 1), (16200, 3), (32200, 3), (64200, 2), (88000, 1)),
}
MEMORY_MIB_PER_VCPU = 4096
TRAINING_SHARE_OF_WHOLE_GPU_PODS = 0.5


def _pick(rng: random.Random, weighted: tuple[tuple[int, int], ...]) -> int:
    values = [v for v, _ in weighted]
    weights = [w for _, w in weighted]
    return rng.choices(values, weights)[0]


NodeType = tuple[str, int, int, int, int]


def _node_types() -> list[NodeType]:
    """Each trace node type with its scaled count; a model that would vanish keeps one node."""
    kept: list[NodeType] = []
    for model, gpus, cpu, memory, count in TRACE_NODE_TYPES:
        if round(count * NODE_SCALE):
            kept.append((model, gpus, cpu, memory, round(count * NODE_SCALE)))
    for model, gpus, cpu, memory, _ in TRACE_NODE_TYPES:
        if model not in {k[0] for k in kept}:
            kept.append((model, gpus, cpu, memory, 1))
    return kept


def _duration(rng: random.Random) -> float:
    sigma = math.log(DURATION_P90_S / DURATION_MEDIAN_S) / 1.2815515655446004  # z of the 90th pct
    return min(DURATION_CAP_S, round(rng.lognormvariate(math.log(DURATION_MEDIAN_S), sigma), 1))


def _pod(rng: random.Random, n: int) -> SimPod:
    if rng.random() < CPU_ONLY_SHARE:
        cls, gpus, milli = "cpu", 0, 0
    elif rng.random() < FRACTIONAL_SHARE_OF_GPU_PODS:
        cls, gpus, milli = "fractional", 1, _pick(rng, FRACTION_HISTOGRAM)
    else:
        draw, gpus = rng.random(), 1
        for count, share in MULTI_GPU_SHARES:
            draw -= share / (1 - FRACTIONAL_SHARE_OF_GPU_PODS)
            if draw < 0:
                gpus = count
                break
        cls, milli = ("multi" if gpus > 1 else "whole"), MILLI_PER_GPU
    cpu = _pick(rng, CPU_HISTOGRAM[cls])
    return SimPod(
        name=f"pod-{n:04d}",
        cpu_milli=cpu,
        host_memory_mib=cpu * MEMORY_MIB_PER_VCPU // 1000,
        num_gpu=gpus,
        gpu_milli=milli,
        workload=_workload(rng, gpus, milli),
        duration=_duration(rng),
    )


def _workload(rng: random.Random, gpus: int, milli: int) -> str | None:
    if not gpus:
        return None
    if milli < MILLI_PER_GPU:
        return "inference"
    return "llm-training" if gpus > 1 or rng.random() < TRAINING_SHARE_OF_WHOLE_GPU_PODS else None


def generate() -> dict[str, object]:
    rng = random.Random(SEED)
    types = _node_types()
    total_gpus = sum(gpus * count for _, gpus, _, _, count in types)
    pods = [_pod(rng, n) for n in range(PODS)]
    gpu_seconds = sum(p.total_gpu_milli / MILLI_PER_GPU * (p.duration or 0.0) for p in pods)
    # Poisson arrivals at the rate that offers LOAD x the cluster's GPUs over the arrival span.
    rate = LOAD * total_gpus * len(pods) / gpu_seconds
    clock, arrivals = 0.0, []
    for _ in pods:
        arrivals.append(round(clock, 1))
        clock += rng.expovariate(rate)
    nodes = [
        {"name": f"{model.lower()}-{gpus}g-{cpu // 1000}c", "count": count, "model": model, "gpus": gpus,
         "cpu_milli": cpu, "memory_mib": memory}
        for model, gpus, cpu, memory, count in types
    ]  # fmt: skip
    return {"nodes": nodes, "pods": [_pod_entry(p, a) for p, a in zip(pods, arrivals, strict=True)]}


def _pod_entry(pod: SimPod, arrival: float) -> dict[str, object]:
    entry: dict[str, object] = {
        "name": pod.name,
        "cpu_milli": pod.cpu_milli,
        "memory_mib": pod.host_memory_mib,
    }
    if pod.num_gpu:
        entry.update(gpus=pod.num_gpu, gpu_milli=pod.gpu_milli)
    if pod.workload:
        entry["workload"] = pod.workload
    entry.update(arrival=arrival, duration=pod.duration)
    return entry


HEADER = (
    "# Generated by `python -m simulator.generate_default` from summary statistics of the\n"
    "# Alibaba GPU trace (see that module's docstring). Do not edit by hand.\n"
)


def render() -> str:
    body = yaml.safe_dump(generate(), sort_keys=False, default_flow_style=None, width=120)
    return HEADER + body


DEFAULT_PATH = Path(__file__).parent / "data" / "default.yaml"


def main() -> int:
    DEFAULT_PATH.parent.mkdir(exist_ok=True)
    DEFAULT_PATH.write_text(render(), encoding="utf-8")
    sys.stdout.write(f"wrote {DEFAULT_PATH}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
