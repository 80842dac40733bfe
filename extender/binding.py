"""Bind: the pod read afresh from the API server, placed on kube-scheduler's node (bind's in-memory
half, :class:`extender.deciding.Decider`), and bound with its allocation in one write
(docs/placement.md, "Bind")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from datetime import datetime

from extender.catchup import CatchUp
from extender.deciding import Decider, Refusal
from extender.filtered import Filtered, FilteredPods
from extender.kube import ApiError, KubeApi
from extender.leader import Leadership
from extender.metrics import BindFailure, Metrics
from extender.podrecords import bound_record
from extender.reserving import Reserver
from extender.shapes import PodShapes, namespace_of, ref_of
from extender.state import ClusterState, require_synced
from tessera.contract import (
    Allocation,
    ContractError,
    ContractKeys,
    JsonObject,
    Phase,
    PodRequest,
    dump_allocation,
    format_time,
    parse_allocation,
    parse_pod_request,
    pod_ref,
)
from tessera.inflight import read_bind_time
from tessera.placement.qos import QOS_LOWERED_REASON

log = logging.getLogger(__name__)

# The scheduler profile whose pods the extender binds (the chart's scheduler.name).
DEFAULT_SCHEDULER_NAME = "tessera-scheduler"
# Attempts at writing the allocation when the pod changes under the bind (HTTP 409).
BIND_ATTEMPTS = 3


class Binder:
    def __init__(
        self,
        state: ClusterState,
        kube: KubeApi | None,
        keys: ContractKeys,
        metrics: Metrics,
        shapes: PodShapes,
        *,
        filtered: FilteredPods,
        reserver: Reserver,
        decider: Decider,
        catch_up: CatchUp | None,
        leadership: Leadership,
        clock: Callable[[], datetime],
        scheduler_names: AbstractSet[str],
    ) -> None:
        """``kube`` and ``catch_up``: None without the Kubernetes API (bind fails, saying so).
        ``scheduler_names``: bind binds only pods naming one of these in spec.schedulerName."""
        self.state = state
        self.kube = kube
        self.keys = keys
        self.metrics = metrics
        self.shapes = shapes
        self.filtered = filtered
        self.reserver = reserver
        self.decider = decider
        self.catch_up = catch_up
        self.leadership = leadership
        self.clock = clock
        self.scheduler_names = frozenset(scheduler_names)

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Place and bind the pod on ``node``; returns "" on success, else the error for kube-scheduler.

        Bound as the API server has the pod, read afresh: whoever calls bind names a pod, and
        nothing in a filter body (which anyone could have sent) decides what it gets.
        """
        require_synced(self.state)
        error = "no attempt made"
        # First decided from the copy sent to filter while the pod is read, kept only if the API's
        # copy asks the same; after a conflict, decided from the API's copy alone.
        remembered = self.filtered.get(uid)
        for _ in range(BIND_ATTEMPTS):
            error, retry = await self._bind_once(namespace, name, uid, node, remembered)
            if not retry:
                break
            remembered = None
        self.metrics.binds.labels("bound" if not error else "failed").inc()
        if error:
            log.info("bind %s/%s on %s refused: %s", namespace, name, node, error)
        return error

    async def _bind_once(
        self, namespace: str, name: str, uid: str, node: str, remembered: Filtered | None
    ) -> tuple[str, bool]:
        """(error, worth retrying at once with the pod read afresh).

        One read, then one write: a Binding whose annotations (allocation, phase allocating, bind
        time) the API server copies onto the pod together with the node name, under the pod's UID
        and resourceVersion as preconditions. The pod is never bound without its allocation, and a
        failure leaves nothing to roll back on the pod.

        While the pod is read, the placement is decided from the filter's copy (``remembered``),
        at once as before the read was added, so the next pod's filter sees it counted; it is kept
        only if the API's copy asks exactly the same, else undone and decided from the API's copy.
        """
        kube, catch_up = self.kube, self.catch_up
        assert kube is not None and catch_up is not None, "bind needs the Kubernetes API"
        ref = pod_ref(namespace, name)
        leading = asyncio.ensure_future(self.leadership.leads())
        reading = asyncio.ensure_future(kube.get_pod(namespace, name))
        listing = asyncio.ensure_future(catch_up.node_pods(node))
        early: Allocation | None = None
        now = self.clock()
        if remembered is not None:
            decided_early = self.decider.decide(remembered.pod, remembered.request, node, now)
            if not isinstance(decided_early, Refusal):
                early = decided_early
        try:
            not_leading = await leading
            pod = await reading
            node_pods = await listing
        except ApiError as e:
            self._undo(uid, early)
            reading.cancel()
            listing.cancel()
            if e.status == 404 and uid:
                self.reserver.drop(uid)  # its reservation holds capacity for nobody
            return self._fail("gone" if e.status == 404 else "api", f"pod {ref}: cannot read it: {e}"), False
        except BaseException:
            self._undo(uid, early)
            reading.cancel()
            listing.cancel()
            raise
        if not_leading:
            self._undo(uid, early)
            return self._fail("not_leader", f"pod {ref}: {not_leading}"), False
        if catch_up.apply(node_pods):
            # Pods on the node that the watch had not shown yet, or not there (a bind whose answer
            # was lost, reserved elsewhere by kube-scheduler's retry): the early decision did not
            # see them.
            self._undo(uid, early)
            early = None
        refused = self._refuse_bind(pod, uid, node)
        if refused is not None:
            self._undo(uid, early)
            return refused, False
        try:
            request = parse_pod_request(pod, self.keys)
        except ContractError as e:
            self._undo(uid, early)
            self.reserver.drop(uid)
            return self._fail("invalid", f"pod {ref}: {e}"), False
        metadata = pod.get("metadata") or {}
        pod_uid = str(metadata.get("uid") or uid)
        decided: Allocation | Refusal
        if early is not None and remembered is not None and remembered.request == request:
            decided = early
        else:
            self._undo(pod_uid, early)
            reserved = self.state.reservation(pod_uid)
            if reserved is not None and reserved.shape != self.shapes.shape(pod, request):
                # A reservation made from a filter body asking something else than the pod does.
                self.state.unreserve(pod_uid)
            now = self.clock()
            decided = await self.decider.decide_waiting(pod, request, node, now)
        if isinstance(decided, Refusal):
            return self._fail(decided.reason, decided.message), False
        annotations = {
            self.keys.allocation: dump_allocation(decided),
            self.keys.allocation_phase: Phase.ALLOCATING.value,
            self.keys.bind_time: format_time(now),
        }
        try:
            await kube.bind_pod(
                namespace,
                name,
                uid=pod_uid,
                resource_version=str(metadata.get("resourceVersion") or ""),
                node=node,
                annotations=annotations,
            )
        except ApiError as e:
            self.state.forget(pod_uid, decided)
            if e.status == 409:
                # Changed under us, or bound by an earlier attempt whose answer was lost: read again.
                return self._fail("conflict", f"pod {ref} changed while binding: {e.message}"), True
            return self._fail("api", f"pod {ref}: binding to {node} failed: {e}"), False
        except BaseException:
            # Cancelled (the extender stopping) with the answer unknown: if the bind went through,
            # the watch shows the pod; an assumption kept would count a pod never bound for good.
            self.state.forget(pod_uid, decided)
            raise
        self.state.bind_answered(pod_uid)
        self.filtered.forget(pod_uid)
        self.state.placed(self.shapes.shape(pod, request))
        await self._tell_lowered_class(pod, request)
        if any(g.oversubscribed for c in decided.containers for g in c.gpus):
            self.metrics.oversubscribed_binds.inc()
        return "", False

    def _undo(self, uid: str, early: Allocation | None) -> None:
        """Undo a decision taken from the filter's copy that will not be written."""
        if early is not None:
            self.state.forget(uid, early)

    def _refuse_bind(self, pod: JsonObject, uid: str, node: str) -> str | None:
        """None if the pod read from the API is one to bind now; else the answer ("" for a retry of
        a bind that went through, else the error)."""
        done = self._already_bound(pod, uid, node)
        if done is not None:
            return done
        scheduler = (pod.get("spec") or {}).get("schedulerName")
        if scheduler not in self.scheduler_names:
            self.reserver.drop(uid)
            served = ", ".join(sorted(self.scheduler_names))
            return self._fail(
                "scheduler",
                f"pod {ref_of(pod)} names scheduler {scheduler!r}; this extender binds for {served}",
            )
        return None

    def _already_bound(self, pod: JsonObject, uid: str, node: str) -> str | None:
        """None if the pod (read from the API) still needs binding; "" if it is bound to ``node`` with
        an allocation there (a retry of a bind that went through); else the error."""
        metadata = pod.get("metadata") or {}
        ref = ref_of(pod)
        if uid and metadata.get("uid") != uid:
            return self._fail("gone", f"pod {ref} is now UID {metadata.get('uid')}, not {uid}")
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if not bound_to:
            return None
        current = self._current_allocation(metadata.get("annotations") or {}, ref)
        if bound_to == node and current is not None and current.node == node:
            bind_time = read_bind_time(metadata.get("annotations") or {}, self.keys, pod=ref)
            self.state.assume(bound_record(pod, current, bind_time or self.clock()))
            self.state.bind_answered(uid)
            return ""
        return self._fail("bound", f"pod {ref} is already bound to node {bound_to}")

    async def _tell_lowered_class(self, pod: JsonObject, request: PodRequest) -> None:
        """A Warning event on a pod bound with a lower class than its annotation asked for."""
        assert self.kube is not None
        why = self.shapes.lowered(pod, request)
        if not why:
            return
        try:
            await self.kube.create_event(pod, reason=QOS_LOWERED_REASON, message=why, warning=True)
        except ApiError as e:
            name = str((pod.get("metadata") or {}).get("name") or "")
            log.warning(
                "pod %s: cannot record that its class was lowered: %s", pod_ref(namespace_of(pod), name), e
            )

    def _current_allocation(self, annotations: dict[str, str], ref: str) -> Allocation | None:
        text = annotations.get(self.keys.allocation)
        if text is None:
            return None
        try:
            return parse_allocation(text, pod=ref)
        except ContractError:
            return None

    def _fail(self, reason: BindFailure, message: str) -> str:
        self.metrics.bind_failures.labels(reason).inc()
        return message
