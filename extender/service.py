"""The extender's three verbs over the cluster state: filter, prioritize, bind.

Decisions come from :mod:`tessera.placement`; this module adds what only the extender does:
answering in kube-scheduler's terms, the in-flight rule, and the bind's writes to the API server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import compress
from operator import attrgetter, not_

from extender.budgets import Budget, parse_budgets
from extender.kube import PODS, ApiError, KubeApi
from extender.metrics import BindFailure, Metrics
from extender.podrecords import PodAllocation, preemption_facts
from extender.state import ClusterState
from extender.wire import Victims
from tessera.contract import (
    Allocation,
    ContractError,
    ContractKeys,
    JsonObject,
    Phase,
    PodRequest,
    PodShapeError,
    QosClass,
    dump_allocation,
    format_time,
    parse_allocation,
    parse_pod_request,
    pod_priority,
    pod_ref,
)
from tessera.inflight import read_bind_time
from tessera.placement import (
    NodeFit,
    NodeRejection,
    PodShape,
    QosThresholds,
    Shortfall,
    best_fits,
    qos_class,
    qos_lowered,
    score_fits,
    shape_of,
    to_allocation,
)
from tessera.placement.qos import QOS_LOWERED_REASON

log = logging.getLogger(__name__)


class NotSyncedError(RuntimeError):
    """The caches are not yet filled from the API server (just started): deciding now could give
    away capacity that pods already hold, so every verb refuses until they are."""


# The scheduler profile whose pods the extender binds (the chart's scheduler.name).
DEFAULT_SCHEDULER_NAME = "tessera-scheduler"
# Names of nodes the extender does not know answered per request with a reason; more are rejected
# by leaving them out (a filter body can carry millions of made-up names).
UNKNOWN_NAMES_ANSWERED = 100
# Reservations whose pod is still being checked (see Extender._reserve); past it none is made.
MAX_UNCHECKED_RESERVATIONS = 64
# Filter results kept for the prioritize call that follows (by pod UID).
REMEMBERED_FILTERS = 256
# Sets of victims a preempt call weighs, all its candidate nodes together, and at least per node:
# well within kube-scheduler's httpTimeout (docs/benchmarks.md, "Preemption: one call").
PREEMPT_SETS = 20_000
MIN_PREEMPT_SETS = 100
# Where preempt reads the PodDisruptionBudgets of every namespace.
DISRUPTION_BUDGETS = "/apis/policy/v1/poddisruptionbudgets"
# Attempts at writing the allocation when the pod changes under the bind (HTTP 409).
BIND_ATTEMPTS = 3
# A filter that no node passed, the in-flight rule refusing some, reads the pods of at most this many
# of those nodes, within this many seconds (kube-scheduler waits httpTimeout, 5 s by default, for an answer).
RECHECKED_NODES = 4
RECHECK_TIMEOUT = 2.0
_NAME = attrgetter("name")  # a C-level loop over thousands of fits
_NODE = attrgetter("node")
_REASON = attrgetter("reason")
_SHORTFALL = attrgetter("shortfall")
_UNRESOLVABLE = attrgetter("unresolvable")


@dataclass(frozen=True, slots=True)
class LeaderLease:
    """The Lease a kube-scheduler beside this extender leads by, and the pod they share."""

    namespace: str
    name: str
    pod: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why bind cannot place a pod on the node now: the failure metric's reason, and the message."""

    reason: BindFailure
    message: str


@dataclass(slots=True)
class FilterAnswer:
    passed: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    # The nodes the in-flight rule refused the pod on, best first.
    inflight_refused: list[str] = field(default_factory=list)
    # Nodes refused, by Shortfall (the metrics' counts).
    shortfalls: Counter[str] = field(default_factory=Counter)
    # A GPU pod whose request parsed: a placement decision (the metrics count those alone).
    placed: bool = True


@dataclass(frozen=True, slots=True)
class _Filtered:
    """A pod's last filter answer: the names passed, their fits in the same order."""

    passed: list[str]
    kept: list[NodeFit]
    pod: JsonObject  # as the filter body had it: bind decides from it while it reads the pod
    request: PodRequest  # parsed from ``pod``; bind keeps that decision only if the API's copy asks the same


def _namespace(pod: JsonObject) -> str:
    return str((pod.get("metadata") or {}).get("namespace") or "")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # called outside the server (tests, benchmarks): nothing to check with
        return None


