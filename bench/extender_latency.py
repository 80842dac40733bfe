"""The extender's latency per pod, node-names mode, at 100 / 1,000 / 5,000 nodes: filter (the
shipped setup, ``--filter-keeps best``) and filter + prioritize (``--filter-keeps all``).

Each node has 8 GPUs (A100 / V100 / T4, by thirds); about half the GPUs start partly used. Pods come
from a mix of 12 shapes (1-2 GPUs, memory, compute, some with model or speed constraints). For each
pod the benchmark times exactly what the HTTP handlers do (parse the request body, decide, write
the answer): /filter with every node's name, and in the second setup /prioritize with the
survivors. Then it binds the pod on the node kube-scheduler would pick (the first answered, or the
best scored) with /bind's in-memory half (``Extender.decide``: the allocation is assumed at once, so
the next pod sees that node changed), and the device plugin serves it (phase allocated). The HTTP
transport itself is timed separately over loopback with uvicorn (``--http``).

    .venv/bin/python -m bench.extender_latency [--nodes 100 1000 5000] [--pods 2000] [--http]

Reported: p50 / p99 / max wall time in ms over the pods after one warm-up pass per shape, the same
as CPU time of the thread (what the work costs when the machine is not shared), and the first
request of a shape not seen before (no cached per-node outcomes).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

from bench.fleet import GPUS_PER_NODE, node_inventory
from extender import wire
from extender.deciding import Refusal
from extender.metrics import Metrics
from extender.podrecords import PodAllocation
from extender.service import Extender
from extender.state import ClusterState
from extender.watch import settle_heap
from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    Phase,
    dump_allocation,
    dump_inventory,
    format_time,
    parse_pod_request,
)
from tessera.placement import PlacementEngine, SpeedProfiles

REPO = Path(__file__).resolve().parents[1]

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def node_object(i: int) -> dict[str, Any]:
    name = f"node-{i:05d}"
    gpus = node_inventory(name, i)
    annotations = {KEYS.node_gpus: dump_inventory(gpus), KEYS.node_heartbeat: format_time(NOW)}
    return {"metadata": {"name": name, "annotations": annotations}}


def existing_pod(i: int, node: str, gpu: int, memory: int, cores: int) -> dict[str, Any]:
    allocation = Allocation(
        node=node,
        containers=(
            ContainerAllocation(
                name="main", gpus=(GpuGrant(uuid=f"GPU-{node}-{gpu}", memory_quota_mib=memory, cores=cores),)
            ),
        ),
    )
    return {
        "metadata": {
            "name": f"existing-{i}",
            "namespace": "bench",
            "uid": f"existing-{i}",
            "annotations": {
                KEYS.allocation: dump_allocation(allocation),
                KEYS.allocation_phase: "allocated",
            },
        },
        "spec": {"nodeName": node},
        "status": {"phase": "Running"},
    }


def pod_shapes() -> list[dict[str, Any]]:
    """Container limits and annotations of the benchmark's 12 pod shapes."""
    shapes = []
    for vgpu, memory, cores in [
        (1, 2048, 10),
        (1, 4096, 25),
        (1, 8192, 50),
        (1, 12288, None),
        (1, None, None),
        (2, 8192, 50),
        (1, 1024, 5),
        (2, 4096, None),
    ]:
        shapes.append({"limits": (vgpu, memory, cores), "annotations": {}})
    shapes.append({"limits": (1, 4096, 20), "annotations": {KEYS.gpu_models: "A100"}})
    shapes.append({"limits": (1, 4096, 20), "annotations": {KEYS.min_speed: "1.0"}})
    shapes.append({"limits": (1, 4096, 20), "annotations": {KEYS.workload: "llm-training"}})
    shapes.append({"limits": (1, 2048, 10), "annotations": {KEYS.workload: "inference"}})
    return shapes


