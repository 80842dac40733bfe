"""What the extender knows about the cluster, built only from Node and Pod objects (dicts).

* Nodes: the device plugin's inventory annotation (``KEYS.node_gpus``) and heartbeat
  (``KEYS.node_heartbeat``). A node whose heartbeat is missing or older than the timeout stays in
  the placement engine as unschedulable, with the reason, so pods are told why.
* Nodes' measured GPU use (``KEYS.node_gpu_usage``), read only with a :class:`UsageRule` (the flag
  ``--best-effort-oversubscription``): best-effort pods may then be placed against it
  (docs/placement.md, "Usage-aware placement of best-effort pods"). A measurement that holds as of
  neither its own time nor the node's heartbeat within the rule's max age, or is unreadable (logged,
  naming the node and the field), allows nothing against use on its node; the sweep re-judges its
  age as it does heartbeats'.
* Pods: allocation annotations (``KEYS.allocation``) of pods bound and not finished, with their
  phase and bind time. An allocation decided at bind is *assumed* at once, before the API server
  echoes it back through the watch, so the next pod never sees the capacity as free; the assumption
  ends when the watch shows the pod bound, when the pod goes, or when the bind fails. An
  allocation on a pod that is not bound holds nothing. A *reservation* is an assumption made at
  filter, for a short time (see :meth:`ClusterState.reserve`).

Every change rebuilds only the node concerned (``tessera.placement.build_node``) and hands it to the
placement engine, which the state owns: the verbs ask it through :meth:`ClusterState.evaluate`,
:meth:`ClusterState.keeping_inflight_rule` and :meth:`ClusterState.placed`. Not thread-safe, by
design: the extender's event loop owns it (watches, the heartbeat sweep and the HTTP handlers are
all tasks on that one loop).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypedDict

from extender.budgets import Budget, covering
from tessera.contract import (
    Allocation,
    ContainerAllocation,
    ContractError,
    ContractKeys,
    GpuInfo,
    JsonObject,
    NodeGpuUsage,
    PodShapeError,
    parse_allocation,
    parse_gpu_usage,
    parse_inventory,
    parse_time,
    pod_priority,
    pod_ref,
)
from tessera.inflight import InflightKey, allocation_keys, is_allocating, read_bind_time, stale
from tessera.placement import (
    Evaluation,
    NodeFit,
    NodeState,
    PlacementEngine,
    PlacementPolicy,
    PodShape,
    Preemption,
    UsageRule,
    Victim,
    apply,
    build_node,
    choose_victims,
    fit_keeping_inflight_rule,
    placed_since,
    placement_of,
)
from tessera.placement.engine import UNKNOWN_NODE

log = logging.getLogger(__name__)

TERMINAL_POD_PHASES = ("Succeeded", "Failed")
# In-flight rule answers kept per node (until its state or its pods in flight change).
REMEMBERED_VETTINGS = 256
# UIDs of pods the API server has shown gone, kept so that a read answered before the deletion but
# applied after it cannot bring the pod back (a UID is never reused). A read is applied within
# seconds of being served; this many deletions take far longer on any cluster.
REMEMBERED_GONE = 65536


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """A pod's allocation as annotated (or assumed at bind)."""

    uid: str
    namespace: str
    name: str
    allocation: Allocation
    phase: str | None
    bind_time: datetime | None
    # What preemption weighs (tessera.placement.preemption): its priority, its labels (for the
    # disruption budgets covering it), and whether it is being deleted already.
    priority: int = 0
    labels: tuple[tuple[str, str], ...] = ()
    terminating: bool = False
    # A reservation's: the shape it was made for (bind keeps it only for a pod asking the same).
    shape: PodShape | None = field(default=None, compare=False, repr=False)
    # The in-flight rule's container keys, computed once.
    keys: tuple[InflightKey, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(allocation_keys(self.allocation)))

    @property
    def ref(self) -> str:
        return pod_ref(self.namespace, self.name)


class PreemptionFacts(TypedDict):
    priority: int
    labels: tuple[tuple[str, str], ...]
    terminating: bool


