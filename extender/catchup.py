"""Catching up with the API server: a node's pods as it lists them now, into the state before bind or
filter decides (this extender's watch may lag)."""

from __future__ import annotations

from collections.abc import Sequence

from extender.kube import PODS, KubeApi
from extender.state import ClusterState
from tessera.contract import JsonObject


class CatchUp:
    def __init__(self, state: ClusterState, kube: KubeApi) -> None:
        self.state = state
        self.kube = kube

    async def node_pods(self, node: str) -> list[JsonObject]:
        """The pods bound to ``node`` as the API server lists them; none for a node this extender
        does not know (bind refuses it anyway, and its name goes into no query)."""
        if not self.state.knows_node(node):
            return []
        items, _ = await self.kube.list(PODS, field_selector=f"spec.nodeName={node}")
        return items

    def apply(self, node_pods: Sequence[JsonObject]) -> bool:
        """The node's pods as the API server lists them now, into the state before bind or filter
        decides; whether any is now counted otherwise than before (new to it, or counted with
        another allocation or elsewhere: a pod whose bind answer was lost, reserved on another node
        by kube-scheduler's retry, is found bound here). This extender's watch may lag the API:
        after a failover, the pods the previous leader bound a moment ago, whose allocations the
        in-flight rule and the capacity must count; a pod the device plugin has just served. A list
        is never older than the watch when it is served (kube-apiserver serves it consistently), but
        the watch may show a deletion or a newer version before the list is applied: those it does
        not undo (PodBook.upsert_read)."""
        changed = False
        for pod in node_pods:
            uid = str((pod.get("metadata") or {}).get("uid"))
            before = self.state.counted_as(uid)
            if self.state.upsert_read_pod(pod):
                after = self.state.counted_as(uid)
                # A phase moving on (allocated, failed) only takes a pod out of flight: a decision
                # taken with it in flight still holds.
                changed |= after is not None and (before is None or after.allocation != before.allocation)
        return changed