def pod_object(i: int, shape: dict[str, Any]) -> dict[str, Any]:
    vgpu, memory, cores = shape["limits"]
    limits = {KEYS.vgpu: str(vgpu)}
    if memory is not None:
        limits[KEYS.vgpu_memory] = str(memory)
    if cores is not None:
        limits[KEYS.vgpu_cores] = str(cores)
    return {
        "metadata": {
            "name": f"pod-{i}",
            "namespace": "bench",
            "uid": f"uid-{i}",
            "annotations": shape["annotations"],
        },
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


def build(nodes: int, seed: int, *, keep_best: bool) -> tuple[Extender, list[str]]:
    rng = random.Random(seed)
    profiles = SpeedProfiles.from_yaml((REPO / "deploy" / "speed-profiles.yaml").read_text())
    state = ClusterState(PlacementEngine(profiles), KEYS, heartbeat_timeout=timedelta(hours=1))
    node_objects = [node_object(i) for i in range(nodes)]
    state.replace_nodes(node_objects, NOW)
    pods = []
    for i in range(nodes * GPUS_PER_NODE // 2):
        n = rng.randrange(nodes)
        pods.append(
            existing_pod(i, f"node-{n:05d}", rng.randrange(GPUS_PER_NODE), rng.choice([1024, 4096]), 10)
        )
    state.replace_pods(pods)
    settle_heap()  # as the extender does once both caches are listed
    extender = Extender(
        state,
        None,
        KEYS,
        Metrics(),
        inflight_timeout=timedelta(minutes=5),
        clock=lambda: NOW,
        filter_keeps_best=keep_best,
    )
    return extender, [n["metadata"]["name"] for n in node_objects]


PRIORITIES = wire.HostPriorityWriter()


def handle_filter(extender: Extender, body: bytes) -> bytes:
    """What the /filter handler does."""
    pod, names, nodes = wire.parse_extender_args(body)
    answer = extender.filter(pod, names)
    return wire.filter_result(answer.passed, answer.failed, answer.unresolvable, nodes)


def handle_prioritize(extender: Extender, body: bytes) -> bytes:
    """What the /prioritize handler does."""
    pod, names, _ = wire.parse_extender_args(body)
    return PRIORITIES.write(names, extender.prioritize(pod, names))


class Timed(NamedTuple):
    node: str | None  # where kube-scheduler binds the pod
    wall: float
    cpu: float


def schedule(extender: Extender, pod: dict[str, Any], names: list[str]) -> Timed:
    """The handlers kube-scheduler calls for one pod, each timed (wall, thread CPU) from its request
    body to its answer. The bodies are made untimed, as kube-scheduler makes them: /prioritize (when
    configured) gets filter's survivors."""
    body = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}).encode()
    started, started_cpu = time.perf_counter(), time.thread_time()
    filtered = handle_filter(extender, body)
    wall, cpu = time.perf_counter() - started, time.thread_time() - started_cpu
    passed = json.loads(filtered)["NodeNames"]
    if extender.filtering.keeps_best or not passed:
        return Timed(passed[0] if passed else None, wall, cpu)
    body = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": passed}).encode()
    started, started_cpu = time.perf_counter(), time.thread_time()
    prioritized = handle_prioritize(extender, body)
    wall += time.perf_counter() - started
    cpu += time.thread_time() - started_cpu
    return Timed(max(json.loads(prioritized), key=lambda s: s["Score"])["Host"], wall, cpu)


