"""The extender's three verbs over the cluster state: filter, prioritize, bind.

Decisions come from :mod:`tessera.placement`; this module adds what only the extender does:
answering in kube-scheduler's terms, the in-flight rule, and the bind's writes to the API server.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from extender.kube import ApiError, KubeApi
from extender.metrics import Metrics
from extender.state import ClusterState, PodAllocation
from tessera.contract import (
    Allocation,
    ContractError,
    ContractKeys,
    Phase,
    PodRequest,
    format_time,
    parse_allocation,
    parse_pod_request,
)
from tessera.placement import NodeFit, Shortfall, inflight_conflict, score_fits, shape_of, to_allocation

log = logging.getLogger(__name__)

JsonObject = dict[str, Any]

# Filter results kept for the prioritize call that follows (by pod UID).
REMEMBERED_FILTERS = 256
# Attempts at writing the allocation when the pod changes under the bind (HTTP 409).
BIND_ATTEMPTS = 3


@dataclass(slots=True)
class FilterAnswer:
    passed: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)


def pod_key(pod: JsonObject) -> str:
    metadata = pod.get("metadata") or {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


class Extender:
    def __init__(
        self,
        state: ClusterState,
        kube: KubeApi | None,
        keys: ContractKeys,
        metrics: Metrics,
        *,
        inflight_timeout: timedelta,
        clock: Callable[[], datetime],
    ) -> None:
        self.state = state
        self.kube = kube
        self.keys = keys
        self.metrics = metrics
        self.inflight_timeout = inflight_timeout
        self.clock = clock
        self._filtered: OrderedDict[str, tuple[list[str], list[NodeFit]]] = OrderedDict()

    # ----------------------------------------------------------------------------------------------
    # filter

    def filter(self, pod: JsonObject, names: Sequence[str]) -> FilterAnswer:
        try:
            request = parse_pod_request(pod, self.keys)
        except ContractError as e:
            # The pod itself is wrong: no node can take it, and kubectl describe should say why.
            self.metrics.count_rejections({Shortfall.NODE.value: len(names)})
            return FilterAnswer(passed=[], unresolvable=dict.fromkeys(names, f"pod {pod_key(pod)}: {e}"))
        if not request.wants_gpu:
            return FilterAnswer(passed=list(names))
        shape = shape_of(request)
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        with self.state.lock:
            evaluation = self.state.engine.evaluate(shape, names)
            # Nodes where other pods are in flight: the rule may refuse this pod there.
            inflight = self.state.nodes_with_inflight()
            checked = self.state.engine.evaluate(shape, sorted(inflight)).fits if inflight else []
        answer = FilterAnswer(passed=[])
        kinds: dict[str, int] = {}
        refused: dict[str, str] = {}
        if checked:
            now = self.clock()
            for fit in checked:
                conflict = self._inflight_conflict(fit, request, uid, now)
                if conflict is not None:
                    refused[fit.name] = conflict
        kept = evaluation.fits
        if refused:
            kept = [f for f in kept if f.name not in refused]
            for fit in evaluation.fits:
                if fit.name in refused:
                    answer.failed[fit.name] = refused[fit.name]
                    kinds[Shortfall.INFLIGHT.value] = kinds.get(Shortfall.INFLIGHT.value, 0) + 1
        answer.passed = [f.name for f in kept]
        for rejection in evaluation.rejections:
            (answer.unresolvable if rejection.unresolvable else answer.failed)[rejection.node] = (
                rejection.reason
            )
            kinds[rejection.shortfall.value] = kinds.get(rejection.shortfall.value, 0) + 1
        self.metrics.count_rejections(kinds)
        self.metrics.pods_filtered.labels("feasible" if kept else "infeasible").inc()
        if uid:
            # kept[i] is the fit of passed[i]: prioritize scores them without looking up names.
            self._filtered[uid] = (answer.passed, kept)
            self._filtered.move_to_end(uid)
            if len(self._filtered) > REMEMBERED_FILTERS:
                self._filtered.popitem(last=False)
        return answer

    def _inflight_conflict(self, fit: NodeFit, request: PodRequest, uid: str, now: datetime) -> str | None:
        allocation = to_allocation(fit.node, fit.placement, (c.name for c in request.containers))
        others = self.state.inflight_on(fit.name, now, self.inflight_timeout, exclude_uid=uid)
        return inflight_conflict(allocation, others) if others else None

    # ----------------------------------------------------------------------------------------------
    # prioritize

    def prioritize(self, pod: JsonObject, names: Sequence[str]) -> list[tuple[str, int]]:
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        remembered = self._filtered.get(uid)
        if remembered is not None and remembered[0] == names:
            # The usual call: the survivors of this pod's filter, in the same order.
            return list(zip(names, score_fits(remembered[1]), strict=True))
        try:
            request = parse_pod_request(pod, self.keys)
        except ContractError:
            return [(n, 0) for n in names]
        if not request.wants_gpu:
            return [(n, 0) for n in names]
        with self.state.lock:
            fits = self.state.engine.evaluate(shape_of(request), names).fits
        scores = dict(zip((f.name for f in fits), score_fits(fits), strict=True))
        return [(n, scores.get(n, 0)) for n in names]

    # ----------------------------------------------------------------------------------------------
    # bind

    def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Place and bind the pod on ``node``; returns "" on success, else the error for kube-scheduler."""
        error = "no attempt made"
        for _ in range(BIND_ATTEMPTS):
            error, retry = self._bind_once(namespace, name, uid, node)
            if not retry:
                break
        self.metrics.binds.labels("bound" if not error else "failed").inc()
        if error:
            log.info("bind %s/%s on %s refused: %s", namespace, name, node, error)
        return error

    def _bind_once(self, namespace: str, name: str, uid: str, node: str) -> tuple[str, bool]:
        """(error, worth retrying at once)."""
        assert self.kube is not None, "bind needs the Kubernetes API"
        key = f"{namespace}/{name}"
        try:
            pod = self.kube.get_pod(namespace, name)
        except ApiError as e:
            return self._fail("api", f"pod {key}: cannot read it: {e}"), False
        metadata = pod.get("metadata") or {}
        if uid and metadata.get("uid") != uid:
            return self._fail("gone", f"pod {key} is now UID {metadata.get('uid')}, not {uid}"), False
        annotations = metadata.get("annotations") or {}
        current = self._current_allocation(annotations, key)
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to:
            if bound_to == node and current is not None and current.node == node:
                return "", False
            return self._fail("bound", f"pod {key} is already bound to node {bound_to}"), False
        try:
            request = parse_pod_request(pod, self.keys)
        except ContractError as e:
            return self._fail("invalid", f"pod {key}: {e}"), False
        now = self.clock()
        # An allocation left on the pod by an earlier attempt holds nothing (the pod is not bound):
        # decide afresh against the current state.
        decided = self._decide(pod, request, node, now)
        if isinstance(decided, str):
            return decided, False
        allocation = decided
        record_patch: JsonObject = {
            "metadata": {
                "resourceVersion": metadata.get("resourceVersion"),
                "annotations": {
                    self.keys.allocation: allocation.model_dump_json(),
                    self.keys.allocation_phase: Phase.ALLOCATING.value,
                    self.keys.bind_time: format_time(now),
                },
            }
        }
        try:
            self.kube.patch_pod(namespace, name, record_patch)
        except ApiError as e:
            self.state.forget(str(metadata.get("uid")), allocation)
            if e.status == 409:
                return self._fail("conflict", f"pod {key} changed while binding: {e.message}"), True
            return self._fail("api", f"pod {key}: cannot write the allocation: {e}"), False
        try:
            self.kube.bind_pod(namespace, name, str(metadata.get("uid")), node)
        except ApiError as e:
            if self._bound_to(namespace, name) == node:
                return "", False  # the binding went through (an earlier attempt, or a lost answer)
            self._roll_back(namespace, name, str(metadata.get("uid")), allocation)
            return self._fail("api", f"pod {key}: binding to {node} failed: {e}"), False
        with self.state.lock:
            self.state.engine.context.shape_mix.record(shape_of(request))
        return "", False

    def _decide(self, pod: JsonObject, request: PodRequest, node: str, now: datetime) -> Allocation | str:
        """The allocation on ``node`` against the current state, assumed at once; or the error."""
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid"))
        key = pod_key(pod)
        with self.state.lock:
            evaluation = self.state.engine.evaluate(shape_of(request), [node])
            if not evaluation.fits:
                reason = evaluation.rejections[0].reason
                return self._fail("no_fit", f"pod {key} no longer fits on node {node}: {reason}")
            fit = evaluation.fits[0]
            allocation = to_allocation(fit.node, fit.placement, (c.name for c in request.containers))
            others = self.state.inflight_on(node, now, self.inflight_timeout, exclude_uid=uid)
            conflict = inflight_conflict(allocation, others)
            if conflict is not None:
                return self._fail("inflight", conflict)
            self.state.assume(self._record(pod, allocation, now))
        return allocation

    def _record(self, pod: JsonObject, allocation: Allocation, now: datetime) -> PodAllocation:
        metadata = pod.get("metadata") or {}
        return PodAllocation(
            uid=str(metadata.get("uid")),
            namespace=str(metadata.get("namespace")),
            name=str(metadata.get("name")),
            allocation=allocation,
            phase=Phase.ALLOCATING.value,
            bind_time=now,
        )

    def _current_allocation(self, annotations: dict[str, str], key: str) -> Allocation | None:
        text = annotations.get(self.keys.allocation)
        if text is None:
            return None
        try:
            return parse_allocation(text, pod=key)
        except ContractError:
            return None

    def _bound_to(self, namespace: str, name: str) -> str | None:
        assert self.kube is not None
        try:
            node: str | None = (self.kube.get_pod(namespace, name).get("spec") or {}).get("nodeName")
        except ApiError:
            return None
        return node

    def _roll_back(self, namespace: str, name: str, uid: str, allocation: Allocation) -> None:
        self.state.forget(uid, allocation)
        assert self.kube is not None
        cleared: JsonObject = {
            "metadata": {
                "annotations": {
                    self.keys.allocation: None,
                    self.keys.allocation_phase: None,
                    self.keys.bind_time: None,
                }
            }
        }
        try:
            self.kube.patch_pod(namespace, name, cleared)
        except ApiError as e:
            # The next bind of this pod reuses or replaces the allocation; deletion releases it.
            log.warning(
                "pod %s/%s: could not remove the allocation after a failed bind: %s", namespace, name, e
            )

    def _fail(self, reason: str, message: str) -> str:
        self.metrics.bind_failures.labels(reason).inc()
        return message
