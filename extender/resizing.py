"""Live resize: new quotas for a running pod, asked by its ``<domain>/resize`` annotation.

The decision is :func:`tessera.placement.resize` over the cluster state (every pod placed and in
flight on the pod's GPUs); this module adds the adapter's part. The pod is read afresh (authority is
the API server's copy, never a cached one); the new allocation is counted from the moment it is
decided (so no bind can take what it grows into while it is written); one merge patch, under the
pod's resourceVersion, writes the allocation and the ``<domain>/resize-status`` and removes the
request; a refusal writes the status and an event naming the shortfall, and changes nothing else.
A resize that grows the pod is also held against its namespace's ResourceQuotas on Tessera's
resources (:mod:`tessera.placement.quota`: the quota controller counts specs, not resizes), read
afresh with the namespace's pods.
The device plugin on the node then rewrites the container's limits file, which the hook follows.

A request is done once its status is written and the request removed, so it is asked again only by
annotating again. Only the leader's extender resizes (as only it binds); requests seen while not
leading, or that failed on the API, are tried again every ``retry_every`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from enum import Enum

from extender.kube import ApiError, KubeApi
from extender.metrics import Metrics
from extender.podrecords import TERMINAL_POD_PHASES
from extender.state import ClusterState
from tessera.contract import (
    Allocation,
    ContractError,
    ContractKeys,
    JsonObject,
    Phase,
    ResizeOutcome,
    ResizeStatus,
    dump_allocation,
    dump_resize_status,
    format_time,
    parse_allocation,
    parse_integer_quantity,
    parse_pod_request,
    parse_resize,
    pod_ref,
)
from tessera.inflight import is_allocating
from tessera.placement import QuotaLimit, ResizeRefusal, beyond_spec, quota_refusal, quota_resources, resize

log = logging.getLogger(__name__)

# Attempts of one request when the pod changes between its read and the patch (409 Conflict).
RESIZE_ATTEMPTS = 3
REFUSED_REASON = "TesseraResizeRefused"
APPLIED_REASON = "TesseraResized"
# A pod whose GPUs come from DRA claims: the API server keeps a claim's allocation (with the capacity
# it consumes, which kube-scheduler sums) as it was first written, so no quota of it can change.
DRA_REFUSAL = (
    "the pod's GPUs come from DRA claims, whose allocated capacity cannot change once allocated "
    '(docs/dra.md, "Live resize"): create the pod again with claims asking the new capacity'
)


class _Step(Enum):
    DONE = "done"  # answered, or nothing to answer any more
    AGAIN = "again"  # the pod changed between the read and the patch: read it again now
    WAIT = "wait"  # the pod is still being admitted: asked again once it is (or in retry_every)


class Resizer:
    def __init__(
        self,
        state: ClusterState,
        kube: KubeApi,
        keys: ContractKeys,
        metrics: Metrics,
        *,
        clock: Callable[[], datetime],
        leads: Callable[[], Awaitable[str]],
        retry_every: float = 5.0,
    ) -> None:
        self.state = state
        self.kube = kube
        self.keys = keys
        self.metrics = metrics
        self.clock = clock
        self.leads = leads
        self.retry_every = retry_every
        # Pods with a request not yet answered, by UID: (namespace, name).
        self._pending: dict[str, tuple[str, str]] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._retry: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._retry = asyncio.create_task(self._retry_pending(), name="resize-retry")

    async def stop(self) -> None:
        tasks = [*self._running.values(), *([self._retry] if self._retry is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()
        self._retry = None

    def pod_changed(self, pod: JsonObject) -> None:
        """A pod as the watch shows it: a request on a bound pod is answered in a task of its own."""
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid") or "")
        if (metadata.get("annotations") or {}).get(self.keys.resize) is None or not uid:
            self._pending.pop(uid, None)
            return
        if not (pod.get("spec") or {}).get("nodeName"):
            return  # not placed yet: nothing to resize (bind places it as the pod asks)
        self._pending[uid] = (str(metadata.get("namespace")), str(metadata.get("name")))
        self._answer(uid)

    def pod_deleted(self, uid: str) -> None:
        self._pending.pop(uid, None)

    def _answer(self, uid: str) -> None:
        if uid in self._running or uid not in self._pending:
            return  # one request of a pod at a time; the task reads the pod afresh
        namespace, name = self._pending[uid]
        task = asyncio.create_task(self._resize(namespace, name, uid), name=f"resize-{namespace}/{name}")
        self._running[uid] = task
        task.add_done_callback(lambda _: self._running.pop(uid, None))

    async def _retry_pending(self) -> None:
        while True:
            await asyncio.sleep(self.retry_every)
            for uid in list(self._pending):
                self._answer(uid)

    async def _resize(self, namespace: str, name: str, uid: str) -> None:
        ref = pod_ref(namespace, name)
        try:
            not_leading = await self.leads()
            if not_leading:
                log.debug("resize of %s waits: %s", ref, not_leading)
                return
            for _ in range(RESIZE_ATTEMPTS):
                step = await self._resize_once(namespace, name, uid)
                if step is _Step.DONE:
                    self._pending.pop(uid, None)
                if step is not _Step.AGAIN:
                    return
        except ApiError as e:
            if e.status == 404:
                self._pending.pop(uid, None)
                return
            log.warning("resize of %s: %s (tried again in %.0f s)", ref, e, self.retry_every)

    async def _resize_once(self, namespace: str, name: str, uid: str) -> _Step:
        """One read and one patch."""
        pod = await self.kube.get_pod(namespace, name)
        metadata = pod.get("metadata") or {}
        annotations = metadata.get("annotations") or {}
        text = annotations.get(self.keys.resize)
        if str(metadata.get("uid")) != uid or text is None:
            return _Step.DONE  # another pod under the name now, or the request was withdrawn
        if is_allocating(annotations.get(self.keys.allocation_phase)):
            return _Step.WAIT  # its containers are being given their GPUs with the allocation as it is
        # Read before deciding: from the decision to its being counted (state.resizing) nothing may
        # await, or a bind could take what the resize grows into.
        quota = await self._quota_view(pod)
        if not self.state.upsert_read_pod(pod):
            return _Step.WAIT  # the watch has shown a newer pod (or its deletion) meanwhile: read again
        decided = self._decide(pod, text)
        if isinstance(decided, Allocation) and quota is not None:
            decided = quota.refusal(decided) or decided
        patch: dict[str, str | None] = {self.keys.resize: None}
        if isinstance(decided, Allocation):
            patch[self.keys.allocation] = dump_allocation(decided)
            self.state.resizing(uid, decided)
            outcome, message = ResizeOutcome.APPLIED, _describe(decided)
        else:
            outcome, message = ResizeOutcome.REFUSED, decided
        status = ResizeStatus(request=text, outcome=outcome, message=message, time=format_time(self.clock()))
        patch[self.keys.resize_status] = dump_resize_status(status)
        body = {
            "metadata": {"uid": uid, "resourceVersion": metadata.get("resourceVersion"), "annotations": patch}
        }
        try:
            await self.kube.patch_pod_metadata(namespace, name, body)
        except ApiError as e:
            self.state.resize_failed(uid)
            if e.status == 409:
                return _Step.AGAIN
            raise
        self.metrics.resizes.labels(outcome.value).inc()
        ref = pod_ref(namespace, name)
        log.info("resize of %s %s: %s (asked %r)", ref, outcome.value, message, text)
        reason = APPLIED_REASON if outcome is ResizeOutcome.APPLIED else REFUSED_REASON
        try:
            await self.kube.create_event(
                pod,
                reason=reason,
                message=f"resize {text!r} {outcome.value}: {message}",
                warning=outcome is ResizeOutcome.REFUSED,
            )
        except ApiError as e:
            log.warning("pod %s: cannot record the resize event: %s", ref, e)
        return _Step.DONE

    def _decide(self, pod: JsonObject, text: str) -> Allocation | str:
        """The pod's new allocation, or why not (the message written on the pod)."""
        metadata = pod.get("metadata") or {}
        annotations = metadata.get("annotations") or {}
        ref = pod_ref(str(metadata.get("namespace")), str(metadata.get("name")))
        if (pod.get("status") or {}).get("phase") in TERMINAL_POD_PHASES or metadata.get("deletionTimestamp"):
            return "the pod has finished or is being deleted"
        allocation_text = annotations.get(self.keys.allocation)
        if allocation_text is None and (
            (pod.get("spec") or {}).get("resourceClaims")
            # A whole-GPU pod's claim is the one kube-scheduler made for its extended resource.
            or (pod.get("status") or {}).get("extendedResourceClaimStatus")
        ):
            return DRA_REFUSAL
        if allocation_text is None:
            return "the pod has no Tessera allocation"
        phase = annotations.get(self.keys.allocation_phase) or "without a phase"
        if phase != Phase.ALLOCATED.value:
            return (
                f"the pod's allocation is {phase}, not {Phase.ALLOCATED.value}: a resize applies to a pod "
                "whose containers were given their GPUs"
            )
        try:
            request = parse_resize(text, self.keys)
            allocation = parse_allocation(allocation_text, pod=ref)
        except ContractError as e:
            return str(e)
        node = self.state.node(allocation.node)
        if node is None:
            return f"node {allocation.node!r} has no Tessera GPU inventory"
        decided = resize(node, allocation, request)
        if isinstance(decided, ResizeRefusal):
            return decided.reason
        return decided

    async def _quota_view(self, pod: JsonObject) -> _QuotaView | None:
        """The pod's namespace's ResourceQuotas on Tessera's resources, and what its other pods hold
        beyond their specs, read afresh; None when the namespace has no such quota."""
        metadata = pod.get("metadata") or {}
        namespace, uid = str(metadata.get("namespace")), str(metadata.get("uid"))
        limits = await self._quota_limits(namespace)
        if not limits:
            return None
        pods, _ = await self.kube.list(f"/api/v1/namespaces/{namespace}/pods")
        others: dict[str, int] = {}
        for other in pods:
            other_meta = other.get("metadata") or {}
            allocation_text = (other_meta.get("annotations") or {}).get(self.keys.allocation)
            if other_meta.get("uid") == uid or allocation_text is None:
                continue
            if (other.get("status") or {}).get("phase") in TERMINAL_POD_PHASES:
                continue  # the quota controller no longer counts it either
            try:
                spec = parse_pod_request(other, self.keys).containers
                held = beyond_spec(spec, parse_allocation(allocation_text), self.keys)
            except ContractError:
                continue  # not a pod Tessera placed as it is now
            for resource, amount in held.items():
                others[resource] = others.get(resource, 0) + amount
        return _QuotaView(self.keys, namespace, pod, limits, others)

    async def _quota_limits(self, namespace: str) -> list[QuotaLimit]:
        """The namespace's ResourceQuotas' limits on Tessera's resources. A quota with scopes counts
        only some pods, which this does not tell apart: it is left out (docs/placement.md)."""
        quotas, _ = await self.kube.list(f"/api/v1/namespaces/{namespace}/resourcequotas")
        limits = []
        for quota in quotas:
            spec = quota.get("spec") or {}
            if spec.get("scopes") or spec.get("scopeSelector"):
                continue
            hard = spec.get("hard") or {}
            used = (quota.get("status") or {}).get("used") or {}
            name = str((quota.get("metadata") or {}).get("name"))
            for resource in quota_resources(self.keys):
                if resource not in hard:
                    continue
                try:
                    limit = parse_integer_quantity(hard[resource], field=f"{name}: spec.hard[{resource}]")
                    use = parse_integer_quantity(
                        used.get(resource, "0"), field=f"{name}: status.used[{resource}]"
                    )
                except ContractError as e:  # Tessera's resources are whole numbers; this quota cannot hold
                    log.warning("namespace %s: ResourceQuota ignored for resizes: %s", namespace, e)
                    continue
                limits.append(QuotaLimit(quota=name, resource=resource, hard=limit, used=use))
        return limits


@dataclass(frozen=True, slots=True)
class _QuotaView:
    """What a growing resize of ``pod`` is held against (tessera.placement.quota)."""

    keys: ContractKeys
    namespace: str
    pod: JsonObject
    limits: list[QuotaLimit]
    others_beyond: dict[str, int]

    def refusal(self, decided: Allocation) -> str:
        """Why ``decided`` breaks a quota ("" when it does not)."""
        annotations = (self.pod.get("metadata") or {}).get("annotations") or {}
        try:
            containers = parse_pod_request(self.pod, self.keys).containers
            before = parse_allocation(annotations[self.keys.allocation])
        except (ContractError, KeyError) as e:
            return f"cannot hold the resize against the namespace's quota: {e}"
        return quota_refusal(
            self.namespace,
            self.limits,
            self.others_beyond,
            beyond_spec(containers, before, self.keys),
            beyond_spec(containers, decided, self.keys),
        )


def _describe(allocation: Allocation) -> str:
    return "; ".join(
        f"container {c.name}: "
        + ", ".join(f"{g.uuid} {g.memory_quota_mib} MiB {g.cores}% compute" for g in c.gpus)
        for c in allocation.containers
    )
