"""The packing and time experiments on small clusters whose outcomes can be worked out by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from simulator import report
from simulator.experiment import Experiment, Options, run_all, run_system
from simulator.inputs import Inputs, load_inputs
from simulator.model import Cluster, SimNode, SimPod, Workload
from simulator.packing import arrival_order
from simulator.scheduler import SimScheduler, system_named
from simulator.timeline import run_time
from tessera.placement import SpeedProfiles

PROFILES = SpeedProfiles.from_mapping({"models": {"V100": 1.0, "T4": 0.4}})


def cluster(*nodes: tuple[str, str, int, int]) -> Cluster:
    """Nodes as (name, model, GPUs, vCPU milli)."""
    memory = {"V100": 16384, "T4": 15360, "V100M32": 32768}
    return Cluster(tuple(SimNode(n, m, g, memory[m], cpu, 1 << 20) for n, m, g, cpu in nodes))


def gpu_pod(name: str, milli: int, arrival: float = 0.0, duration: float = 100.0, gpus: int = 1) -> SimPod:
    return SimPod(name, 1000, 1024, gpus, milli, arrival=arrival, duration=duration)


def test_arrival_order_is_seeded_and_inflated_to_the_target() -> None:
    nodes = cluster(("a", "V100", 4, 64000))
    pods = Workload(tuple(gpu_pod(f"p{i}", 300) for i in range(5)))
    order = arrival_order(pods, nodes, seed=7, inflation=1.3)
    assert order == arrival_order(pods, nodes, seed=7, inflation=1.3)
    assert order != arrival_order(pods, nodes, seed=8, inflation=1.3)
    assert sorted(p.name for p in order[:5]) == [f"p{i}" for i in range(5)]  # every pod once, then samples
    assert sum(p.total_gpu_milli for p in order) == 5100  # 17 pods of 300 <= 5,200 < 18 pods
    assert len(arrival_order(pods, nodes, seed=7, inflation=0.5)) == 6


def packing(nodes: Cluster, pods: Workload, name: str, inflation: float = 1.0) -> Any:
    options = Options((name,), (Experiment.PACKING,), seed=1, inflation=inflation)
    return run_system(Inputs(nodes, pods, "test"), system_named(name), options, PROFILES).packing


def test_sharing_packs_what_whole_gpus_cannot() -> None:
    nodes = cluster(("a", "V100", 2, 64000), ("b", "V100", 2, 64000))
    halves = Workload(tuple(gpu_pod(f"p{i}", 500) for i in range(8)))
    exclusive = packing(nodes, halves, "exclusive")
    binpack = packing(nodes, halves, "binpack")
    assert (exclusive.placed, binpack.placed) == (4, 8)
    assert exclusive.allocation_at(100) == 50.0 and binpack.allocation_at(100) == 100.0
    assert exclusive.unallocated_at(100) == (50.0, 2.0)
    assert binpack.unallocated_at(100) == (0.0, 0.0)


def test_host_cpu_limits_placement() -> None:
    nodes = cluster(("a", "V100", 4, 2500))
    pods = Workload(tuple(gpu_pod(f"p{i}", 1000) for i in range(4)))
    assert packing(nodes, pods, "binpack").placed == 2  # 1 vCPU each, 2.5 on the node


def test_fragmentation_keeps_room_for_whole_gpu_pods() -> None:
    # Quarter pods then whole-GPU pods: spread breaks every GPU, FGD fills one GPU at a time.
    nodes = cluster(("a", "V100", 2, 64000), ("b", "V100", 2, 64000))
    pods = [gpu_pod(f"q{i}", 250) for i in range(4)] + [gpu_pod(f"w{i}", 1000) for i in range(3)]
    workload = Workload(tuple(pods))
    inputs = Inputs(nodes, workload, "test")
    results = {}
    for name in ("spread", "fragmentation"):
        scheduler = SimScheduler(nodes, system_named(name), PROFILES, workload.pods, seed=1)
        results[name] = [scheduler.place(p) is not None for p in pods]
    assert results["fragmentation"] == [True] * 7
    assert results["spread"].count(False) == 3
    assert inputs.cluster.total_gpus == 4


def timed(nodes: Cluster, pods: list[SimPod], name: str, colocation: float = 0.68) -> Any:
    workload = Workload(tuple(pods))
    scheduler = SimScheduler(nodes, system_named(name), PROFILES, workload.pods, seed=1)
    return run_time(nodes, workload=workload, scheduler=scheduler, profiles=PROFILES, colocation=colocation)


def test_colocated_pods_slow_down_and_exclusive_ones_queue() -> None:
    one_gpu = cluster(("a", "V100", 1, 64000))
    pods = [gpu_pod("a", 500), gpu_pod("b", 500)]
    shared = timed(one_gpu, pods, "binpack")
    assert shared.jct == pytest.approx([100 / 0.68, 100 / 0.68])
    assert shared.queueing == [0.0, 0.0]
    whole = timed(one_gpu, pods, "exclusive")
    assert whole.jct == pytest.approx([100, 200])
    assert whole.queueing == pytest.approx([0, 100])
    assert whole.makespan == pytest.approx(200)
    assert whole.mean_utilization == pytest.approx(50)  # one half-GPU pod at a time


def test_rates_change_as_neighbours_come_and_go() -> None:
    one_gpu = cluster(("a", "V100", 1, 64000))
    # a runs alone for 50 s (50 left), shares while b's 34 s of work take 50 s, then ends alone:
    # by 100 s a has done 50 + 34 = 84, the last 16 s alone end it at 116 s.
    result = timed(one_gpu, [gpu_pod("a", 500), gpu_pod("b", 500, arrival=50, duration=34)], "binpack")
    assert sorted(result.jct) == pytest.approx([50, 116])


def test_duration_scales_with_the_gpu_speed() -> None:
    result = timed(cluster(("t4", "T4", 1, 64000)), [gpu_pod("a", 1000)], "binpack")
    assert result.jct == pytest.approx([250])


def test_memory_only_sharing_oversubscribes_compute() -> None:
    # The T4 node has no CPU to spare, so both pods land on the 32 GiB V100. Their memory (80% of the
    # smallest model's 15 GiB each) fits together; memory-only sharing reserves no compute, so they
    # ask 160% of it and run at 0.68 x 100/160. Compute shares keep the second waiting instead.
    nodes = cluster(("t4", "T4", 1, 500), ("v", "V100M32", 1, 64000))
    pods = [gpu_pod("a", 800), gpu_pod("b", 800)]
    gpushare = timed(nodes, pods, "gpushare")
    assert gpushare.jct == pytest.approx([100 / (0.68 * 100 / 160)] * 2)
    binpack = timed(nodes, pods, "binpack")
    assert binpack.jct == pytest.approx([100, 200])


def test_speed_aware_puts_training_on_fast_gpus_and_inference_on_slow_ones() -> None:
    nodes = cluster(("t4", "T4", 1, 64000), ("v100", "V100", 1, 64000))
    profiles = SpeedProfiles.from_mapping(
        {"models": {"V100": 1.0, "T4": 0.4}, "workloads": {"inference": {"T4": 0.8}, "training": {"T4": 0.2}}}
    )
    pods = [
        SimPod("infer", 1000, 1024, 1, 1000, workload="inference", arrival=0, duration=100),
        SimPod("train", 1000, 1024, 1, 1000, workload="training", arrival=1, duration=100),
    ]
    results = {}
    for name in ("binpack", "speed-aware"):
        workload = Workload(tuple(pods))
        scheduler = SimScheduler(nodes, system_named(name), profiles, workload.pods, seed=3)
        results[name] = run_time(nodes, workload=workload, scheduler=scheduler, profiles=profiles)
    assert sorted(results["speed-aware"].jct) == pytest.approx([100, 125])  # inference on T4 at 0.8
    assert results["speed-aware"].mean_jct <= results["binpack"].mean_jct


SMALL_YAML = """nodes:
  - {name: v100, count: 3, model: V100, gpus: 4, cpu_milli: 48000, memory_mib: 262144}
  - {name: t4, count: 3, model: T4, gpus: 2, cpu_milli: 32000, memory_mib: 131072}
