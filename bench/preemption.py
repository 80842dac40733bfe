"""The extender's preempt verb: time of one call over 100 candidate nodes, and of one node's decision.

kube-scheduler asks about up to 100 candidate nodes per preempt call (its minCandidateNodesAbsolute)
and gives the call its extender httpTimeout (5 s in deploy/scheduler-config.yaml). The state: 100
nodes of 8 A100 (40 GiB) GPUs, every slice in use by low-priority pods of 4, 8 or 10 GiB (random,
seeded), half of them covered by a PodDisruptionBudget allowing one disruption; the pod asks 30 GiB
on one GPU at a higher priority, so that every node needs two to four victims. Each call goes
through ``Extender.preempt`` (the state's pods as the watch would have them, budgets from a stand-in
for the one list the call makes).

    .venv/bin/python -m bench.preemption [--split 4] [--passes 5]

Reported: per call (100 nodes) the best pass, wall time; per node the median and the slowest.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta

from extender.budgets import parse_budgets
from extender.metrics import Metrics
from extender.preempting import PREEMPT_SETS
from extender.service import Extender
from extender.state import ClusterState
from extender.wire import Victims
from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    GpuInfo,
    JsonObject,
    Phase,
    dump_allocation,
    dump_inventory,
    format_time,
    parse_pod_request,
)
from tessera.placement import PlacementEngine, SpeedProfiles, shape_of

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
NODES = 100
GPUS = 8
MEMORY = 40960


class Budgets:
    """The one list a preempt call makes: two PodDisruptionBudgets allowing one disruption each."""

    async def list(self, path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
        return [
            {
                "metadata": {"name": f"b{i}", "namespace": "default"},
                "spec": {"selector": {"matchLabels": {"budget": str(i)}}},
                "status": {"disruptionsAllowed": 1},
            }
            for i in range(2)
        ], "1"


def pod(
    name: str, memory: int, priority: int, node: str | None = None, gpu: int = 0, **labels: str
) -> JsonObject:
    limits = {KEYS.vgpu: "1", KEYS.vgpu_memory: str(memory)}
    body: JsonObject = {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"uid-{name}",
            "labels": labels,
            "annotations": {},
        },
        "spec": {
            "schedulerName": "tessera-scheduler",
            "priority": priority,
            "containers": [{"name": "main", "resources": {"limits": limits}}],
        },
    }
    if node is not None:
        allocation = Allocation(
            node=node,
            containers=(
                ContainerAllocation(
                    name="main", gpus=(GpuGrant(uuid=f"GPU-{node}-{gpu}", memory_quota_mib=memory, cores=0),)
                ),
            ),
        )
        body["metadata"]["annotations"] = {
            KEYS.allocation: dump_allocation(allocation),
            KEYS.allocation_phase: Phase.ALLOCATED.value,
            KEYS.bind_time: format_time(NOW - timedelta(hours=1)),
        }
        body["spec"]["nodeName"] = node
    return body


def build(split: int, seed: int) -> tuple[Extender, dict[str, Victims]]:
    rng = random.Random(seed)
    state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5))
    nodes, pods, proposed = [], [], {}
    for n in range(NODES):
        name = f"node-{n:03d}"
        inventory = [
            GpuInfo(uuid=f"GPU-{name}-{g}", index=g, model="NVIDIA A100-SXM4-40GB", total_memory_mib=MEMORY,
                    sm_count=108, compute_capability="8.0", split=split)
            for g in range(GPUS)
        ]  # fmt: skip
        annotations = {KEYS.node_gpus: dump_inventory(inventory), KEYS.node_heartbeat: format_time(NOW)}
        nodes.append({"metadata": {"name": name, "annotations": annotations}, "status": {}})
        for g in range(GPUS):
            left = MEMORY
            for k in range(split):
                memory = min(rng.choice([4096, 8192, 10240]), left - (split - k - 1) * 1024)
                left -= memory
                labels = {"budget": str(rng.randrange(2))} if rng.random() < 0.5 else {}
                pods.append(pod(f"{name}-{g}-{k}", memory, rng.choice([0, 10, 100]), name, g, **labels))
        proposed[name] = Victims((f"uid-{name}-{rng.randrange(GPUS)}-0",), 0)
    state.replace_nodes(nodes, NOW)
    state.replace_pods(pods)
    extender = Extender(
        state,
        Budgets(),
        KEYS,
        Metrics(),
        inflight_timeout=timedelta(minutes=5),
        clock=lambda: NOW,  # type: ignore[arg-type]
    )
    return extender, proposed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", type=int, default=4, help="slices per GPU: pods per GPU (default 4)")
    parser.add_argument("--passes", type=int, default=5, help="timed calls; the best counts (default 5)")
    args = parser.parse_args()
    extender, proposed = build(args.split, seed=1)
    urgent = pod("urgent", 30720, 1000)
    shape = shape_of(parse_pod_request(urgent))
    items, _ = asyncio.run(Budgets().list(""))
    budgets = parse_budgets(items)
    gc.collect()
    gc.disable()
    calls = []
    for _ in range(args.passes):
        start = time.perf_counter()
        answer = asyncio.run(extender.preempt(urgent, proposed))
        calls.append(time.perf_counter() - start)
    per_node = []
    for name in proposed:
        start = time.perf_counter()
        extender.state.choose_victims(name, shape, 1000, budgets, PREEMPT_SETS // NODES)
        per_node.append(time.perf_counter() - start)
    gc.enable()
    victims = [len(v.uids) for v in answer.values()]
    print(
        f"split {args.split}: {len(proposed)} nodes, {len(answer)} answered, victims per node "
        f"{min(victims)}-{max(victims)} (mean {statistics.mean(victims):.1f})"
    )
    print(f"one call: best {min(calls) * 1e3:.1f} ms, slowest {max(calls) * 1e3:.1f} ms")
    print(
        f"one node: median {statistics.median(per_node) * 1e3:.2f} ms, slowest {max(per_node) * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
