"""The placement core's per-node decision, ``tessera.placement.filter_node``: time per call.

The state is the extender latency benchmark's (``bench/extender_latency.py``): 1,000 nodes of 8 GPUs
(A100 / V100 / T4 by thirds, split 8), about half the GPUs partly used, and its 12 pod shapes. Each
pass calls filter_node for every shape on the first 300 nodes (3,600 calls, fits and rejections as
they come, the engine's policy and speed profiles); no cache sits in between.

    .venv/bin/python -m bench.placement_node [--passes 15]

Reported: the best pass (wall and thread CPU time, the garbage collector off during the passes), per
call, overall and per shape.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable

# bench/ itself, for the latency benchmark's state builder (which puts the repository first).
from bench import extender_latency
from tessera.contract import parse_pod_request
from tessera.placement import PodShape, filter_node, shape_of

NODES = 300


def best_per_call(run: Callable[[], None], calls: int, passes: int, clock: Callable[[], float]) -> float:
    """The fastest of ``passes`` runs, in microseconds per call."""
    best = float("inf")
    for _ in range(passes):
        start = clock()
        run()
        best = min(best, clock() - start)
    return best / calls * 1e6


def describe(shape: PodShape) -> str:
    prefs = shape.preferences
    wishes = [f"models {','.join(prefs.models)}"] if prefs.models else []
    if prefs.min_speed is not None:
        wishes.append(f"min-speed {prefs.min_speed:g}")
    if prefs.workload:
        wishes.append(f"workload {prefs.workload}")
    return " + ".join(c.describe() for c in shape.containers) + (f" [{', '.join(wishes)}]" if wishes else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", type=int, default=15, help="timed passes; the best counts (default 15)")
    args = parser.parse_args()

    extender, _ = extender_latency.build(1000, 1, keep_best=True)
    engine = extender.state.engine
    shapes = [
        shape_of(parse_pod_request(extender_latency.pod_object(i, shape)))
        for i, shape in enumerate(extender_latency.pod_shapes())
    ]
    nodes = list(engine.nodes.values())[:NODES]

    def calls_for(shape: PodShape) -> Callable[[], None]:
        policy = engine.policy_for(shape)

        def run() -> None:
            for node in nodes:
                filter_node(node, shape, engine.profiles, policy, engine.context)

        return run

    runs = [calls_for(shape) for shape in shapes]

    def every_shape() -> None:
        for run in runs:
            run()

    every_shape()  # warm-up: speed-profile memo, first-call costs
    gc.disable()
    try:
        wall = best_per_call(every_shape, len(shapes) * NODES, args.passes, time.perf_counter)
        cpu = best_per_call(every_shape, len(shapes) * NODES, args.passes, time.thread_time)
        what = f"filter_node, {len(shapes)} shapes x {NODES} nodes"
        print(f"{what}, per call: {wall:.1f} us wall, {cpu:.1f} us CPU")
        for shape, run in zip(shapes, runs, strict=True):
            print(f"  {best_per_call(run, NODES, args.passes, time.perf_counter):6.1f} us  {describe(shape)}")
    finally:
        gc.enable()
    return 0


if __name__ == "__main__":
    sys.exit(main())
