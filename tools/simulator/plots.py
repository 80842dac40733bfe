"""PNG plots of a run (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from simulator.experiment import SystemResult


def plot_packing(results: Sequence[SystemResult], path: Path) -> None:
    """GPU allocation rate against arrived load, one line per policy, with the ideal."""
    figure, axis = plt.subplots(figsize=(8, 5))
    highest = 100
    for r in results:
        if r.packing is None:
            continue
        loads = sorted(r.packing.allocation)
        highest = max(highest, loads[-1])
        axis.plot(loads, [r.packing.allocation[x] for x in loads], label=r.system.name, linewidth=1.5)
    axis.plot([0, 100, highest], [0, 100, 100], color="grey", linestyle=":", label="ideal")
    axis.set_xlabel("arrived GPU load (% of capacity)")
    axis.set_ylabel("GPU allocation rate (% of capacity)")
    axis.set_title("Packing: allocation rate as pods arrive")
    axis.set_xlim(50, highest)
    axis.set_ylim(50, 101)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_time(results: Sequence[SystemResult], path: Path) -> None:
    """Job completion time distribution (CDF, log scale) and GPU utilization over time."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for r in results:
        if r.time is None or not r.time.jct:
            continue
        ordered = sorted(r.time.jct)
        n = len(ordered)
        left.plot(ordered, [(i + 1) / n for i in range(n)], label=r.system.name, linewidth=1.2)
        hours = [t / 3600 for t, _ in r.time.utilization]
        right.step(
            hours, [u for _, u in r.time.utilization], where="post", label=r.system.name, linewidth=1.0
        )
    left.set_xscale("log")
    left.set_xlabel("job completion time (s, log scale)")
    left.set_ylabel("fraction of jobs")
    left.set_title("Job completion time (CDF)")
    left.grid(alpha=0.3)
    left.legend(loc="lower right", fontsize="small")
    right.set_xlabel("time since the first arrival (h)")
    right.set_ylabel("GPU capacity in use (%)")
    right.set_title("GPU utilization over time")
    right.set_ylim(0, 101)
    right.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
