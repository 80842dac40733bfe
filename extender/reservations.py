"""Reservations: capacity held for a pod between filter and bind, for a short time to live.

kube-scheduler filters the next pod before the previous one's bind arrives; without the
reservation, pods of one shape would all pick the node the previous pod is filling, and all but one
would fail at bind when it fills up. A reservation is an assumption on the pod's record in the pod
book (``reserved_at`` set), and reserved pods count as in flight.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from extender.countednodes import CountedNodes
from extender.inflightbook import InflightBook
from extender.podbook import PodBook
from extender.podrecords import PodAllocation
from tessera.placement import NodeFit


class Reservations:
    def __init__(self, pods: PodBook, counted: CountedNodes, inflight: InflightBook, ttl: timedelta) -> None:
        self.pods = pods
        self.counted = counted
        self.inflight = inflight
        self.ttl = ttl

    def reserve(self, reserved: PodAllocation, now: datetime, fit: NodeFit | None = None) -> None:
        """Count ``reserved`` for a pod kube-scheduler is about to bind (it was scored best), until
        its bind decides for real or ``ttl`` passes. ``fit`` is the fit it was made from."""
        record = self.pods.hold(reserved.uid)
        if record.binding:
            return  # a bind already decided
        touched = record.nodes()
        record.assumed = reserved
        record.reserved_at = now
        self.pods.reindex(reserved.uid, touched, fit)

    def reservation(self, uid: str) -> PodAllocation | None:
        """The pod's reservation, if it has one (and no bind decision yet)."""
        record = self.pods.record(uid)
        if record is None or record.reserved_at is None:
            return None
        return record.assumed

    def confirm(self, uid: str, node: str, phase: str, now: datetime) -> PodAllocation | None:
        """Turn the pod's reservation on ``node`` into its bind decision (``phase``, bound at
        ``now``) and return it; None when it has none there, or the node or one of its GPUs has
        since become unusable.

        The reservation already counts on the node, and every decision since was taken with it in
        place, so it still fits, and the in-flight rule held with it (reserved pods count as in
        flight). The node's usage does not change: nothing is rebuilt.
        """
        record = self.pods.record(uid)
        if record is None or record.reserved_at is None or record.assumed is None:
            return None
        reserved = record.assumed
        if reserved.allocation.node != node:
            return None
        state = self.counted.node(node)
        if state is None or not state.schedulable:
            return None
        healthy = {gpu.uuid for gpu in state.gpus if gpu.healthy}
        if any(grant.uuid not in healthy for c in reserved.allocation.containers for grant in c.gpus):
            return None
        confirmed = PodAllocation(
            uid=reserved.uid,
            namespace=reserved.namespace,
            name=reserved.name,
            allocation=reserved.allocation,
            phase=phase,
            bind_time=now,
        )
        record.assumed = confirmed
        record.reserved_at = None
        record.answered = None
        self.pods.refresh_inflight(node)
        return confirmed

    def expire(self, now: datetime) -> None:
        """Drop the reservations older than ``ttl``."""
        # Reserved pods are in flight: the in-flight book has them all, without a walk over every pod.
        expired = [
            p.uid
            for p in self.inflight.everywhere()
            if (record := self.pods.record(p.uid)) is not None
            and (since := record.reserved_at) is not None
            and now - since > self.ttl
        ]
        for uid in expired:
            self.pods.unreserve(uid)