def ref_of(pod: JsonObject) -> str:
    """The pod ref of a Pod object."""
    metadata = pod.get("metadata") or {}
    return pod_ref(str(metadata.get("namespace", "")), str(metadata.get("name", "")))


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
        inflight_wait: timedelta = timedelta(seconds=2),
        filter_keeps_best: bool = True,
        scheduler_names: AbstractSet[str] = frozenset({DEFAULT_SCHEDULER_NAME}),
        qos_thresholds: QosThresholds | None = None,
        leader: LeaderLease | None = None,
    ) -> None:
        self.state = state
        self.kube = kube
        self.keys = keys
        self.metrics = metrics
        self.inflight_timeout = inflight_timeout
        self.inflight_wait = inflight_wait
        self.clock = clock
        self.filter_keeps_best = filter_keeps_best
        # Bind binds only pods naming one of these in spec.schedulerName.
        self.scheduler_names = frozenset(scheduler_names)
        # A pod's QoS class, when its annotation names none, from its priority (docs/placement.md).
        self.qos_thresholds = qos_thresholds or QosThresholds()
        # Beside a kube-scheduler that elects a leader: bind only while it leads (see leads).
        self.leader = leader
        self._filtered: OrderedDict[str, _Filtered] = OrderedDict()
        # Background checks of reservations (see _reserve).
        self._checks: set[asyncio.Task[None]] = set()

    # ----------------------------------------------------------------------------------------------
    # filter

    def _require_synced(self) -> None:
        missing = self.state.unsynced()
        if missing:
            raise NotSyncedError(f"tessera extender is starting: caches not synced ({', '.join(missing)})")

    def candidates(self, names: Sequence[str]) -> Sequence[str]:
        """The names worth answering: every known node once, and the first
        ``UNKNOWN_NAMES_ANSWERED`` unknown ones (:meth:`ClusterState.candidates`)."""
        return self.state.candidates(names, UNKNOWN_NAMES_ANSWERED)

    def filter(self, pod: JsonObject, names: Sequence[str]) -> FilterAnswer:
        answer = self._filter(pod, names)
        self._count(answer)
        return answer

    def _count(self, answer: FilterAnswer) -> None:
        self.metrics.count_rejections(answer.shortfalls)
        if answer.placed:
            self.metrics.pods_filtered.labels("feasible" if answer.passed else "infeasible").inc()

    def _filter(self, pod: JsonObject, names: Sequence[str]) -> FilterAnswer:
        """:meth:`filter` without counting it in the metrics."""
        self._require_synced()
        names = self.candidates(names)
        try:
            request = parse_pod_request(pod, self.keys)
        except PodShapeError:
            raise  # no pod the API server stores: a malformed request (HTTP 400)
        except ContractError as e:
            # The pod itself is wrong: no node can take it, and kubectl describe should say why.
            return FilterAnswer(
                passed=[],
                unresolvable=dict.fromkeys(names, f"pod {ref_of(pod)}: {e}"),
                shortfalls=Counter({Shortfall.NODE: len(names)}),
                placed=False,
            )
        if not request.wants_gpu:
            return FilterAnswer(passed=list(names), placed=False)
        shape = self.shape(pod, request)
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        evaluation = self.state.evaluate(shape, names)
        # Nodes where other pods are in flight: the rule may refuse this pod there.
        inflight = self.state.nodes_with_inflight()
        answer = FilterAnswer(passed=[])
        now = self.clock()

        def vet(fit: NodeFit) -> NodeFit | None:
            """The fit to keep on an in-flight node (the cached one, or one joining the in-flight
            key), or None when the rule refuses the pod there for now (the reason is answered)."""
            kept_fit = self.state.keeping_inflight_rule(
                fit, shape, evaluation.policy, uid=uid, now=now, timeout=self.inflight_timeout
            )
            if isinstance(kept_fit, str):
                answer.failed[fit.name] = kept_fit
                answer.inflight_refused.append(fit.name)
                return None
            return kept_fit

        if self.filter_keeps_best:
            # Only the nodes with the top score: kube-scheduler's own scores break the tie, and one
            # node left means no prioritize call and no scoring at all (one round trip less per
            # pod). Only the candidates for the top are vetted by the in-flight rule.
            kept = best_fits(evaluation.fits, vet, suspects=inflight)
        else:
            kept = evaluation.fits
            names_kept = list(map(_NAME, kept)) if inflight else []
            checked = inflight & set(names_kept)
            if checked:
                # vet(fit) on the in-flight nodes, the others kept as they are, the refused (None)
                # dropped: C-level passes over thousands of fits.
                by_name = dict(zip(names_kept, kept, strict=True))
                adjusted = {name: vet(by_name[name]) for name in sorted(checked)}
                kept = list(filter(None, map(adjusted.get, names_kept, kept)))
        answer.passed = list(map(_NAME, kept))
        if not kept:
            self._explain(answer, evaluation.rejections)
        if uid:
            # kept[i] is the fit of passed[i]: prioritize scores them without looking up names.
            remembered = _Filtered(answer.passed, kept, pod, request)
            self._filtered[uid] = remembered
            self._filtered.move_to_end(uid)
            if len(self._filtered) > REMEMBERED_FILTERS:
                self._filtered.popitem(last=False)
            if len(kept) == 1:  # kube-scheduler binds without calling prioritize
                self._reserve(pod, remembered, kept[0])
        return answer

    async def filter_rechecked(self, pod: JsonObject, names: Sequence[str]) -> FilterAnswer:
        """:meth:`filter`; when no node passed and the in-flight rule refused some, their pods read
        from the API server, and the pod filtered again if any pod changed meanwhile.

        kube-scheduler retries a pod its extender refused on the next cluster event, and the event
        that frees a node (the device plugin marking the pod in flight there allocated) is often the
        one that brought the retry, ahead of this extender's watch. Refused on the watch's older view,
        the pod would wait for some unrelated event: minutes on a quiet cluster. A list is never
        older than kube-scheduler's informer (kube-apiserver serves it consistently).
        """
        answer = self._filter(pod, names)
        if (
            not answer.passed
            and answer.inflight_refused
            and self.kube is not None
            and await self._recheck(pod, answer.inflight_refused[:RECHECKED_NODES])
        ):
            answer = self._filter(pod, names)
        self._count(answer)
        return answer

    async def _recheck(self, pod: JsonObject, nodes: Sequence[str]) -> bool:
        """The pods of ``nodes`` read from the API server into the state; whether any pod's
        allocation or phase changed meanwhile (by this read, or by the watch while it waited)."""
        changes = self.state.changes.count
        try:
            async with asyncio.timeout(RECHECK_TIMEOUT):
                listed = await asyncio.gather(*map(self._node_pods, nodes))
        except (ApiError, TimeoutError) as e:
            log.info("filter of pod %s: cannot read the pods of %s: %s", ref_of(pod), ", ".join(nodes), e)
            self.metrics.filter_rechecks.labels("failed").inc()
            return False
        for node_pods in listed:
            self._catch_up(node_pods)
        changed = self.state.changes.count != changes
        self.metrics.filter_rechecks.labels("changed" if changed else "unchanged").inc()
        return changed

    def _explain(self, answer: FilterAnswer, rejections: list[NodeRejection]) -> None:
        """Every node's reason, for a pod no node can take now: kube-scheduler puts them in the
        FailedScheduling event (``kubectl describe pod``). When some node passes it drops them, so
        they are not made then (thousands of entries at thousands of nodes: a third of the cost of
        answering a pod that may run on one GPU model only)."""
        kinds = answer.shortfalls
        if answer.failed:
            kinds[Shortfall.INFLIGHT] = len(answer.failed)
        if rejections:
            # C-level passes over thousands of rejections.
            hopeless = list(map(_UNRESOLVABLE, rejections))
            unresolvable = list(compress(rejections, hopeless))
            failed = list(compress(rejections, map(not_, hopeless)))
            answer.unresolvable.update(zip(map(_NODE, unresolvable), map(_REASON, unresolvable), strict=True))
            answer.failed.update(zip(map(_NODE, failed), map(_REASON, failed), strict=True))
            kinds.update(map(_SHORTFALL, rejections))

    def _reserve(self, pod: JsonObject, remembered: _Filtered, fit: NodeFit) -> None:
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
            self.qos(pod, remembered.request),
        )
        metadata = pod.get("metadata") or {}
        now = self.clock()
        shape = self.shape(pod, remembered.request)
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
            task = asyncio.get_running_loop().create_task(self._check_reservation(record))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    async def _check_reservation(self, reserved: PodAllocation) -> None:
        """Drop ``reserved`` unless the API server has its pod, unbound, of a scheduler served
        here, asking the shape it was reserved for."""
        assert self.kube is not None
        try:
            pod = await self.kube.get_pod(reserved.namespace, reserved.name)
        except ApiError as e:
            if e.status == 404:
                self._drop(reserved.uid)
            return
        except Exception:  # the check is best effort: the reservation expires anyway
            log.exception("checking the reservation of pod %s", reserved.ref)
            return
        metadata = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        try:
            shape = self.shape(pod, parse_pod_request(pod, self.keys))
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
                self._drop(reserved.uid)

    # ----------------------------------------------------------------------------------------------
    # prioritize

    def prioritize(self, pod: JsonObject, names: Sequence[str]) -> list[int]:
        """The score of each of ``names``, in their order (see :meth:`candidates` for the names
        worth scoring)."""
        self._require_synced()
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        remembered = self._filtered.get(uid)
        if remembered is not None and remembered.passed == names:
            # The usual call: the survivors of this pod's filter, in the same order. The best of
            # them is where kube-scheduler will most likely bind the pod: reserve it there.
            scores = score_fits(remembered.kept)
            if scores:
                self._reserve(pod, remembered, remembered.kept[scores.index(max(scores))])
            return scores
        try:
            request = parse_pod_request(pod, self.keys)
        except PodShapeError:
            raise
        except ContractError:
            return [0] * len(names)
        if not request.wants_gpu:
            return [0] * len(names)
        fits = self.state.evaluate(self.shape(pod, request), names).fits
        by_name = dict(zip((f.name for f in fits), score_fits(fits), strict=True))
        return [by_name.get(n, 0) for n in names]

    # ----------------------------------------------------------------------------------------------
    # preempt

    async def preempt(self, pod: JsonObject, proposed: dict[str, Victims]) -> dict[str, Victims]:
        """kube-scheduler's victims per candidate node (``proposed``, chosen by its own view: CPU,
        memory, the slice count) answered with the victims that make the pod fit on the node's GPUs
        (docs/placement.md, "Preemption"). A node where no eviction of lower-priority pods makes
        room is left out; one where the pod fits on a GPU already keeps kube-scheduler's victims.

        The answer's victims on a node are the GPU pods :meth:`ClusterState.choose_victims` picks,
        then kube-scheduler's victims that hold no GPU share there (it chose them for CPU, memory
        or pod count, which only it judges)."""
        self._require_synced()
        try:
            request = parse_pod_request(pod, self.keys)
        except PodShapeError:
            raise
        except ContractError as e:
            log.info("preempt: pod %s: %s", ref_of(pod), e)
            self.metrics.preemption_nodes.labels("removed").inc(len(proposed))
            return {}
        if not request.wants_gpu:
            return proposed
        priority = pod_priority(pod)
        shape = self.shape(pod, request)
        budgets = await self._disruption_budgets()
        answer: dict[str, Victims] = {}
        # The call's sets shared among its nodes: kube-scheduler waits for the answer (httpTimeout).
        sets = max(MIN_PREEMPT_SETS, PREEMPT_SETS // max(1, len(proposed)))
        for name, theirs in proposed.items():
            decided = self.state.choose_victims(name, shape, priority, budgets, sets)
            if isinstance(decided, str):
                log.debug("preempt: pod %s: node %s left out: %s", ref_of(pod), name, decided)
                self.metrics.preemption_nodes.labels("removed").inc()
                continue
            if not decided.victims:
                if theirs.uids:  # the pod fits on a GPU already: kube-scheduler's victims stand
                    answer[name] = theirs
                    self.metrics.preemption_nodes.labels("kept").inc()
                else:
                    self.metrics.preemption_nodes.labels("removed").inc()
                continue
            on_gpus = {p.uid for p in self.state.pods_on(name)}
            others = tuple(uid for uid in theirs.uids if uid not in on_gpus)
            answer[name] = Victims(
                tuple(v.uid for v in decided.victims) + others,
                # kube-scheduler's count covers its own victims: at most all of the others break one.
                decided.budget_violations + min(theirs.budget_violations, len(others)),
            )
            self.metrics.preemption_nodes.labels("victims").inc()
            self.metrics.preemption_victims.inc(len(decided.victims))
        log.info(
            "preempt: pod %s: %d of %d candidate nodes answered (the others: no eviction makes room)",
            ref_of(pod),
            len(answer),
            len(proposed),
        )
        return answer

    async def _disruption_budgets(self) -> list[Budget]:
        """The cluster's PodDisruptionBudgets, read afresh: preemption is rare, and a budget's
        disruptions allowed change with every pod its controller sees."""
        if self.kube is None:
            return []
        items, _ = await self.kube.list(DISRUPTION_BUDGETS)
        return parse_budgets(items)

    # ----------------------------------------------------------------------------------------------
    # bind

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Place and bind the pod on ``node``; returns "" on success, else the error for kube-scheduler.

        Bound as the API server has the pod, read afresh: whoever calls bind names a pod, and
        nothing in a filter body (which anyone could have sent) decides what it gets.
        """
        self._require_synced()
        error = "no attempt made"
        # First decided from the copy sent to filter while the pod is read, kept only if the API's
        # copy asks the same; after a conflict, decided from the API's copy alone.
        remembered = self._filtered.get(uid)
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
        self, namespace: str, name: str, uid: str, node: str, remembered: _Filtered | None
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
        assert self.kube is not None, "bind needs the Kubernetes API"
        ref = pod_ref(namespace, name)
        leading = asyncio.ensure_future(self.leads())
        reading = asyncio.ensure_future(self.kube.get_pod(namespace, name))
        listing = asyncio.ensure_future(self._node_pods(node))
        early: Allocation | None = None
        now = self.clock()
        if remembered is not None:
            decided_early = self.decide(remembered.pod, remembered.request, node, now)
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
                self._drop(uid)  # its reservation holds capacity for nobody
            return self._fail("gone" if e.status == 404 else "api", f"pod {ref}: cannot read it: {e}"), False
        except BaseException:
            self._undo(uid, early)
            reading.cancel()
            listing.cancel()
            raise
        if not_leading:
            self._undo(uid, early)
            return self._fail("not_leader", f"pod {ref}: {not_leading}"), False
        if self._catch_up(node_pods):
            # Pods on the node that the watch had not shown yet: the early decision did not see them.
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
            self._drop(uid)
            return self._fail("invalid", f"pod {ref}: {e}"), False
        metadata = pod.get("metadata") or {}
        pod_uid = str(metadata.get("uid") or uid)
        decided: Allocation | Refusal
        if early is not None and remembered is not None and remembered.request == request:
            decided = early
        else:
            self._undo(pod_uid, early)
            reserved = self.state.reservation(pod_uid)
            if reserved is not None and reserved.shape != self.shape(pod, request):
                # A reservation made from a filter body asking something else than the pod does.
                self.state.unreserve(pod_uid)
            now = self.clock()
            decided = await self._decide_waiting(pod, request, node, now)
        if isinstance(decided, Refusal):
            return self._fail(decided.reason, decided.message), False
        annotations = {
            self.keys.allocation: dump_allocation(decided),
            self.keys.allocation_phase: Phase.ALLOCATING.value,
            self.keys.bind_time: format_time(now),
        }
        try:
            await self.kube.bind_pod(
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
        self._filtered.pop(pod_uid, None)
        self.state.placed(self.shape(pod, request))
        await self._tell_lowered_class(pod, request)
        if any(g.oversubscribed for c in decided.containers for g in c.gpus):
            self.metrics.oversubscribed_binds.inc()
        return "", False

    async def leads(self) -> str:
        """ "" while this extender's kube-scheduler holds its leader Lease (or none is configured),
        else why not. A kube-scheduler that lost or released the Lease (its pod deleted: it releases
        on the way out) may still have binds in flight, decided by this extender's state while the
        new leader's extender decides by its own: two deciders on one node could break the in-flight
        rule or overcommit a GPU, so only the leader's binds go through."""
        if self.leader is None:
            return ""
        assert self.kube is not None
        try:
            lease = await self.kube.get_lease(self.leader.namespace, self.leader.name)
        except ApiError as e:
            # Not the pod's error: its reservation stays, and kube-scheduler retries the bind.
            return f"cannot read the lease {self.leader.namespace}/{self.leader.name}: {e}"
        holder = str((lease.get("spec") or {}).get("holderIdentity") or "")
        # kube-scheduler's identity is "<hostname>_<uuid>"; in a pod the hostname is the pod's name.
        if holder.split("_", 1)[0] == self.leader.pod:
            return ""
        return (
            f"this extender's scheduler ({self.leader.pod}) does not hold the lease "
            f"{self.leader.namespace}/{self.leader.name} (held by {holder or 'nobody'}); the leader binds"
        )

    async def _node_pods(self, node: str) -> list[JsonObject]:
        """The pods bound to ``node`` as the API server lists them; none for a node this extender
        does not know (bind refuses it anyway, and its name goes into no query)."""
        assert self.kube is not None
        if not self.state.knows_node(node):
            return []
        items, _ = await self.kube.list(PODS, field_selector=f"spec.nodeName={node}")
        return items

    def _catch_up(self, node_pods: Sequence[JsonObject]) -> bool:
        """The node's pods as the API server lists them now, into the state before bind or filter
        decides; whether any was new to it. This extender's watch may lag the API: after a failover,
        the pods the previous leader bound a moment ago, whose allocations the in-flight rule and
        the capacity must count; a pod the device plugin has just served. A list is never older
        than the watch when it is served (kube-apiserver serves it consistently), but the watch may
        show a deletion or a newer version before the list is applied: those it does not undo
        (ClusterState.upsert_read_pod)."""
        new = False
        for pod in node_pods:
            uid = str((pod.get("metadata") or {}).get("uid"))
            known = self.state.counts(uid)
            new |= self.state.upsert_read_pod(pod) and not known and self.state.counts(uid)
        return new

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
            self._drop(uid)
            served = ", ".join(sorted(self.scheduler_names))
            return self._fail(
                "scheduler",
                f"pod {ref_of(pod)} names scheduler {scheduler!r}; this extender binds for {served}",
            )
        return None

    def _drop(self, uid: str) -> None:
        """Forget a pod that will not be bound here: its filter answer and its reservation."""
        if uid:
            self._filtered.pop(uid, None)
            self.state.unreserve(uid)

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
            self.state.assume(self._record(pod, current, bind_time or self.clock()))
            self.state.bind_answered(uid)
            return ""
        return self._fail("bound", f"pod {ref} is already bound to node {bound_to}")

    async def _decide_waiting(
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

    def decide(self, pod: JsonObject, request: PodRequest, node: str, now: datetime) -> Allocation | Refusal:
        """Bind's in-memory half: the allocation on ``node`` against the current state, assumed at
        once; or why not."""
        uid = str((pod.get("metadata") or {}).get("uid"))
        ref = ref_of(pod)
        shape = self.shape(pod, request)
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
            fit.node, fit.placement, [c.name for c in request.containers], self.qos(pod, request)
        )
        self.state.assume(self._record(pod, allocation, now))
        return allocation

    def shape(self, pod: JsonObject, request: PodRequest) -> PodShape:
        """The pod's shape for placement. With usage-aware placement on (``--best-effort-oversubscription``)
        it carries the pod's class, and a best-effort pod may be placed against measured use; off,
        every shape is standard's (the class changes nothing else in placement), so rejections say
        nothing of measured use and shapes of all classes share their cached outcomes."""
        if self.state.usage_rule is None:
            return shape_of(request)
        return shape_of(request, self.qos(pod, request))

    def qos(self, pod: JsonObject, request: PodRequest) -> QosClass:
        """The pod's QoS class, written into its allocation: granted by its priority (or its
        namespace), lowered by its annotation (tessera.placement.qos)."""
        return qos_class(request.preferences.qos, pod_priority(pod), self.qos_thresholds, _namespace(pod))

    async def _tell_lowered_class(self, pod: JsonObject, request: PodRequest) -> None:
        """A Warning event on a pod bound with a lower class than its annotation asked for."""
        assert self.kube is not None
        why = qos_lowered(request.preferences.qos, pod_priority(pod), self.qos_thresholds, _namespace(pod))
        if not why:
            return
        try:
            await self.kube.create_event(pod, reason=QOS_LOWERED_REASON, message=why, warning=True)
        except ApiError as e:
            name = str((pod.get("metadata") or {}).get("name") or "")
            log.warning(
                "pod %s: cannot record that its class was lowered: %s", pod_ref(_namespace(pod), name), e
            )

    def _record(self, pod: JsonObject, allocation: Allocation, now: datetime) -> PodAllocation:
        metadata = pod.get("metadata") or {}
        return PodAllocation(
            uid=str(metadata.get("uid")),
            namespace=str(metadata.get("namespace")),
            name=str(metadata.get("name")),
            allocation=allocation,
            phase=Phase.ALLOCATING.value,
            bind_time=now,
            **preemption_facts(pod),
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