def preemption_facts(pod: JsonObject) -> PreemptionFacts:
    """What preemption needs of a pod the API server stores: its priority, labels and deletion."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    try:
        priority = pod_priority(pod)
    except PodShapeError:
        priority = 0  # never from the API server, which admits integers only
    return PreemptionFacts(
        priority=priority,
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        terminating=metadata.get("deletionTimestamp") is not None,
    )


@dataclass(frozen=True, slots=True)
class InflightPods:
    """The pods in flight on a node, as of some moment: container keys and names by pod UID. The
    same until one of them times out (``until``) or the node's pods change."""

    keys: dict[str, tuple[InflightKey, ...]]  # by pod ref ("namespace/name")
    names: dict[str, str]  # pod refs by pod UID
    timeout: timedelta
    until: datetime | None

    def without(self, uid: str) -> dict[str, tuple[InflightKey, ...]]:
        """The keys of the pods other than ``uid``."""
        name = self.names.get(uid)
        if name is None:
            return self.keys
        return {pod: keys for pod, keys in self.keys.items() if pod != name}


@dataclass(slots=True)
class _Node:
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


@dataclass(slots=True)
class _Pod:
    """What the state knows of one pod: the API server's word, and the extender's own decision
    until the API server shows it."""

    observed: PodAllocation | None = None  # as last listed or watched (bound, not finished)
    assumed: PodAllocation | None = None  # decided here (a bind or a reservation), not yet seen
    reserved_at: datetime | None = None  # when ``assumed`` is a reservation: when it was made
    # The resourceVersion of ``observed`` (None when it is not an integer): a read (list or get)
    # older than what the watch has shown is not applied.
    version: int | None = None
    # For a bind decision (``assumed`` and not reserved): the mark (ClusterState.mark) taken when the
    # bind's answer came, None while the bind is on its way. A relist begun before it may not show
    # the pod bound yet.
    answered: int | None = None

    @property
    def counted(self) -> PodAllocation | None:
        """What counts on the node: the decision, else the API server's word."""
        return self.assumed if self.assumed is not None else self.observed

    def nodes(self) -> set[str]:
        """The nodes named by either allocation."""
        return {p.allocation.node for p in (self.assumed, self.observed) if p is not None}


# (shape, policy name, context version or -1, the UID left out of the pods in flight or "")
_Question = tuple[PodShape, str, int, str]


@dataclass(slots=True)
class _Inflight:
    """The pods in flight on one node (phase allocating, or reserved: their bind is on its way), and
    what follows from them: made anew whenever the node's pods or its state change."""

    pods: list[PodAllocation]
    # As of the last question (see ClusterState.inflight_pods), until one of them times out.
    current: InflightPods | None = None
    # The in-flight rule's answers for ``current`` (see ClusterState.keeping_inflight_rule).
    vetted: dict[_Question, NodeFit | str] = field(default_factory=dict)


