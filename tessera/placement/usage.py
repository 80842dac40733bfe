"""Usage-aware placement of best-effort pods: what a GPU's measured use leaves for them.

The rule (docs/placement.md, "Usage-aware placement of best-effort pods"):

* Every pod is placed by requests first. A *best-effort* pod that fits nowhere on a node by requests
  may be placed there against the GPUs' measured use instead: on a GPU with a free slice when

      measured use + safety margin + every grant placed since the measurement + the pod's request
      <= the GPU's memory

  where the measured use is the node agent's ``memory_used_mib`` (annotation ``<domain>/gpu-usage``),
  the margin is the larger of ``margin_mib`` and ``margin_percent`` of the GPU's memory, and a grant
  placed since the measurement (its pod in flight, or bound at or after the measurement's time) is
  counted at its full request: it has not started using yet. Such grants are *oversubscribed*; a pod's
  grants are all oversubscribed or none is.
* A measurement that holds as of nothing within ``max_age`` (or is missing, unreadable, or without
  the GPU) allows nothing against use on that node (that GPU). When it holds is the adapter's: the
  extender takes the newer of its time and the node agent's heartbeat (the agent republishes a
  changed use with every heartbeat).
* Oversubscribed grants count for nothing when any pod is placed by requests (memory or compute): a
  guaranteed pod is promised exactly what it would be without them. They take a slice (the device
  plugin's virtual devices are real). Their cores are the container's cap on its share of the GPU's
  time; they reserve none: a best-effort container yields to the others (docs/hook.md).
* The node agent and the hook keep the promise: an oversubscribed container's memory quota is at most
  what the others leave free at any moment, and best-effort pods are evicted before a guaranteed
  allocation can fail.

This module holds the margin, the staleness and the choice of what counts as placed since; the fit
itself is :mod:`.fit`'s (``by_use``), over the ``measured_mib`` of :class:`~.model.GpuState`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from tessera.contract import GpuInfo, NodeGpuUsage

# The defaults of the extender's --best-effort-margin-mib, --best-effort-margin-percent and
# --best-effort-usage-max-age (the node agent measures every few seconds).
MARGIN_MIB = 1024
MARGIN_PERCENT = 10.0
MAX_AGE = timedelta(seconds=60)


@dataclass(frozen=True, slots=True)
class UsageRule:
    """How much of a measurement to trust: the safety margin on top of it and how long it holds."""

    margin_mib: int = MARGIN_MIB
    margin_percent: float = MARGIN_PERCENT
    max_age: timedelta = MAX_AGE

    def __post_init__(self) -> None:
        if self.margin_mib < 0:
            raise ValueError(f"margin_mib: {self.margin_mib} is negative")
        if not 0 <= self.margin_percent <= 100:
            raise ValueError(f"margin_percent: {self.margin_percent} is not within 0..100")
        if self.max_age <= timedelta(0):
            raise ValueError(f"max_age: {self.max_age} is not positive")

    def margin(self, memory_mib: int) -> int:
        """The safety margin on a GPU of ``memory_mib``: the larger of the floor and the percent."""
        return max(self.margin_mib, int(memory_mib * self.margin_percent / 100))

    def fresh(self, measured_at: datetime, now: datetime) -> bool:
        """Whether a measurement taken at ``measured_at`` may still be trusted at ``now``."""
        return now - measured_at <= self.max_age

    def bounds(self, inventory: Iterable[GpuInfo], usage: NodeGpuUsage) -> dict[str, int]:
        """By GPU UUID: the measured use plus the margin, for the inventory's GPUs that the
        measurement names (``GpuState.measured_mib`` before the grants placed since)."""
        used = {gpu.uuid: gpu.memory_used_mib for gpu in usage.gpus}
        return {
            gpu.uuid: used[gpu.uuid] + self.margin(gpu.total_memory_mib)
            for gpu in inventory
            if gpu.uuid in used
        }


def placed_since(measured_at: datetime, bind_time: datetime | None, in_flight: bool) -> bool:
    """Whether a pod's grants count in full on top of a measurement taken at ``measured_at``: its pod
    is in flight (not yet started), or was bound at or after the measurement (or when, unknown)."""
    return in_flight or bind_time is None or bind_time >= measured_at