def bind_in_memory(extender: Extender, pod: dict[str, Any], node: str | None) -> None:
    """/bind's in-memory half on ``node``, then the device plugin serving the pod at once."""
    if node is None:
        return
    decided = extender.decide(pod, parse_pod_request(pod), node, NOW)
    if isinstance(decided, Refusal):
        return
    extender.state.assume(
        PodAllocation(
            uid=pod["metadata"]["uid"],
            namespace="bench",
            name=pod["metadata"]["name"],
            allocation=decided,
            phase=Phase.ALLOCATED.value,
            bind_time=NOW,
        )
    )


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def run(nodes: int, pods: int, seed: int, *, keep_best: bool) -> dict[str, float]:
    gc.collect()  # the previous size's extender, so that each size starts as a fresh process would
    extender, names = build(nodes, seed, keep_best=keep_best)
    shapes = pod_shapes()
    rng = random.Random(seed + 1)
    cold: list[float] = []
    for i, shape in enumerate(shapes):  # one warm-up pod per shape: its first request is "cold"
        pod = pod_object(-1 - i, shape)
        timed = schedule(extender, pod, names)
        cold.append(timed.wall)
        bind_in_memory(extender, pod, timed.node)
    warm: list[float] = []
    cpu: list[float] = []
    for i in range(pods):
        pod = pod_object(i, rng.choice(shapes))
        timed = schedule(extender, pod, names)
        warm.append(timed.wall)
        cpu.append(timed.cpu)
        bind_in_memory(extender, pod, timed.node)
    ms = 1000.0
    return {
        "p50": statistics.median(warm) * ms,
        "p99": percentile(warm, 99) * ms,
        "max": max(warm) * ms,
        "cpu_p50": statistics.median(cpu) * ms,
        "cpu_p99": percentile(cpu, 99) * ms,
        "cold_median": statistics.median(cold) * ms,
    }


def http_round_trip(nodes: int, requests: int, seed: int, *, keep_best: bool) -> dict[str, float]:
    """The same requests over loopback HTTP to the FastAPI app under uvicorn."""
    import httpx  # noqa: PLC0415
    import uvicorn  # noqa: PLC0415

    from extender.app import create_app  # noqa: PLC0415
    from sandbox.controlplane import free_port  # noqa: PLC0415

    extender, names = build(nodes, seed, keep_best=keep_best)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(extender), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    shapes = pod_shapes()
    rng = random.Random(seed + 1)
    times = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
            for i in range(len(shapes) + requests):
                pod = pod_object(i, shapes[i] if i < len(shapes) else rng.choice(shapes))
                started = time.perf_counter()
                passed = http.post("/filter", json={"Pod": pod, "Nodes": None, "NodeNames": names}).json()
                if not keep_best:
                    survivors = passed["NodeNames"]
                    http.post("/prioritize", json={"Pod": pod, "Nodes": None, "NodeNames": survivors})
                if i >= len(shapes):
                    times.append(time.perf_counter() - started)
    finally:
        server.should_exit = True
        thread.join(10)
    return {"p50": statistics.median(times) * 1000, "p99": percentile(times, 99) * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--http", action="store_true", help="also time the round trip over loopback HTTP")
    args = parser.parse_args()
    setups = (
        ("filter (--filter-keeps best, shipped)", True),
        ("filter + prioritize (--filter-keeps all)", False),
    )
    for title, keep_best in setups:
        print(f"\n{title}: per pod, node-names mode, {GPUS_PER_NODE} GPUs per node, {args.pods} pods")
        print(
            "| nodes | p50 ms | p99 ms | max ms | CPU p50 ms | CPU p99 ms "
            "| first pod of a new shape, median ms |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for nodes in args.nodes:
            r = run(nodes, args.pods, args.seed, keep_best=keep_best)
            print(
                f"| {nodes:,} | {r['p50']:.2f} | {r['p99']:.2f} | {r['max']:.2f} | {r['cpu_p50']:.2f} "
                f"| {r['cpu_p99']:.2f} | {r['cold_median']:.1f} |",
                flush=True,
            )
        if args.http:
            print(f"\n{title} over loopback HTTP (uvicorn + httpx, keep-alive), 500 pods")
            print("| nodes | p50 ms | p99 ms |")
            print("|---:|---:|---:|")
            for nodes in args.nodes:
                r = http_round_trip(nodes, 500, args.seed, keep_best=keep_best)
                print(f"| {nodes:,} | {r['p50']:.2f} | {r['p99']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