class ClusterState:
    def __init__(
        self,
        engine: PlacementEngine,
        keys: ContractKeys,
        heartbeat_timeout: timedelta,
        reservation_ttl: timedelta = timedelta(seconds=10),
        usage_rule: UsageRule | None = None,
    ) -> None:
        """``usage_rule``: read the nodes' measured GPU use and trust it this far (None: never place
        against measured use)."""
        self.engine = engine
        self.keys = keys
        self.heartbeat_timeout = heartbeat_timeout
        self.reservation_ttl = reservation_ttl
        self.usage_rule = usage_rule
        # Called whenever a pod's allocation or phase changes (a bind waiting on the in-flight rule).
        self.on_pods_changed: Callable[[], None] | None = None
        # How many times that happened: what was decided before an await may be outdated after it.
        self.pod_changes = 0
        self._nodes: dict[str, _Node] = {}
        self._pods: dict[str, _Pod] = {}  # by UID: every pod that counts or is remembered
        # Indexes kept by _reindex alone: the UIDs of the pods counted on each node, and each node's
        # pods in flight.
        self._pods_on: dict[str, set[str]] = {}
        self._inflight: dict[str, _Inflight] = {}
        # Live resizes being written, by pod UID: counted with the pod's allocation, each grant at
        # the larger of the two, until the API server shows the pod with it (see resizing).
        self._resizes: dict[str, Allocation] = {}
        # Pods shown gone (REMEMBERED_GONE), oldest first.
        self._gone: OrderedDict[str, None] = OrderedDict()
        # A counter ordering relists and binds' answers (see replace_pods).
        self._marks = 0
        self.nodes_synced = False
        self.pods_synced = False

    def unsynced(self) -> list[str]:
        """The caches not yet filled by a first list: "nodes", "pods"."""
        return [what for what, done in (("nodes", self.nodes_synced), ("pods", self.pods_synced)) if not done]

    # ----------------------------------------------------------------------------------------------
    # What the verbs ask of the placement engine

    def node_count(self) -> int:
        """Nodes with a GPU inventory (readable or not)."""
        return len(self.engine.nodes)

    def candidates(self, names: Sequence[str], unknown_kept: int) -> Sequence[str]:
        """``names`` to evaluate: all of them when they cannot all be distinct known nodes' (no more
        names than nodes: kube-scheduler's lists, checked for free); else each known node once and
        the first ``unknown_kept`` unknown names (answered "unknown node"), the rest left out of the
        answer, which rejects them as surely. A list of a million made-up names costs one pass."""
        nodes = self.engine.nodes
        if len(names) <= len(nodes):
            return names
        kept: list[str] = []
        unknown = 0
        for name in dict.fromkeys(names):
            if name in nodes:
                kept.append(name)
            elif unknown < unknown_kept:
                unknown += 1
                kept.append(name)
        return kept

    def evaluate(self, shape: PodShape, names: Iterable[str]) -> Evaluation:
        """The outcome of ``shape`` on the nodes ``names``, in their order."""
        return self.engine.evaluate(shape, names)

    def keeping_inflight_rule(
        self,
        fit: NodeFit,
        shape: PodShape,
        policy: PlacementPolicy,
        *,
        uid: str,
        now: datetime,
        timeout: timedelta,
    ) -> NodeFit | str:
        """``fit`` (of ``shape`` under ``policy``, from :meth:`evaluate` on the current state) if pod
        ``uid`` may be in flight on its node with the pods in flight there at ``now``; else the fit
        there that joins their in-flight key; else why not (the in-flight rule).

        While a node's pods stay in flight, every pod of a shape asks the same question there: the
        answers are kept with the node's pods in flight, which are made anew when they change, when
        one of them times out, or when the node's state changes.
        """
        pods = self.inflight_pods(fit.name, now, timeout)
        others = pods.without(uid)
        if not others:
            return fit
        entry = self._inflight[fit.name]
        version = self.engine.context.version if policy.uses_context else -1
        question = (shape, policy.name, version, uid if uid in pods.names else "")
        known = entry.vetted.get(question)
        if known is not None:
            return known
        answer = fit_keeping_inflight_rule(
            fit,
            shape,
            profiles=self.engine.profiles,
            policy=policy,
            context=self.engine.context,
            inflight=others,
        )
        if len(entry.vetted) >= REMEMBERED_VETTINGS:
            entry.vetted.clear()  # not an LRU: hits stay free, and a refill is cheap
        entry.vetted[question] = answer
        return answer

    def choose_victims(
        self, name: str, shape: PodShape, priority: int, budgets: Sequence[Budget], max_sets: int
    ) -> Preemption | str:
        """The pods on node ``name`` whose eviction makes a pod of ``shape`` and ``priority`` fit there
        (:func:`tessera.placement.choose_victims`), among its bound pods not being deleted already
        (reservations are no pods kube-scheduler could evict), weighing at most ``max_sets`` sets;
        or why no eviction can."""
        node = self.engine.nodes.get(name)
        if node is None:
            return UNKNOWN_NODE
        candidates = []
        for pod in self.pods_on(name):
            if pod.terminating or self._pods[pod.uid].reserved_at is not None:
                continue
            try:
                placement = placement_of(node, pod.allocation)
            except ValueError:
                continue  # it names a GPU gone from the inventory: not one to weigh
            budgets_covering = covering(budgets, pod.namespace, pod.name, dict(pod.labels))
            candidates.append(Victim(pod.uid, pod.priority, placement, budgets_covering, pod.bind_time))
        return choose_victims(
            node,
            shape,
            priority,
            candidates,
            [budget.disruptions_allowed for budget in budgets],
            profiles=self.engine.profiles,
            policy=self.engine.policy_for(shape),
            context=self.engine.context,
            max_sets=max_sets,
        )

    def placed(self, shape: PodShape) -> None:
        """A pod of ``shape`` was bound (its allocation already counts: it was assumed first)."""
        self.engine.commit(shape)

    # ----------------------------------------------------------------------------------------------
    # Nodes

    def upsert_node(self, node: JsonObject, now: datetime) -> None:
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
            self.engine.remove_node(name)
            return
        record = _Node(inventory, inventory_error, heartbeat, heartbeat_error)
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
        self._rebuild(name)

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

    def _usage_fresh(self, record: _Node, now: datetime) -> bool:
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

    def delete_node(self, name: str) -> None:
        self._nodes.pop(name, None)
        self.engine.remove_node(name)

    def replace_nodes(self, nodes: Iterable[JsonObject], now: datetime) -> None:
        """After a (re)list: exactly these nodes exist."""
        seen = set()
        for node in nodes:
            seen.add(str(node["metadata"]["name"]))
            self.upsert_node(node, now)
        for name in set(self._nodes) - seen:
            self.delete_node(name)
        self.nodes_synced = True

    def _staleness(self, record: _Node, now: datetime) -> str | None:
        if record.heartbeat_error is not None:
            return record.heartbeat_error
        if record.heartbeat is None:
            return f"no heartbeat from the Tessera device plugin (annotation {self.keys.node_heartbeat})"
        age = now - record.heartbeat
        if age > self.heartbeat_timeout:
            return (
                f"Tessera device plugin heartbeat is {int(age.total_seconds())} s old "
                f"(timeout {int(self.heartbeat_timeout.total_seconds())} s)"
            )
        return None

    def sweep_heartbeats(self, now: datetime) -> list[str]:
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
                self._rebuild(name)
        return changed

    # ----------------------------------------------------------------------------------------------
    # Pods

    def _parse_pod(self, pod: JsonObject) -> PodAllocation | None:
        metadata = pod.get("metadata") or {}
        annotations = metadata.get("annotations") or {}
        text = annotations.get(self.keys.allocation)
        if text is None or (pod.get("status") or {}).get("phase") in TERMINAL_POD_PHASES:
            return None
        if not (pod.get("spec") or {}).get("nodeName"):
            # Not bound: it holds nothing (the extender writes allocations with the binding; one
            # on an unbound pod was written by someone else, or is left from an older scheme).
            return None
        ref = pod_ref(str(metadata.get("namespace")), str(metadata.get("name")))
        try:
            allocation = parse_allocation(text, pod=ref)
        except ContractError as e:
            log.warning("ignoring %s", e)
            return None
        try:
            bind_time = read_bind_time(annotations, self.keys, pod=ref)
        except ContractError as e:
            log.warning("%s", e)  # not in flight: the rule has no time to count from
            bind_time = None
        return PodAllocation(
            uid=str(metadata.get("uid")),
            namespace=str(metadata.get("namespace")),
            name=str(metadata.get("name")),
            allocation=allocation,
            phase=annotations.get(self.keys.allocation_phase),
            bind_time=bind_time,
            **preemption_facts(pod),
        )

    def upsert_pod(self, pod: JsonObject) -> None:
        """The pod as the watch (or a relist) shows it."""
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid"))
        if uid in self._gone:
            return  # a UID never comes back: an event about a pod after its deletion is late news
        parsed = self._parse_pod(pod)
        resized = self._resizes.get(uid)
        if resized is not None and (parsed is None or parsed.allocation == resized):
            self._end_resize(uid)  # written (or the pod is gone): the API server's word holds
        record = self._pods.get(uid)
        if record is None:
            if parsed is None:
                return  # holds nothing, and never did
            record = self._pods[uid] = _Pod()
        record.version = _version(metadata)
        if record.assumed is None and record.observed == parsed:
            return  # nothing that counts changed (most pod events: status, other annotations)
        assumed = record.assumed
        if (
            parsed is not None
            and assumed is not None
            and record.reserved_at is None
            and (parsed.allocation, parsed.phase) == (assumed.allocation, assumed.phase)
        ):
            # The watch echoing a bind: the node's usage is the same; only the record (and its
            # bind time, to the second) comes from the API server now.
            record.observed = parsed
            record.assumed = None
            record.answered = None
            self._refresh_inflight(parsed.allocation.node)
            return
        touched = record.nodes()
        record.observed = parsed
        if parsed is not None:
            # Bound with the assumed allocation, or moved on by someone else (device plugin): the
            # API server's word now holds.
            record.assumed = None
            record.reserved_at = None
            record.answered = None
        self._reindex(uid, touched)

    def upsert_read_pod(self, pod: JsonObject) -> bool:
        """The pod as a read of the API server (a list or a get, not the watch) shows it; whether it
        was applied.

        The read may answer before, and be applied after, watch events that came later: the pod's
        deletion (the read would bring back a pod that no event will ever remove again) or a newer
        version (its phase moved on). Such a read is not applied.
        """
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid"))
        if uid in self._gone:
            return False
        record = self._pods.get(uid)
        read = _version(metadata)
        if record is not None and record.version is not None and read is not None and read < record.version:
            return False
        self.upsert_pod(pod)
        return True

    def delete_pod(self, uid: str) -> None:
        """The pod is gone from the API server (for good: UIDs are not reused)."""
        self._gone[uid] = None
        if len(self._gone) > REMEMBERED_GONE:
            self._gone.popitem(last=False)
        self._end_resize(uid)
        record = self._pods.get(uid)
        if record is None:
            return
        touched = record.nodes()
        record.observed = record.assumed = record.reserved_at = None
        self._reindex(uid, touched)

    def mark(self) -> int:
        """A new mark: marks order relists (taken as a list is requested) and binds' answers."""
        self._marks += 1
        return self._marks

    def replace_pods(self, pods: Iterable[JsonObject], listed: int | None = None) -> None:
        """After a (re)list requested at mark ``listed`` (None: the list is newer than every bind's
        answer): exactly these pods exist, but for binds the list may not show yet (answered after
        it was requested, or not yet), whose assumptions stay; assumptions for pods still there are
        kept too."""
        seen = set()
        for pod in pods:
            seen.add(str((pod.get("metadata") or {}).get("uid")))
            self.upsert_pod(pod)
        for uid in set(self._pods) - seen:
            record = self._pods[uid]
            binding = record.assumed is not None and record.reserved_at is None
            if binding and listed is not None and (record.answered is None or record.answered > listed):
                continue
            self._forget_unlisted(uid)
        self.pods_synced = True

    def _forget_unlisted(self, uid: str) -> None:
        """A pod a relist does not show: gone, or never bound (a reservation), or not counted."""
        record = self._pods[uid]
        if record.observed is not None or record.reserved_at is None:
            self.delete_pod(uid)
        else:
            self.unreserve(uid)  # a pod not bound yet may still be: not gone for good

    def assume(self, decided: PodAllocation) -> None:
        """Count ``decided`` now (decided at bind, not yet seen through the watch)."""
        record = self._pods.setdefault(decided.uid, _Pod())
        touched = record.nodes()
        record.assumed = decided
        record.reserved_at = None
        record.answered = None
        self._reindex(decided.uid, touched)

    def bind_answered(self, uid: str) -> None:
        """The bind of ``uid`` got its answer (success: the pod's assumption waits for the watch)."""
        record = self._pods.get(uid)
        if record is not None and record.assumed is not None and record.reserved_at is None:
            record.answered = self.mark()

    def reserve(self, reserved: PodAllocation, now: datetime, fit: NodeFit | None = None) -> None:
        """Count ``reserved`` for a pod kube-scheduler is about to bind (it was scored best), until
        its bind decides for real or ``reservation_ttl`` passes. ``fit`` is the fit it was made from.

        kube-scheduler filters the next pod before the previous one's bind arrives; without the
        reservation, pods of one shape would all pick the node the previous pod is filling, and
        all but one would fail at bind when it fills up.
        """
        record = self._pods.setdefault(reserved.uid, _Pod())
        if record.assumed is not None and record.reserved_at is None:
            return  # a bind already decided
        touched = record.nodes()
        record.assumed = reserved
        record.reserved_at = now
        self._reindex(reserved.uid, touched, fit)

    def knows_node(self, name: str) -> bool:
        return name in self.engine.nodes

    def counts(self, uid: str) -> bool:
        """Whether the pod is counted at all (observed with an allocation, assumed or reserved)."""
        return uid in self._pods

    def reservation(self, uid: str) -> PodAllocation | None:
        """The pod's reservation, if it has one (and no bind decision yet)."""
        record = self._pods.get(uid)
        if record is None or record.reserved_at is None:
            return None
        return record.assumed

    def unreserve(self, uid: str) -> None:
        record = self._pods.get(uid)
        if record is None or record.reserved_at is None:
            return
        touched = record.nodes()
        record.assumed = record.reserved_at = None
        self._reindex(uid, touched)

    def confirm_reservation(self, uid: str, node: str, phase: str, now: datetime) -> PodAllocation | None:
        """Turn the pod's reservation on ``node`` into its bind decision (``phase``, bound at
        ``now``) and return it; None when it has none there, or the node or one of its GPUs has
        since become unusable.

        The reservation already counts on the node, and every decision since was taken with it in
        place, so it still fits, and the in-flight rule held with it (reserved pods count as in
        flight). The node's usage does not change: nothing is rebuilt.
        """
        record = self._pods.get(uid)
        if record is None or record.reserved_at is None or record.assumed is None:
            return None
        reserved = record.assumed
        if reserved.allocation.node != node:
            return None
        state = self.engine.nodes.get(node)
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
        self._refresh_inflight(node)
        return confirmed

    def expire_reservations(self, now: datetime) -> None:
        # Reserved pods are in flight: the in-flight index has them all, without a walk over every pod.
        expired = [
            p.uid
            for entry in self._inflight.values()
            for p in entry.pods
            if (since := self._pods[p.uid].reserved_at) is not None and now - since > self.reservation_ttl
        ]
        for uid in expired:
            self.unreserve(uid)

    def forget(self, uid: str, allocation: Allocation) -> None:
        """Undo :meth:`assume` of ``allocation`` after a failed bind (and the observed copy of it)."""
        record = self._pods.get(uid)
        if record is None:
            return
        touched = record.nodes()
        if record.assumed is not None and record.assumed.allocation == allocation:
            record.assumed = record.reserved_at = None
        if record.observed is not None and record.observed.allocation == allocation:
            record.observed = None
        self._reindex(uid, touched)

    def oversubscribed_gpus(self) -> int:
        """GPUs holding at least one grant placed against measured use (a metric)."""
        return sum(1 for node in self.engine.nodes.values() for gpu in node.gpus if gpu.borrowed_mib > 0)

    def node(self, name: str) -> NodeState | None:
        """The node as placement sees it now (every pod counted on it), if it is known."""
        return self.engine.nodes.get(name)

    def counted(self, uid: str) -> PodAllocation | None:
        """The pod's allocation as counted now (the API server's word, or a decision not yet seen)."""
        record = self._pods.get(uid)
        return None if record is None else record.counted

    def resizing(self, uid: str, allocation: Allocation) -> None:
        """Count ``allocation``, a live resize of pod ``uid`` being written, from now on: with the pod's
        current allocation, each grant at the larger of the two (neither a grow nor a shrink frees
        anything before the API server has the new one), until the watch shows the pod with it, the
        pod goes, or :meth:`resize_failed`."""
        self._resizes[uid] = allocation
        self._rebuild(allocation.node)

    def resize_failed(self, uid: str) -> None:
        """The resize of pod ``uid`` was not written: count its allocation alone again."""
        self._end_resize(uid)

    def _end_resize(self, uid: str) -> None:
        allocation = self._resizes.pop(uid, None)
        if allocation is not None:
            self._rebuild(allocation.node)

    def pods_on(self, node: str) -> list[PodAllocation]:
        found = (self._pods[uid].counted for uid in self._pods_on.get(node, ()))
        return [p for p in found if p is not None]

    def inflight_pods(self, node: str, now: datetime, timeout: timedelta) -> InflightPods:
        """The pods in flight on ``node`` at ``now`` (phase allocating or reserved, bound less than
        ``timeout`` ago): one object for as long as they stay the same (filter asks about the same
        nodes pod after pod; see keeping_inflight_rule)."""
        entry = self._inflight.get(node)
        if entry is None:
            return InflightPods({}, {}, timeout, None)
        known = entry.current
        if known is not None and known.timeout == timeout and (known.until is None or now <= known.until):
            return known
        live = tuple(
            p for p in entry.pods if p.bind_time is not None and not stale(p.bind_time, now, timeout)
        )
        # Until the first of them times out (none comes back: bind times only age).
        until = min((p.bind_time + timeout for p in live if p.bind_time is not None), default=None)
        entry.current = InflightPods(
            {p.ref: p.keys for p in live}, {p.uid: p.ref for p in live}, timeout, until
        )
        entry.vetted.clear()  # answers for the pods in flight before
        return entry.current

    def nodes_with_inflight(self) -> AbstractSet[str]:
        """Nodes with a pod in phase allocating (however old) or reserved: where filter checks the
        in-flight rule. A live view, not a copy (hundreds of nodes while pods are being admitted):
        membership tests on it are safe while the watch changes it."""
        return self._inflight.keys()

    def _reindex(self, uid: str, before: set[str], placed: NodeFit | None = None) -> None:
        """Re-count pod ``uid`` on the nodes it counted on (``before``) and counts on now. ``placed``
        is the fit its new allocation came from, when it has one."""
        record = self._pods.get(uid)
        counted = None if record is None else record.counted
        after = set() if record is None else record.nodes()
        on = {counted.allocation.node} if counted is not None else set()
        for node in before - on:
            uids = self._pods_on.get(node)
            if uids is not None:
                uids.discard(uid)
                if not uids:
                    del self._pods_on[node]
        for node in on:
            self._pods_on.setdefault(node, set()).add(uid)
        if record is not None and counted is None:
            del self._pods[uid]  # nothing left to remember
        for node in before | after:
            if not before and placed is not None and self.engine.nodes.get(node) == placed.node:
                # A pod counted nowhere before, on a node as its fit saw it: add the placement
                # (what rebuilding the node from all its pods gives too, at a fraction of the
                # cost; a reservation does this on every filter's path).
                self._refresh_inflight(node)
                self.engine.set_node(apply(placed.node, placed.placement))
            else:
                self._rebuild(node)
        self.pod_changes += 1
        if self.on_pods_changed is not None:
            self.on_pods_changed()

    def _refresh_inflight(self, name: str) -> list[PodAllocation]:
        """Recompute the pods in flight on node ``name`` (before any change of its state: what was
        derived from them goes too); returns all its pods."""
        pods = self.pods_on(name)
        inflight = [p for p in pods if self._in_flight(p)]
        if inflight:
            self._inflight[name] = _Inflight(inflight)
        else:
            self._inflight.pop(name, None)
        return pods

    def _rebuild(self, name: str) -> None:
        pods = self._refresh_inflight(name)
        record = self._nodes.get(name)
        if record is None:
            return
        allocations = [_with_resize(p.allocation, self._resizes.get(p.uid)) for p in pods]
        if record.inventory is None:
            reason = record.inventory_error or "no inventory"
            self.engine.set_node(build_node(name, (), schedulable=False, unschedulable_reason=reason))
            return
        measured = None
        since: list[Allocation] = []
        if self.usage_rule is not None and record.usage_fresh and record.usage is not None:
            assert record.measured_at is not None  # set with usage
            measured = self.usage_rule.bounds(record.inventory, record.usage)
            since = [
                allocation
                for pod, allocation in zip(pods, allocations, strict=True)
                if placed_since(record.measured_at, pod.bind_time, self._in_flight(pod))
            ]
        self.engine.set_node(
            build_node(
                name,
                record.inventory,
                allocations,
                schedulable=record.stale_reason is None,
                unschedulable_reason=record.stale_reason or "",
                measured=measured,
                placed_since=since,
            )
        )

    def _in_flight(self, pod: PodAllocation) -> bool:
        """Bound and not yet served by the device plugin (phase allocating), or reserved."""
        return is_allocating(pod.phase) or self._pods[pod.uid].reserved_at is not None


