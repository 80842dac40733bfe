"""The node agent's state and the operations the adapters call.

Holds the discovered GPUs and their health, serialises the matching of Allocate calls, writes the
per-container files and reports results to the API. Decisions are made by the pure modules
(:mod:`deviceplugin.devices`, :mod:`deviceplugin.matching`, :mod:`deviceplugin.response`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from deviceplugin.config import OVER_QUOTA_STOP, Config
from deviceplugin.devices import GpuHealth, VirtualDevice, virtual_devices, with_health
from deviceplugin.driveruse import (
    CONTEXT_ALLOWANCE_BYTES,
    OVER_QUOTA_REASON,
    UNMANAGED_REASON,
    GpuHolders,
    OverQuota,
    OverQuotaTimer,
    PodMemory,
    over_quota,
    unmanaged_bytes,
)
from deviceplugin.identity import corrected_records
from deviceplugin.kube import FreshReads, Kube, KubeUnavailableError
from deviceplugin.matching import (
    AllocationError,
    BrokenPod,
    ContainerRef,
    InFlight,
    NodeSnapshot,
    PodView,
    match_container,
    pod_complete,
    preferred_devices,
    snapshot,
)
from deviceplugin.mps_daemon import mps_paths
from deviceplugin.oversubscription import (
    GpuPlan,
    Holder,
    driver_checked,
    measured_use,
    plan_gpu,
    usage_worth_publishing,
)
from deviceplugin.phases import PhaseWriter
from deviceplugin.podcache import PodCache
from deviceplugin.podresources import Owners, PodResourcesError, container_devices
from deviceplugin.response import ContainerAnswer, answer_for, resized_grants
from deviceplugin.sharing import MpsPolicy
from hook.limits import DeviceLimit, write_limits
from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir, StateDir, create_state_dir
from tessera.contract import (
    CONTAINER_COORDINATION_DIR,
    MIB,
    Allocation,
    ContractError,
    GpuGrant,
    GpuInfo,
    GpuUsage,
    NodeGpuUsage,
    Phase,
    QosClass,
    SharingMode,
    dump_gpu_usage,
    dump_inventory,
    format_time,
    now,
    parse_allocation,
    pod_ref,
)
from tessera.inflight import InflightKey, is_allocating

log = logging.getLogger(__name__)

FAILED_REASON = "TesseraAllocateFailed"
# How often served records are checked against the kubelet and dead containers' state removed.
TIDY_SECONDS = 5.0
# After an Allocate, the kubelet's pod-resources API is asked which pod it admitted: first after
# this pause, then after pauses doubling up to the last while it does not name the devices yet.
CONFIRM_FIRST_PAUSE = 0.05
CONFIRM_MAX_PAUSE = 1.0
# The Warning event on a best-effort pod evicted to give borrowed GPU memory back.
EVICTED_REASON = "TesseraBestEffortEvicted"
# A GPU's utilisation published before the next heartbeat once it moved by this many points.
USAGE_CHANGE_PERCENT = 10
# An eviction asked for is asked again (the pod still served) after its grace period and this long.
EVICTION_RETRY_SECONDS = 30.0
# A kubelet calls Allocate within milliseconds of the GetPreferredAllocation of the same container;
# a confirmation older than this belongs to an admission that never reached its Allocate.
PREFERRED_CONFIRMATION_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class PreferredConfirmation:
    """A GetPreferredAllocation answered from the cache, with the in-flight key of the pod the API
    confirmed for it by a read that started after the call: the kubelet's next call, the Allocate
    of the same container, may take that confirmation instead of reading again
    (:meth:`Agent.allocate`)."""

    call: int  # its number among the kubelet's calls (Agent._calls)
    answered_at: float  # monotonic
    devices: frozenset[str]  # the slices it answered
    key: InflightKey  # the key of every container of that GPU count in the confirmed pod


@dataclass(frozen=True, slots=True)
class PodTarget:
    """A served pod, as an event names it."""

    namespace: str
    name: str
    uid: str


class Agent:
    def __init__(
        self,
        config: Config,
        gpus: tuple[GpuInfo, ...],
        kube: Kube,
        state: StateDir,
        *,
        cache: PodCache | None = None,
        phases: PhaseWriter | None = None,
        pod_resources: Callable[[], Owners | None] | None = None,
        sharing: SharingMode | None = None,
    ) -> None:
        """``cache``: the pods on the node, read by Allocate before the API (None: the API only).
        ``phases``: writes the ``allocated`` phase once the kubelet admitted a pod; whoever runs the
        agent runs its loop (``phases.run``), or drains it. ``pod_resources``: which container the
        kubelet gave each device set to (default: its pod-resources API at the configured socket).
        ``sharing``: the node's mode (default ``--sharing``; the caller decides it from the Node's
        label, :func:`deviceplugin.sharing.node_sharing_mode`)."""
        self.config = config
        self.sharing = config.sharing if sharing is None else sharing
        # Under MPS: each container's client settings by class, and the daemon's directories.
        self.mps_policy = MpsPolicy(config.mps_best_effort_threads)
        self.mps_paths = mps_paths(config.state_dir)
        self.kube = kube
        self.state = state
        self.cache = cache
        self._reads = FreshReads(kube)
        self.phases = phases if phases is not None else PhaseWriter(kube)
        self._gpus = gpus
        self._uuids = frozenset(g.uuid for g in gpus)
        self._health = {g.uuid: GpuHealth() for g in gpus}
        self._changed = threading.Condition()
        self._version = 0
        # Guards matching, the served records and the reservations.
        self._lock = threading.Condition()
        # The records in the state dir (read at start and by each clean-up, then kept with them),
        # and what they say is served.
        self._records: dict[ContainerDir, ServedRecord] = dict(state.records())
        self._served: set[ContainerRef] = _refs(self._records)
        # Containers matched from the cache whose pods are being confirmed with the API.
        self._reserved: set[ContainerRef] = set()
        # The kubelet's GetPreferredAllocation and Allocate calls, numbered as they arrive; the last
        # preferred answer confirmed with the API, for the Allocate that follows it.
        self._calls = 0
        self._preferred: PreferredConfirmation | None = None
        self._fallbacks_waiting = 0
        self._pod_resources = pod_resources or (
            lambda: container_devices(config.pod_resources_socket, config.keys.vgpu)
        )
        # Containers served whose admission the kubelet has not confirmed yet: dir -> the pod
        # matched (the guess) and when it was served (monotonic).
        self._unconfirmed: dict[ContainerDir, tuple[PodView, float]] = {}
        self._confirm_wanted = threading.Event()
        self._published_inventory: str | None = None
        # Allocate calls answered from the cache and from a fresh list; why the cache could not;
        # cache answers confirmed by their GetPreferredAllocation's read instead of a read of their own.
        self.cache_answers = 0
        self.preferred_confirmations = 0
        self.api_answers = 0
        self.api_reasons: Counter[str] = Counter()
        # Live resizes: the allocation annotations already followed, by pod UID.
        self._followed: dict[str, str] = {}
        # Told how many containers' limits files each follow rewrote (the exporter's counter).
        self.on_followed: Callable[[int], object] | None = None
        # Best-effort pods that borrow memory (deviceplugin/oversubscription.py): each GPU's plan as of
        # the last usage check, the limits last written per container, the pods being evicted (UID ->
        # when asked, monotonic), and the measured use the node annotation is to say.
        self.utilization: Callable[[str], int | None] = lambda _: None  # percent, from NVML
        # The driver's word, from NVML: per GPU, what each pod's processes hold, and the GPU's free
        # memory; None where NVML cannot say (deviceplugin/driveruse.py). Over-quota pods are
        # stopped by killing their processes on the GPU (host PIDs: the agent runs in the host's
        # PID namespace).
        self.gpu_holders: Callable[[str], GpuHolders | None] = lambda _: None
        self.free_memory: Callable[[str], int | None] = lambda _: None
        self.kill: Callable[[int], None] = _kill
        self.clock: Callable[[], float] = time.monotonic  # the over-quota grace's
        self._over_quota = OverQuotaTimer(config.over_quota_grace_seconds)
        self._unmanaged_told: set[tuple[str, str]] = set()
        self._plans: dict[str, GpuPlan[ContainerDir]] = {}
        self._written: dict[ContainerDir, tuple[DeviceLimit, ...]] = {}
        self._evicting: dict[str, float] = {}
        self._claims_ignored: set[tuple[ContainerDir, str]] = set()
        self._usage: NodeGpuUsage | None = None
        self._published_usage: tuple[GpuUsage, ...] | None = None
        # The containers the last check measured, and those the last patch published.
        self._usage_measured: frozenset[ContainerDir] = frozenset()
        self._published_measured: frozenset[ContainerDir] = frozenset()
        self._usage_published_at = 0.0
        self._check_wanted = threading.Event()
        self.evictions = 0
        self.on_evicted: Callable[[], object] | None = None
        if cache is not None:
            cache.on_pods = self.follow_resizes

    # ---------------------------------------------------------------------------------------------
    # GPUs and health

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self._gpus)

    def inventory(self) -> tuple[GpuInfo, ...]:
        with self._changed:
            return with_health(self._gpus, self._health)

    def devices(self) -> tuple[tuple[VirtualDevice, ...], int]:
        """The full slice list and its version (bumped on every health change)."""
        with self._changed:
            return virtual_devices(with_health(self._gpus, self._health)), self._version

    def wait_for_change(self, version: int, timeout: float) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self._version != version, timeout=timeout)
            return self._version

    def wake_waiters(self) -> None:
        """Wake the loops that wait for a change or a tick (to see that they are stopped)."""
        self._check_wanted.set()
        with self._changed:
            self._changed.notify_all()

    def record_xid(self, uuid: str, xid: int) -> None:
        self._set_health(uuid, lambda h: h.with_xid(xid), f"XID {xid}")

    def record_presence(self, uuid: str, present: bool) -> None:
        self._set_health(uuid, lambda h: h.with_presence(present), "present" if present else "gone")

    def _set_health(self, uuid: str, change: Callable[[GpuHealth], GpuHealth], why: str) -> None:
        with self._changed:
            if uuid not in self._health:
                return
            before = self._health[uuid]
            after = change(before)
            if after == before:
                return
            self._health[uuid] = after
            self._version += 1
            self._changed.notify_all()
        log.warning("GPU %s: %s, now %s", uuid, why, "Healthy" if after.healthy else "Unhealthy")

    # ---------------------------------------------------------------------------------------------
    # Kubelet calls

    def preferred(self, available: Sequence[str], must_include: Sequence[str], gpu_count: int) -> list[str]:
        """The slices to steer the kubelet to; without the API, distinct GPUs (an error here would
        fail the pod's admission, while Allocate can still decide once the API is back).

        From the pod cache when its first in-flight container of that GPU count is fresh and the
        API confirms its pod (as Allocate does; that confirmation is kept for the Allocate that
        follows); otherwise from a fresh list of the node's pods."""
        call = self._next_call()
        pods = self.cache.pending_pods() if self.cache is not None else None
        if pods is not None:
            state = self._snapshot(pods, self._taken())
            first = next((c for c in state.in_flight if c.key.gpu_count == gpu_count), None)
            try:
                if first is not None and not first.stale and self._confirmed([first.pod]):
                    answer = preferred_devices(available, must_include, gpu_count, state)
                    own = self._snapshot([first.pod], set()).in_flight
                    if {c.key for c in own if c.key.gpu_count == gpu_count} == {first.key}:
                        kept = PreferredConfirmation(call, time.monotonic(), frozenset(answer), first.key)
                        with self._lock:
                            self._preferred = kept
                    return answer
            except KubeUnavailableError as e:
                log.warning("GetPreferredAllocation without the pods: %s", e)
                return preferred_devices(available, must_include, gpu_count, self._snapshot([], set()))
        try:
            pods = self.kube.pending_pods()
        except KubeUnavailableError as e:
            log.warning("GetPreferredAllocation without the pods: %s", e)
            pods = []
        return preferred_devices(available, must_include, gpu_count, self._snapshot(pods, self._taken()))

    def allocate(self, requests: Sequence[Sequence[str]]) -> list[ContainerAnswer]:
        """Answers for the containers of one Allocate call, in order; raises :class:`AllocationError`.

        From the pod cache when it has a fresh match whose pods the API confirms (one get per pod),
        else from a fresh list of the node's pods (docs/deviceplugin.md "Allocate from the pod
        cache"). Matching and the served records happen under one lock, and a container matched
        from the cache is reserved while its pod is confirmed, so two concurrent calls never pick
        the same container. The ``allocated`` phase of a pod served in full is written after the
        answer, once the kubelet names the pod it admitted (:meth:`confirm_admissions`).
        """
        served = self._allocate_from_cache(requests, self._next_call())
        if served is None:
            served = self._allocate_from_api(requests)
        chosen, answers = served
        self._confirm_wanted.set()
        for c in chosen:
            log.info(
                "Allocate: pod %s container %s gets %s",
                c.pod.ref,
                c.container,
                ", ".join(f"{g.uuid} ({g.memory_mib} MiB, {g.cores}% cores)" for g in c.grants),
            )
        return answers

    def _next_call(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls

    def _allocate_from_cache(
        self, requests: Sequence[Sequence[str]], call: int
    ) -> tuple[list[InFlight], list[ContainerAnswer]] | None:
        """The answers from the pod cache, or None when it cannot answer for sure: not synced, no
        match, a stale match (a fresh pod it has not seen yet would come first), or a matched pod
        the API no longer shows as the cache does. ``call``: this call's number."""
        pods = self.cache.pending_pods() if self.cache is not None else None
        if pods is None:
            return None
        with self._lock:
            if self._fallbacks_waiting:  # no new reservations while a fallback waits for them to end
                self.api_reasons["a fallback waiting"] += 1
                return None
            try:
                chosen = self._match(self._snapshot(pods, self._served | self._reserved), requests)
            except AllocationError:
                self.api_reasons["no match in the cache"] += 1
                log.info("Allocate: no fresh match in the pod cache for %s; asking the API", list(requests))
                return None
            if any(c.stale for c in chosen):
                self.api_reasons["stale match"] += 1
                return None
            refs = {c.ref for c in chosen}
            self._reserved |= refs
            preferred, self._preferred = self._preferred, None
        try:
            try:
                confirmed = self._confirmed_by(preferred, call, chosen, requests) or self._confirmed(
                    [c.pod for c in chosen]
                )
            except KubeUnavailableError as e:
                log.warning("Allocate: %s", e)
                confirmed = False
            if not confirmed:
                self.api_reasons["not confirmed"] += 1
                return None
            with self._lock:
                answers = self._serve(chosen, requests)
            self.cache_answers += 1
            return chosen, answers
        finally:
            with self._lock:
                self._reserved -= refs
                self._lock.notify_all()

    def _allocate_from_api(
        self, requests: Sequence[Sequence[str]]
    ) -> tuple[list[InFlight], list[ContainerAnswer]]:
        """The answers from a fresh list of the node's pods, as before the cache; a refusal is
        reported on the pods concerned. The list may be read before the lock because records, not
        phases, say what is served; matching waits for the cache path's reservations to settle, so
        a container being confirmed is neither taken twice nor refused for."""
        pods = self.kube.pending_pods()
        try:
            with self._lock:
                self._fallbacks_waiting += 1
                try:
                    self._lock.wait_for(lambda: not self._reserved)
                finally:
                    self._fallbacks_waiting -= 1
                chosen = self._match(self._snapshot(pods, self._served), requests)
                answers = self._serve(chosen, requests)
        except AllocationError as e:
            log.warning("Allocate refused: %s", e.message)
            self._report_failure(e.concerned, e.message)
            raise
        self.api_answers += 1
        return chosen, answers

    def _taken(self) -> set[ContainerRef]:
        with self._lock:
            return self._served | self._reserved

    def _snapshot(self, pods: Sequence[PodView], served: set[ContainerRef]) -> NodeSnapshot:
        return snapshot(
            pods,
            keys=self.config.keys,
            node=self.config.node_name,
            node_gpus=self._uuids,
            served=served,
            now=now(),
            inflight_timeout=self.config.inflight_timeout,
        )

    def _match(self, state: NodeSnapshot, requests: Sequence[Sequence[str]]) -> list[InFlight]:
        chosen: list[InFlight] = []
        for device_ids in requests:
            chosen.append(
                match_container(
                    device_ids,
                    state,
                    node=self.config.node_name,
                    node_gpus=self._uuids,
                    taken={c.ref for c in chosen},
                )
            )
        return chosen

    def _serve(self, chosen: Sequence[InFlight], requests: Sequence[Sequence[str]]) -> list[ContainerAnswer]:
        """Write the containers' files and records; under the lock."""
        answers = [
            answer_for(
                c,
                ids,
                self.state,
                self.state.unused_container(c.pod.uid, c.container),
                self.config.hook_library,
                mps=self.mps_paths if self.sharing == SharingMode.MPS else None,
                devices=self.config.device_list_strategy,
            )
            for c, ids in zip(chosen, requests, strict=True)
        ]
        for answer in answers:
            self._write_files(answer)
        self._retire_records_of({frozenset(a.record.device_ids) for a in answers if a.record.device_ids})
        self._served |= {c.ref for c in chosen}
        served_at = time.monotonic()
        for c, answer in zip(chosen, answers, strict=True):
            self._records[answer.where] = answer.record
            self._unconfirmed[answer.where] = (c.pod, served_at)
        self._check_wanted.set()  # a best-effort container that borrows memory gets its quota now
        return answers

    def _retire_records_of(self, device_sets: set[frozenset[str]]) -> None:
        """Remove the records of the containers that held these device sets before; under the lock.

        The kubelet gives a container only free slices, so whatever a record holding the same set
        names (a container gone, refused at admission, or a wrong guess), it no longer holds them.
        Kept, the record would be corrected to name the new container too (two records for one
        container). Its dir stays until the clean-up, as any dir without a record."""
        stale = [where for where, r in self._records.items() if frozenset(r.device_ids) in device_sets]
        for where in stale:
            self.state.remove_record(where)
            retired = self._records.pop(where)
            self._unconfirmed.pop(where, None)
            log.info(
                "%s: its slices were given to a new container; %s container %s no longer holds them",
                where.root,
                pod_ref(retired.namespace, retired.pod),
                retired.container,
            )
        if stale:
            self._served = _refs(self._records)

    def _confirmed(self, pods: Sequence[PodView]) -> bool:
        """Whether the API shows each pod as the cache does: still there, pending, not being
        deleted, with the same UID, allocation, phase, bind time and GPU containers. Then the pod is
        in flight for the extender too, and by the rule every in-flight container of another pod
        with the same GPU count has the matched container's key (however far the cache lags): the
        read started after the kubelet had the pod it admits, so either pod was bound while the
        other was in flight."""
        keys = self.config.keys
        fields = (keys.allocation, keys.allocation_phase, keys.bind_time)
        unique = {p.uid: p for p in pods}.values()
        read = self._reads.read_pods([(p.namespace, p.name) for p in unique])
        for pod in unique:
            fresh = read[(pod.namespace, pod.name)]
            if (
                fresh is None
                or not fresh.pending
                or fresh.view.uid != pod.uid
                or fresh.view.gpu_containers != pod.gpu_containers
                or fresh.view.request_error != pod.request_error
                or any(fresh.view.annotations.get(k) != pod.annotations.get(k) for k in fields)
            ):
                log.info("Allocate: pod %s changed since the pod cache saw it; asking the API", pod.ref)
                return False
        return True

    def _confirmed_by(
        self,
        preferred: PreferredConfirmation | None,
        call: int,
        chosen: Sequence[InFlight],
        requests: Sequence[Sequence[str]],
    ) -> bool:
        """Whether the GetPreferredAllocation just before this Allocate confirmed its match: the
        kubelet's previous call, for the slices this call asks for, within a second, and the match
        has the key it confirmed. A kubelet admits one container at a time and calls
        GetPreferredAllocation, then Allocate, for its slices (the device manager's
        devicesToAllocate), and that call's read started after the kubelet had the pod it admits.
        The pod the read confirmed was then in flight, so by :meth:`_confirmed`'s argument the
        container admitted has that pod's key for its GPU count (one key: checked when it was
        kept), whichever pod it is; so has the match, even when it is another pod of that key.
        Anything else, such as calls interleaved by another client, reads again."""
        if (
            preferred is None
            or preferred.call != call - 1
            or time.monotonic() - preferred.answered_at > PREFERRED_CONFIRMATION_SECONDS
            or len(requests) != 1
            or frozenset(requests[0]) != preferred.devices
            or any(c.key != preferred.key for c in chosen)
        ):
            return False
        self.preferred_confirmations += 1
        return True

    def _write_files(self, answer: ContainerAnswer) -> None:
        create_state_dir(answer.where)
        for slot in answer.slots:
            self.state.create_slot(slot)
        self._write_limits(answer.where, answer.record)
        self.state.write_record(answer.where, answer.record)

    def _limits_for(self, where: ContainerDir, record: ServedRecord) -> tuple[DeviceLimit, ...]:
        """The container's limits: its grants, except that a best-effort container borrowing a GPU's
        memory has the quota the GPU's plan gives it, and a guaranteed container on a GPU whose memory
        is borrowed waits for it when short (docs/deviceplugin.md); under the lock."""
        wait_ms = round(self.config.shortfall_wait_seconds * 1000)
        limits = []
        for grant in record.gpus:
            plan = self._plans.get(grant.uuid)
            memory = grant.memory_mib * MIB
            wait = 0
            if plan is not None:
                memory = plan.quotas.get(where, memory)
                wait = wait_ms if plan.oversubscribed and record.qos != QosClass.BEST_EFFORT else 0
            limits.append(DeviceLimit(grant.uuid, memory, grant.cores, wait))
        return tuple(limits)

    def _write_limits(self, where: ContainerDir, record: ServedRecord) -> None:
        """Write the container's limits file (atomically: the hook in each of its processes follows
        it within 100 ms); under the lock."""
        limits = self._limits_for(where, record)
        write_limits(
            where.limits,
            limits,
            qos=record.qos,
            coordination=CONTAINER_COORDINATION_DIR,
            mps=self.mps_policy.client(record.qos) if record.mps else None,
        )
        self._written[where] = limits

    # ---------------------------------------------------------------------------------------------
    # Live resize

    def follow_resizes(self, pods: Sequence[PodView]) -> int:
        """Rewrite the limits file (atomically: the hook in each of the container's processes
        follows it) and the record of every served container of ``pods`` whose allocation now gives
        it other quotas on the same GPUs: a live resize the extender decided. Returns how many."""
        changed: dict[str, Allocation] = {}
        texts: dict[str, str] = {}
        for pod in pods:
            text = pod.annotations.get(self.config.keys.allocation)
            if text is None or self._followed.get(pod.uid) == text:
                continue
            texts[pod.uid] = text
            try:
                changed[pod.uid] = parse_allocation(text, pod=pod.ref)
            except ContractError as e:
                log.warning("%s", e)
        if not texts:
            return 0
        followed = 0
        with self._lock:
            for where, record in list(self._records.items()):
                allocation = changed.get(record.pod_uid)
                grants = None if allocation is None else resized_grants(record, allocation)
                if allocation is None or grants is None:
                    continue
                self._follow(where, record.model_copy(update={"gpus": grants}), grants)
                followed += 1
            self._followed.update(texts)  # once written: a failed write is tried again by tidy_state
        if followed and self.on_followed is not None:
            self.on_followed(followed)
        return followed

    def _follow(self, where: ContainerDir, record: ServedRecord, grants: Sequence[GpuGrant]) -> None:
        self._write_limits(where, record)
        self.state.write_record(where, record)
        self._records[where] = record
        quotas = ", ".join(f"{g.uuid}: {g.memory_mib} MiB, {g.cores}% compute" for g in grants)
        log.info(
            "pod %s container %s resized: %s", pod_ref(record.namespace, record.pod), record.container, quotas
        )

    def _set_phase(self, pod: PodView, phase: Phase) -> None:
        try:
            self.kube.set_phase(pod, phase)
        except Exception as e:  # the API being unreachable must not fail the kubelet's call
            log.warning("pod %s: cannot set phase %s: %s", pod.ref, phase.value, e)

    def _report_failure(self, concerned: Sequence[BrokenPod], message: str) -> None:
        for broken in concerned:
            self._set_phase(broken.pod, Phase.FAILED)
            try:
                self.kube.warn(broken.pod, FAILED_REASON, f"{broken.reason} ({message})")
            except Exception as e:
                log.warning("pod %s: cannot record event: %s", broken.pod.ref, e)

    # ---------------------------------------------------------------------------------------------
    # API side: inventory, heartbeat, clean-up

    def publish(self, *, heartbeat: bool) -> bool:
        """Patch the node's inventory (when it changed) and heartbeat (when due); True if patched."""
        keys = self.config.keys
        if self._published_inventory is None:
            self._published_inventory = self.kube.node_annotations().get(keys.node_gpus)
        inventory = dump_inventory(self.inventory())
        patch = {}
        if inventory != self._published_inventory:
            patch[keys.node_gpus] = inventory
        usage, measured = self._usage, self._usage_measured
        if usage is not None and usage_worth_publishing(
            self._published_usage,
            usage.gpus,
            change_mib=self.config.usage_change_mib,
            change_percent=USAGE_CHANGE_PERCENT,
            since_published=time.monotonic() - self._usage_published_at,
            min_interval=self.config.usage_publish_seconds,
            max_interval=self.config.heartbeat_seconds,
            newly_measured=bool(measured - self._published_measured),
        ):
            patch[keys.node_gpu_usage] = dump_gpu_usage(usage)
        if heartbeat or patch:
            patch[keys.node_heartbeat] = format_time(now())
        if not patch:
            return False
        self.kube.annotate_node(patch)
        self._published_inventory = inventory
        if keys.node_gpu_usage in patch and usage is not None:
            self._published_usage = usage.gpus
            self._published_measured = measured
            self._usage_published_at = time.monotonic()
        return True

    def confirm_admissions(self) -> bool:
        """Write the ``allocated`` phase of the pods the kubelet admitted in full since the last
        call, and correct the records of the containers it served for another pod than the one
        matched; True while a container served has not been named by the kubelet yet (ask again).

        A pod is admitted once the kubelet's pod-resources API names each of its GPU containers as
        holding devices (the kubelet records them as Allocate returns), not when its container was
        matched: among in-flight pods of one key the match is a guess, and a pod marked ``allocated``
        before the kubelet admitted it would let the extender bind another key beside it
        (docs/deviceplugin.md "The allocated phase"). Without the API (its socket absent), the
        matched pods are taken at their word.
        """
        try:
            owners = self._pod_resources()
        except PodResourcesError as e:
            log.warning("cannot ask which pods the kubelet admitted (asking again): %s", e)
            return True
        if owners is None:
            with self._lock:
                guessed = {pod.uid: pod for pod, _ in self._unconfirmed.values()}
                self._unconfirmed.clear()
                done = [p for p in guessed.values() if self._admitted(p, None)]
            self._submit_allocated(done)
            return False
        # Every pod on the node: one admitted may be running already.
        pods = self.cache.node_pods() if self.cache is not None else None
        if pods is None:
            try:
                pods = [p.view for p in self.kube.node_pods()]
            except KubeUnavailableError as e:
                log.warning("cannot read the pods the kubelet admitted (asking again): %s", e)
                return True
        known = {(p.namespace, p.name) for p in pods}
        deadline = time.monotonic() - self.config.inflight_timeout.total_seconds()
        with self._lock:
            unconfirmed = list(self._unconfirmed.items())
            seen: list[tuple[ContainerDir, ServedRecord]] = []
            admitted: set[tuple[str, str]] = set()
            for where, (_, served_at) in unconfirmed:
                record = self._records.get(where)
                owner = owners.get(frozenset(record.device_ids)) if record is not None else None
                if record is not None and owner is not None and (owner.namespace, owner.pod) in known:
                    seen.append((where, record))
                    admitted.add((owner.namespace, owner.pod))
                elif record is not None and served_at >= deadline:
                    continue  # not named yet (or its pod not seen yet): ask again
                # Named by the kubelet, removed by a clean-up, or not admitted within the timeout.
                del self._unconfirmed[where]
            self._correct_records(seen, owners, pods)
            done = [p for p in pods if (p.namespace, p.name) in admitted and self._admitted(p, owners)]
            pending = bool(self._unconfirmed)
        self._submit_allocated(done)
        return pending

    def _admitted(self, pod: PodView, owners: Owners | None) -> bool:
        """Every GPU container of the pod has its record and (unless ``owners`` is None: no
        pod-resources API) holds devices for the kubelet, and its phase still says
        ``allocating``; under the lock."""
        held = {(o.namespace, o.pod, o.container) for o in owners.values()} if owners is not None else None
        return (
            bool(pod.gpu_containers)
            and pod.request_error is None
            and is_allocating(pod.annotations.get(self.config.keys.allocation_phase))
            and (held is None or all((pod.namespace, pod.name, c.name) in held for c in pod.gpu_containers))
            and pod_complete(pod, self._served)
        )

    def _correct_records(
        self, records: Sequence[tuple[ContainerDir, ServedRecord]], owners: Owners, pods: Sequence[PodView]
    ) -> None:
        """Rewrite the records whose devices the kubelet gave to another pod or container than the
        record names, and the served set with them; under the lock."""
        uids = {(p.namespace, p.name): p.uid for p in pods}
        changes = corrected_records(records, owners, uids)
        for where, old, new in changes:
            self.state.write_record(where, new)
            self._records[where] = new
            log.info(
                "%s: the kubelet gave its devices to %s container %s, not %s container %s",
                where.root,
                pod_ref(new.namespace, new.pod),
                new.container,
                pod_ref(old.namespace, old.pod),
                old.container,
            )
        if changes:
            self._served = _refs(self._records)

    def _submit_allocated(self, pods: Sequence[PodView]) -> None:
        for pod in pods:
            if self.phases.submit(pod, Phase.ALLOCATED):
                log.info("pod %s: admitted by the kubelet, setting phase allocated", pod.ref)

    def run_confirmations(self, stop: threading.Event) -> None:
        """After each Allocate, ask the kubelet which pods it admitted (:meth:`confirm_admissions`),
        again after growing pauses while it has not named every container served, until ``stop``."""
        pause = CONFIRM_FIRST_PAUSE
        while not stop.is_set():
            if not self._confirm_wanted.wait(timeout=1.0):
                continue
            stop.wait(pause)
            self._confirm_wanted.clear()
            try:
                pending = self.confirm_admissions()
            except Exception as e:  # the loop must outlive any one failure; the next round retries
                log.warning("confirming admissions failed (retrying): %s", e)
                pending = True
            if pending:
                pause = min(CONFIRM_MAX_PAUSE, pause * 2)
                self._confirm_wanted.set()
            else:
                pause = CONFIRM_FIRST_PAUSE

    def tidy_state(self) -> None:
        """Correct served records from the kubelet's pod-resources API, remove the state of
        containers whose pods are gone, and ask again for the ``allocated`` phase of pods the
        kubelet admitted in full whose phase is still ``allocating`` (a write lost with a restart
        of the agent). Under the Allocate lock: matching reads the records."""
        with self._lock:
            served_before = set(self._served)
        pods = self.kube.node_pods()
        views = [p.view for p in pods]
        asked = True
        try:
            owners = self._pod_resources()
        except PodResourcesError as e:
            log.warning("cannot ask the kubelet which pods hold which devices: %s", e)
            owners, asked = None, False
        with self._lock:
            if owners is not None:
                self._correct_records(list(self._records.items()), owners, views)
            # Pods served since the list began are alive though the list may not show them.
            live = {p.uid for p in views} | {uid for uid, _ in self._served - served_before}
            removed = self.state.remove_containers_except(live)
            self._records = dict(self.state.records())
            self._served = _refs(self._records)
            done = [p for p in views if asked and self._admitted(p, owners)]
            for uid in set(self._followed) - live:
                del self._followed[uid]
        if removed:
            log.info("removed the state of %d container(s) whose pods are gone", len(removed))
        self.follow_resizes(views)
        self._submit_allocated(done)

    def run_publisher(self, stop: threading.Event) -> None:
        """Publish at once, on every health change, and every heartbeat interval, until ``stop``."""
        next_heartbeat = next_tidy = 0.0
        version = -1
        last_error = ""
        while not stop.is_set():
            due = time.monotonic() >= next_heartbeat
            try:
                _, version = self.devices()
                self.publish(heartbeat=due)
                if due:
                    next_heartbeat = time.monotonic() + self.config.heartbeat_seconds
                if time.monotonic() >= next_tidy:
                    self.tidy_state()
                    next_tidy = time.monotonic() + TIDY_SECONDS
            except Exception as e:  # the API may be down for a while; keep trying, say so once
                if str(e) != last_error:
                    log.warning("node %s: API call failed (retrying): %s", self.config.node_name, e)
                    last_error = str(e)
                stop.wait(2.0)
                continue
            last_error = ""
            self.wait_for_change(version, timeout=max(0.0, min(1.0, next_heartbeat - time.monotonic())))

    # ---------------------------------------------------------------------------------------------
    # Measured use, and best-effort containers that borrow memory

    def measured_usage(self) -> NodeGpuUsage | None:
        """Each GPU's use as of the last check (None before the first)."""
        return self._usage

    def oversubscribed_gpus(self) -> frozenset[str]:
        """The GPUs whose memory best-effort containers borrow, as of the last check."""
        return frozenset(uuid for uuid, plan in self._plans.items() if plan.oversubscribed)

    def check_usage(self) -> None:
        """Read every served container's region, measure each GPU's use, rewrite the limits of the
        containers whose quota or wait changed (best-effort ones that borrow memory follow what the
        others leave) and evict best-effort pods for guaranteed ones that wait for memory."""
        with self._lock:
            records = dict(self._records)
        holders: dict[str, list[Holder[ContainerDir]]] = defaultdict(list)
        for where, record in records.items():
            usage = where.usage()
            for grant in record.gpus:
                device = usage.device(grant.uuid) if usage is not None else None
                holders[grant.uuid].append(
                    Holder(
                        key=where,
                        pod=record.pod_uid,
                        qos=record.qos,
                        grant_bytes=grant.memory_mib * MIB,
                        oversubscribed=grant.oversubscribed and record.qos == QosClass.BEST_EFFORT,
                        used_bytes=device.memory_used_bytes if device is not None else 0,
                        waiting_bytes=device.memory_waiting_bytes if device is not None else 0,
                        served_at=record.served_at,
                    )
                )
        retry_after = time.monotonic() - self.config.eviction_grace_seconds - EVICTION_RETRY_SECONDS
        served_pods = {r.pod_uid for r in records.values()}
        self._evicting = {
            uid: at for uid, at in self._evicting.items() if uid in served_pods and at > retry_after
        }
        evicting = frozenset(w for w, r in records.items() if r.pod_uid in self._evicting)
        margin = self.config.oversubscription_margin_mib * MIB
        drivers = {gpu.uuid: self.gpu_holders(gpu.uuid) for gpu in self._gpus}
        for gpu in self._gpus:
            claimed = holders.get(gpu.uuid, [])
            driver = drivers[gpu.uuid]
            by_pod = None if driver is None else {uid: held.used_bytes for uid, held in driver.pods.items()}
            checked = driver_checked(claimed, by_pod)
            self._report_claims(gpu.uuid, claimed, checked)
            holders[gpu.uuid] = checked
        plans = {
            gpu.uuid: plan_gpu(
                gpu.memory_mib * MIB, holders.get(gpu.uuid, []), margin, evicting, self.free_memory(gpu.uuid)
            )
            for gpu in self._gpus
        }
        with self._lock:
            self._plans = plans
            for where, record in self._records.items():
                if self._written.get(where) != self._limits_for(where, record):
                    self._write_limits(where, record)
            for gone in set(self._written) - set(self._records):
                del self._written[gone]
        # The measurement's time has whole seconds, as the pods' bind times do, and the extender
        # counts a pod at its full request unless measured after the second it was bound in: a
        # container served in this second counts as measured only from the next check on.
        measured_at = now()
        second = int(measured_at.timestamp())
        self._usage_measured = frozenset(w for w, r in records.items() if int(r.served_at) < second)
        self._usage = NodeGpuUsage(
            time=format_time(measured_at),
            gpus=tuple(
                measured_use(gpu.uuid, holders.get(gpu.uuid, []), self.utilization(gpu.uuid) or 0)
                for gpu in self._gpus
            ),
        )
        for uuid, plan in plans.items():
            held = {h.key: h.used_bytes for h in holders.get(uuid, [])}
            for where in plan.evict:
                self._evict(records[where], uuid, plan.shortfall_bytes, held[where])
        self._act_on_the_driver(records, drivers)

    def _act_on_the_driver(
        self, records: Mapping[ContainerDir, ServedRecord], drivers: Mapping[str, GpuHolders | None]
    ) -> None:
        """Stop pods that stay over their quota by the driver (or report them), and tell pods that
        use a GPU Tessera did not give them (deviceplugin/driveruse.py)."""
        quotas: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        pods: dict[str, ServedRecord] = {}
        for record in records.values():
            pods[record.pod_uid] = record
            for grant in record.gpus:
                quotas[grant.uuid][record.pod_uid] += grant.memory_mib * MIB
        over: dict[tuple[str, str], PodMemory] = {}
        unmanaged: set[tuple[str, str]] = set()
        for uuid, driver in drivers.items():
            if driver is None:
                continue
            for uid, held in over_quota(quotas[uuid], driver).items():
                over[uid, uuid] = held
            for uid, used in unmanaged_bytes(quotas[uuid].keys(), driver).items():
                if uid and used:
                    unmanaged.add((uid, uuid))
                    if (uid, uuid) not in self._unmanaged_told:
                        self._tell_unmanaged(uid, uuid, used)
        self._unmanaged_told = unmanaged
        for uid, uuid in self._over_quota.due(over, self.clock()):
            record = pods[uid]
            held = over[uid, uuid]
            found = OverQuota(
                record.namespace, record.pod, uid, uuid, held.used_bytes // MIB, quotas[uuid][uid] // MIB
            )
            if self.config.over_quota_action == OVER_QUOTA_STOP:
                for pid in held.pids:
                    self.kill(pid)
                action = f"; its processes on this GPU were stopped (PIDs {', '.join(map(str, held.pids))})"
            else:
                action = "; reported only (--over-quota-action report)"
            log.warning("pod %s %s%s", pod_ref(record.namespace, record.pod), found.message, action)
            self._warn(
                PodTarget(record.namespace, record.pod, uid), OVER_QUOTA_REASON, found.message + action
            )

    def _tell_unmanaged(self, uid: str, uuid: str, used: int) -> None:
        """A Warning event on a pod whose processes hold memory on a GPU Tessera did not give it."""
        node_pod = self.cache.pod(uid) if self.cache is not None else None
        message = (
            f"holds {-(-used // MIB)} MiB on GPU {uuid} by NVML without a Tessera allocation there: it "
            "reached the GPU around Tessera (no hook, no quota), e.g. through NVIDIA_VISIBLE_DEVICES"
        )
        if node_pod is None:
            log.warning("pod with UID %s %s", uid, message)
            return
        view = node_pod.view
        log.warning("pod %s %s", pod_ref(view.namespace, view.name), message)
        self._warn(PodTarget(view.namespace, view.name, view.uid), UNMANAGED_REASON, message)

    def _warn(self, target: PodTarget, reason: str, message: str) -> None:
        try:
            self.kube.warn(target, reason, message)
        except Exception as e:  # an event is told once; the log has it anyway
            log.warning(
                "pod %s: cannot record event %s: %s", pod_ref(target.namespace, target.name), reason, e
            )

    def _report_claims(
        self, uuid: str, claimed: list[Holder[ContainerDir]], checked: list[Holder[ContainerDir]]
    ) -> None:
        """Log, once per container and GPU, a region that claims more than its grant or more than the
        driver says its pod holds (beyond a CUDA context's allowance): ignored for placement."""
        seen = set()
        for before, after in zip(claimed, checked, strict=True):
            key = (before.key, uuid)
            seen.add(key)
            beyond = before.used_bytes - max(after.used_bytes, 0)
            if beyond > CONTEXT_ALLOWANCE_BYTES or before.waiting_bytes > before.grant_bytes:
                if key not in self._claims_ignored:
                    log.warning(
                        "container %s on GPU %s claims %d MiB held and %d MiB waited for; the driver and "
                        "its grant of %d MiB bear out %d MiB: the claim is ignored",
                        before.key.root.name,
                        uuid,
                        before.used_bytes // MIB,
                        before.waiting_bytes // MIB,
                        before.grant_bytes // MIB,
                        after.used_bytes // MIB,
                    )
                    self._claims_ignored.add(key)
            else:
                self._claims_ignored.discard(key)
        self._claims_ignored = {k for k in self._claims_ignored if k[1] != uuid or k in seen}

    def _evict(self, record: ServedRecord, uuid: str, shortfall: int, held: int) -> None:
        """Delete a best-effort pod that borrows memory a guaranteed container waits for, with a
        short grace period (not the Eviction API: a disruption budget must not keep memory promised
        to another pod), and say why on the pod."""
        if record.pod_uid in self._evicting:
            return
        pod = PodTarget(record.namespace, record.pod, record.pod_uid)
        message = (
            f"evicted from GPU {uuid}: guaranteed containers wait for {-(-shortfall // MIB)} MiB of "
            f"the memory best-effort pods borrow there; this pod held {-(-held // MIB)} MiB (the newest "
            "go first)"
        )
        try:
            self.kube.delete_pod(pod.namespace, pod.name, pod.uid, self.config.eviction_grace_seconds)
        except Exception as e:  # asked again at the next check
            log.warning("pod %s: cannot evict: %s", pod_ref(pod.namespace, pod.name), e)
            return
        self._evicting[pod.uid] = time.monotonic()
        log.warning("pod %s %s", pod_ref(pod.namespace, pod.name), message)
        self.evictions += 1
        if self.on_evicted is not None:
            self.on_evicted()
        try:
            self.kube.warn(pod, EVICTED_REASON, message)
        except Exception as e:
            log.warning("pod %s: cannot record event: %s", pod_ref(pod.namespace, pod.name), e)

    def _borrowing(self) -> bool:
        """Whether a served container borrows memory (an oversubscribed best-effort grant)."""
        with self._lock:
            return any(
                r.qos == QosClass.BEST_EFFORT and any(g.oversubscribed for g in r.gpus)
                for r in self._records.values()
            )

    def run_usage_checks(self, stop: threading.Event) -> None:
        """:meth:`check_usage` every ``--usage-tick-seconds`` while a container borrows memory, else
        every ``--usage-publish-seconds`` (only the measured use needs it then), and at once after an
        Allocate, until ``stop``."""
        last_error = ""
        while not stop.is_set():
            try:
                self.check_usage()
                last_error = ""
            except Exception as e:  # the loop must outlive any one failure; say so once
                if str(e) != last_error:
                    log.warning("checking the GPUs' use failed (retrying): %s", e)
                    last_error = str(e)
            config = self.config
            self._check_wanted.wait(
                config.usage_tick_seconds if self._borrowing() else config.usage_publish_seconds
            )
            self._check_wanted.clear()

    def run_presence_checks(self, present: Callable[[str], bool], stop: threading.Event) -> None:
        while not stop.wait(self.config.health_poll_seconds):
            for uuid in self.gpu_uuids:
                self.record_presence(uuid, present(uuid))


def _kill(pid: int) -> None:
    """SIGKILL a process over its quota; one gone meanwhile, or not ours to signal, is logged."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError) as e:
        log.warning("process %d: cannot stop it: %s", pid, e)


def _refs(records: dict[ContainerDir, ServedRecord]) -> set[ContainerRef]:
    """The containers the records say are served."""
    return {(r.pod_uid, r.container) for r in records.values()}
