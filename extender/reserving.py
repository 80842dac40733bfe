"""The reserver: a reservation for the node a pod was filtered or scored best on, and a check of the
pod in the background (docs/security.md: a filter body names a pod anyone could make up)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from datetime import datetime

from extender.filtered import Filtered, FilteredPods
from extender.kube import ApiError, KubeApi
from extender.podrecords import PodAllocation
from extender.shapes import PodShapes
from extender.state import ClusterState
from tessera.contract import ContractError, ContractKeys, JsonObject, parse_pod_request
from tessera.placement import NodeFit, to_allocation

log = logging.getLogger(__name__)

# Reservations whose pod is still being checked (see Reserver.reserve); past it none is made.
MAX_UNCHECKED_RESERVATIONS = 64


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # called outside the server (tests, benchmarks): nothing to check with
        return None


class Reserver:
    def __init__(
        self,
        state: ClusterState,
        kube: KubeApi | None,
        keys: ContractKeys,
        shapes: PodShapes,
        filtered: FilteredPods,
        *,
        clock: Callable[[], datetime],
        scheduler_names: AbstractSet[str],
    ) -> None:
        """``scheduler_names``: the pods a reservation is kept for name one of these in
        spec.schedulerName."""
        self.state = state
        self.kube = kube
        self.keys = keys
        self.shapes = shapes
        self.filtered = filtered
        self.clock = clock
        self.scheduler_names = frozenset(scheduler_names)
        # Background checks of reservations (see reserve).
        self._checks: set[asyncio.Task[None]] = set()

    def unchecked(self) -> int:
        """Reservations whose pod is being checked now."""
        return len(self._checks)

    def reserve(self, pod: JsonObject, remembered: Filtered, fit: NodeFit) -> None:
        """Reserve ``fit`` for the pod, and check the pod in the background: a filter body names a
        pod anyone could make up, and a reservation for a pod that does not exist, names another
        scheduler or asks another shape must not hold capacity for its 10 s."""
        checking = self.kube is not None and _running_loop() is not None
        if checking and len(self._checks) >= MAX_UNCHECKED_RESERVATIONS:
            # A reservation only spares a pod a failed bind: none is made while this many are
            # unchecked (a flood of filters, not kube-scheduler's one at a time).
            log.debug("no reservation: %d unchecked already", len(self._checks))
            return
        allocation = to_allocation(
            fit.node,
            fit.placement,
            [c.name for c in remembered.request.containers],
            self.shapes.qos(pod, remembered.request),
        )
        metadata = pod.get("metadata") or {}
        now = self.clock()
        shape = self.shapes.shape(pod, remembered.request)
        record = PodAllocation(
            uid=str(metadata.get("uid")),
            namespace=str(metadata.get("namespace", "")),
            name=str(metadata.get("name", "")),
            allocation=allocation,
            phase=None,
            bind_time=now,  # the in-flight rule's timeout runs from the reservation
            shape=shape,
        )
        self.state.reserve(record, now, fit)
        if checking:
            task = asyncio.get_running_loop().create_task(self._check(record))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    def drop(self, uid: str) -> None:
        """Forget a pod that will not be bound here: its filter answer and its reservation."""
        if uid:
            self.filtered.forget(uid)
            self.state.unreserve(uid)

    async def _check(self, reserved: PodAllocation) -> None:
        """Drop ``reserved`` unless the API server has its pod, unbound, of a scheduler served
        here, asking the shape it was reserved for."""
        assert self.kube is not None
        try:
            pod = await self.kube.get_pod(reserved.namespace, reserved.name)
        except ApiError as e:
            if e.status == 404:
                self.drop(reserved.uid)
            return
        except Exception:  # the check is best effort: the reservation expires anyway
            log.exception("checking the reservation of pod %s", reserved.ref)
            return
        metadata = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        try:
            shape = self.shapes.shape(pod, parse_pod_request(pod, self.keys))
        except ContractError:
            shape = None
        if (
            metadata.get("uid") != reserved.uid
            or spec.get("nodeName")
            or spec.get("schedulerName") not in self.scheduler_names
            or shape != reserved.shape
        ):
            current = self.state.reservation(reserved.uid)
            if current is not None and current.allocation == reserved.allocation:
                log.info("dropping the reservation of pod %s: not a pod this extender binds", reserved.ref)
                self.drop(reserved.uid)
