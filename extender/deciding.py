"""Bind's in-memory half: the allocation on the node kube-scheduler chose, against the current state,
assumed at once; or why not (docs/placement.md, "Bind")."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from extender.metrics import BindFailure
from extender.podrecords import bound_record
from extender.shapes import PodShapes, ref_of
from extender.state import ClusterState
from tessera.contract import Allocation, JsonObject, Phase, PodRequest
from tessera.placement import to_allocation


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why bind cannot place a pod on the node now: the failure metric's reason, and the message."""

    reason: BindFailure
    message: str


class Decider:
    def __init__(
        self, state: ClusterState, shapes: PodShapes, *, inflight_timeout: timedelta, inflight_wait: timedelta
    ) -> None:
        """``inflight_wait``: how long a decision may wait while only the in-flight rule refuses."""
        self.state = state
        self.shapes = shapes
        self.inflight_timeout = inflight_timeout
        self.inflight_wait = inflight_wait

    def decide(self, pod: JsonObject, request: PodRequest, node: str, now: datetime) -> Allocation | Refusal:
        """The allocation on ``node`` against the current state, assumed at once; or why not."""
        uid = str((pod.get("metadata") or {}).get("uid"))
        ref = ref_of(pod)
        shape = self.shapes.shape(pod, request)
        # Usually filter reserved the pod on this very node: that placement becomes the decision.
        confirmed = self.state.confirm_reservation(uid, node, Phase.ALLOCATING.value, now)
        if confirmed is not None:
            return confirmed.allocation
        self.state.unreserve(uid)  # the pod's own reservation must not stand in its way
        evaluation = self.state.evaluate(shape, [node])
        if not evaluation.fits:
            reason = evaluation.rejections[0].reason
            return Refusal("no_fit", f"pod {ref} no longer fits on node {node}: {reason}")
        fit = self.state.keeping_inflight_rule(
            evaluation.fits[0], shape, evaluation.policy, uid=uid, now=now, timeout=self.inflight_timeout
        )
        if isinstance(fit, str):
            return Refusal("inflight", fit)
        allocation = to_allocation(
            fit.node, fit.placement, [c.name for c in request.containers], self.shapes.qos(pod, request)
        )
        self.state.assume(bound_record(pod, allocation, now))
        return allocation

    async def decide_waiting(
        self, pod: JsonObject, request: PodRequest, node: str, now: datetime
    ) -> Allocation | Refusal:
        """:meth:`decide`, waiting up to ``inflight_wait`` while only the in-flight rule refuses.

        Other pods are being admitted on the node: the device plugin usually serves them within a
        second, and waiting here beats failing the bind into kube-scheduler's backoff.
        """
        deadline = time.monotonic() + self.inflight_wait.total_seconds()
        while True:
            decided = self.decide(pod, request, node, now)
            remaining = deadline - time.monotonic()
            if not isinstance(decided, Refusal) or decided.reason != "inflight" or remaining <= 0:
                return decided
            await self.state.changes.wait(remaining)