def _version(metadata: JsonObject) -> int | None:
    """The object's resourceVersion as an integer, None when it is not one.

    Kubernetes calls it opaque; kube-apiserver serves etcd's revision, and the comparison only ever
    keeps an older read from replacing what the watch showed (an unreadable one is applied as is).
    """
    try:
        return int(str(metadata.get("resourceVersion")))
    except ValueError:
        return None


def _with_resize(allocation: Allocation, resized: Allocation | None) -> Allocation:
    """``allocation`` with each grant at the larger of its quotas and those of ``resized`` (the same
    containers on the same GPUs: a live resize being written)."""
    if resized is None or resized.node != allocation.node:
        return allocation
    containers = []
    for container in allocation.containers:
        after = resized.for_container(container.name)
        new = {} if after is None else {g.uuid: g for g in after.gpus}
        containers.append(
            ContainerAllocation(
                name=container.name,
                gpus=tuple(
                    g
                    if g.uuid not in new
                    else g.model_copy(
                        update={
                            "memory_quota_mib": max(g.memory_quota_mib, new[g.uuid].memory_quota_mib),
                            "cores": max(g.cores, new[g.uuid].cores),
                        }
                    )
                    for g in container.gpus
                ),
            )
        )
    return allocation.model_copy(update={"containers": tuple(containers)})
