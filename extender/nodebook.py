"""The node book: what the extender knows of each Node, from its annotations alone.

* The device plugin's inventory (``KEYS.node_gpus``) and heartbeat (``KEYS.node_heartbeat``). A node
  whose heartbeat is missing or older than the timeout stays in the placement engine as
  unschedulable, with the reason, so pods are told why (a stale node).
* Its measured GPU use (``KEYS.node_gpu_usage``), read only with a :class:`UsageRule` (the flag
  ``--best-effort-oversubscription``): best-effort pods may then be placed against it
  (docs/placement.md, "Usage-aware placement of best-effort pods"). A measurement that holds as of
  neither its own time nor the node's heartbeat within the rule's max age, or is unreadable (logged,
  naming the node and the field), allows nothing against use on its node; the sweep re-judges its
  age as it does heartbeats'.

It builds a node's :class:`NodeState` from its record and the allocations counted on it, and tells
nothing to anyone: :class:`extender.state.ClusterState` hands what it builds to the placement engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from extender.podrecords import PodAllocation
from tessera.contract import (
    Allocation,
    ContractError,
    ContractKeys,
    GpuInfo,
    JsonObject,
    NodeGpuUsage,
    parse_gpu_usage,
    parse_inventory,
    parse_time,
)
from tessera.placement import NodeState, UsageRule, build_node, placed_since

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeRecord:
    inventory: tuple[GpuInfo, ...] | None
    inventory_error: str | None
    heartbeat: datetime | None
    heartbeat_error: str | None
    stale_reason: str | None = None
    # Its measured GPU use, when read (a UsageRule set) and readable, with the time it was measured.
    usage_text: str | None = None
    usage: NodeGpuUsage | None = None
    measured_at: datetime | None = None
    usage_fresh: bool = False  # measured within the rule's max age, as of the last judgement


class NodeBook:
    def __init__(
        self, keys: ContractKeys, heartbeat_timeout: timedelta, usage_rule: UsageRule | None
    ) -> None:
        """``usage_rule``: read the nodes' measured GPU use and trust it this far (None: never place
        against measured use)."""
        self.keys = keys
        self.heartbeat_timeout = heartbeat_timeout
        self.usage_rule = usage_rule
        self._nodes: dict[str, NodeRecord] = {}
        self.synced = False  # filled by a first list

    def __contains__(self, name: str) -> bool:
        return name in self._nodes

    def names(self) -> set[str]:
        return set(self._nodes)

    def upsert(self, node: JsonObject, now: datetime) -> str:
        """The Node as the watch (or a relist) shows it; returns its name. A node without an
        inventory annotation is no GPU node: it leaves the book."""
        name = str(node["metadata"]["name"])
        annotations = node["metadata"].get("annotations") or {}
        inventory_text = annotations.get(self.keys.node_gpus)
        inventory: tuple[GpuInfo, ...] | None = None
        inventory_error = None
        if inventory_text is not None:
            try:
                inventory = parse_inventory(inventory_text, node=name)
            except ContractError as e:
                inventory_error = str(e)
                log.warning("node %s: %s", name, e)
        heartbeat_text = annotations.get(self.keys.node_heartbeat)
        heartbeat = None
        heartbeat_error = None
        if heartbeat_text is not None:
            try:
                heartbeat = parse_time(heartbeat_text, field=f"annotation {self.keys.node_heartbeat}")
            except ContractError as e:
                heartbeat_error = str(e)
        if inventory is None and inventory_error is None:
            self._nodes.pop(name, None)
            return name
        record = NodeRecord(inventory, inventory_error, heartbeat, heartbeat_error)
        record.stale_reason = self._staleness(record, now)
        if self.usage_rule is not None:
            record.usage_text = annotations.get(self.keys.node_gpu_usage)
            before = self._nodes.get(name)
            if before is not None and before.usage_text == record.usage_text:
                # Unchanged (a heartbeat's update): not parsed, nor logged, again.
                record.usage, record.measured_at = before.usage, before.measured_at
            else:
                record.usage, record.measured_at = self._measured_use(name, record.usage_text)
            record.usage_fresh = self._usage_fresh(record, now)
        self._nodes[name] = record
        return name

    def remove(self, name: str) -> None:
        self._nodes.pop(name, None)

    def sweep(self, now: datetime) -> list[str]:
        """Re-judge every node's heartbeat, and the age of its measured use, at ``now``; returns the
        nodes whose standing changed."""
        changed = []
        for name, record in self._nodes.items():
            stale = self._staleness(record, now)
            fresh = self._usage_fresh(record, now)
            if (stale is None) != (record.stale_reason is None) or fresh != record.usage_fresh:
                record.stale_reason = stale
                record.usage_fresh = fresh
                changed.append(name)
        return changed

    def build(
        self,
        name: str,
        pods: Sequence[PodAllocation],
        allocations: Sequence[Allocation],
        in_flight: Callable[[PodAllocation], bool],
    ) -> NodeState | None:
        """The node as placement sees it with ``pods`` counted on it, at ``allocations`` (each pod's,
        in the same order: a live resize being written counts at the larger quotas); None for a node
        not in the book."""
        record = self._nodes.get(name)
        if record is None:
            return None
        if record.inventory is None:
            reason = record.inventory_error or "no inventory"
            return build_node(name, (), schedulable=False, unschedulable_reason=reason)
        measured = None
        since: list[Allocation] = []
        if self.usage_rule is not None and record.usage_fresh and record.usage is not None:
            assert record.measured_at is not None  # set with usage
            measured = self.usage_rule.bounds(record.inventory, record.usage)
            since = [
                allocation
                for pod, allocation in zip(pods, allocations, strict=True)
                if placed_since(record.measured_at, pod.bind_time, in_flight(pod))
            ]
        return build_node(
            name,
            record.inventory,
            allocations,
            schedulable=record.stale_reason is None,
            unschedulable_reason=record.stale_reason or "",
            measured=measured,
            placed_since=since,
        )

    def _measured_use(self, name: str, text: str | None) -> tuple[NodeGpuUsage | None, datetime | None]:
        """The node's measured use and its time; (None, None) when absent or unreadable (logged,
        naming the node and the field: the node is then treated as unmeasured)."""
        if text is None:
            return None, None
        try:
            usage = parse_gpu_usage(text, node=name)
            measured_at = parse_time(
                usage.time, field=f"node {name!r}: annotation {self.keys.node_gpu_usage}: time"
            )
        except ContractError as e:
            log.warning("%s; no best-effort pod is placed against measured use there", e)
            return None, None
        return usage, measured_at

    def _usage_fresh(self, record: NodeRecord, now: datetime) -> bool:
        """Whether the node's measured use still holds at ``now``: it holds as of the node agent's
        latest heartbeat, when that is newer (the agent patches its measured use with every heartbeat
        whenever it changed at all, docs/deviceplugin.md: an older one with a newer heartbeat is
        unchanged since, within the agent's --usage-change-mib, which the margin covers)."""
        rule = self.usage_rule
        if rule is None or record.measured_at is None:
            return False
        holds_at = (
            record.measured_at if record.heartbeat is None else max(record.measured_at, record.heartbeat)
        )
        return rule.fresh(holds_at, now)

    def _staleness(self, record: NodeRecord, now: datetime) -> str | None:
        if record.heartbeat_error is not None:
            return record.heartbeat_error
        if record.heartbeat is None:
            return (
                f"no heartbeat from the Tessera device plugin (annotation {self.keys.node_heartbeat}): "
                "not running, stopping, or not yet registered with the kubelet"
            )
        age = now - record.heartbeat
        if age > self.heartbeat_timeout:
            return (
                f"Tessera device plugin heartbeat is {int(age.total_seconds())} s old "
                f"(timeout {int(self.heartbeat_timeout.total_seconds())} s)"
            )
        return None