pods:
"""


def small_inputs(tmp_path: Path) -> Inputs:
    lines = [SMALL_YAML]
    for i in range(60):
        milli = (250, 500, 1000, 750)[i % 4]
        workload = "inference" if milli < 1000 else "llm-training"
        lines.append(
            f"  - {{name: p{i}, cpu_milli: {2000 + 500 * (i % 3)}, memory_mib: 4096, gpus: 1, gpu_milli: {milli},"
            f" workload: {workload}, arrival: {i * 7}, duration: {100 + 37 * (i % 5)}}}\n"
        )
    path = tmp_path / "small.yaml"
    path.write_text("".join(lines))
    return load_inputs(path, None)


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: without_timings(v)
            for k, v in value.items()
            if k not in ("seconds", "cpu_seconds", "mean_decision_ms")
        }
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def test_deterministic_for_a_seed_and_the_same_in_worker_processes(tmp_path: Path) -> None:
    inputs = small_inputs(tmp_path)
    names = ("exclusive", "gpushare", "hami", "binpack", "spread", "fragmentation", "speed-aware", "dra")
    options = Options(names, seed=5)
    serial = report.to_json(inputs, options, run_all(inputs, options, PROFILES, jobs=1))
    again = report.to_json(inputs, options, run_all(inputs, options, PROFILES, jobs=1))
    parallel = report.to_json(inputs, options, run_all(inputs, options, PROFILES, jobs=2))
    assert without_timings(serial) == without_timings(again) == without_timings(parallel)
    other_seed = Options(names, seed=6)
    assert without_timings(
        report.to_json(inputs, other_seed, run_all(inputs, other_seed, PROFILES, jobs=1))
    ) != (without_timings(serial))
    assert [p["policy"] for p in serial["policies"]] == list(names)
    for entry in serial["policies"]:
        assert entry["time"]["finished"] == 60
        assert 0 < entry["packing"]["allocation_at_100"] <= 100
