"""The node agent's state and the operations the adapters call.

Holds the discovered GPUs and their health, serialises the matching of Allocate calls, writes the
per-container files and reports results to the API. Decisions are made by the pure modules
(:mod:`deviceplugin.devices`, :mod:`deviceplugin.matching`, :mod:`deviceplugin.response`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from deviceplugin.config import Config
from deviceplugin.devices import GpuHealth, VirtualDevice, virtual_devices, with_health
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
from deviceplugin.phases import PhaseWriter
from deviceplugin.podcache import PodCache
from deviceplugin.podresources import container_devices
from deviceplugin.response import ContainerAnswer, answer_for
from deviceplugin.statedir import StateDir, create_state_dir
from hook.limits import write_limits
from tessera.contract import (
    CONTAINER_COORDINATION_DIR,
    GpuInfo,
    Phase,
    dump_inventory,
    format_time,
    now,
    pod_ref,
)
from tessera.inflight import is_allocating

log = logging.getLogger(__name__)

FAILED_REASON = "TesseraAllocateFailed"
# How often served records are checked against the kubelet and dead containers' state removed.
TIDY_SECONDS = 5.0


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
    ) -> None:
        """``cache``: the pods on the node, read by Allocate before the API (None: the API only).
        ``phases``: writes the ``allocated`` phase after the answer; whoever runs the agent runs
        its loop (``phases.run``), or drains it."""
        self.config = config
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
        # What the records in the state dir say is served (read once, then kept with them).
        self._served: set[ContainerRef] = state.served()
        # Containers matched from the cache whose pods are being confirmed with the API.
        self._reserved: set[ContainerRef] = set()
        self._fallbacks_waiting = 0
        self._published_inventory: str | None = None
        # Allocate calls answered from the cache and from a fresh list; why the cache could not.
        self.cache_answers = 0
        self.api_answers = 0
        self.api_reasons: Counter[str] = Counter()

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
        API confirms its pod (as Allocate does); otherwise from a fresh list of the node's pods."""
        pods = self.cache.pending_pods() if self.cache is not None else None
        if pods is not None:
            state = self._snapshot(pods, self._taken())
            first = next((c for c in state.in_flight if c.key.gpu_count == gpu_count), None)
            try:
                if first is not None and not first.stale and self._confirmed([first.pod]):
                    return preferred_devices(available, must_include, gpu_count, state)
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
        answer, by :class:`deviceplugin.phases.PhaseWriter`.
        """
        served = self._allocate_from_cache(requests)
        if served is None:
            served = self._allocate_from_api(requests)
        chosen, answers = served
        with self._lock:
            complete = [
                p for p in {c.pod.uid: c.pod for c in chosen}.values() if pod_complete(p, self._served)
            ]
        for pod in complete:
            self.phases.submit(pod, Phase.ALLOCATED)
        for c in chosen:
            log.info(
                "Allocate: pod %s container %s gets %s",
                c.pod.ref,
                c.container,
                ", ".join(f"{g.uuid} ({g.memory_mib} MiB, {g.cores}% cores)" for g in c.grants),
            )
        return answers

    def _allocate_from_cache(
        self, requests: Sequence[Sequence[str]]
    ) -> tuple[list[InFlight], list[ContainerAnswer]] | None:
        """The answers from the pod cache, or None when it cannot answer for sure: not synced, no
        match, a stale match (a fresh pod it has not seen yet would come first), or a matched pod
        the API no longer shows as the cache does."""
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
        try:
            try:
                confirmed = self._confirmed([c.pod for c in chosen])
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
            answer_for(c, ids, self.state, self.config.hook_library)
            for c, ids in zip(chosen, requests, strict=True)
        ]
        for answer in answers:
            self._write_files(answer)
        self._served |= {c.ref for c in chosen}
        return answers

    def _confirmed(self, pods: Sequence[PodView]) -> bool:
        """Whether the API shows each pod as the cache does: still there, pending, not being
        deleted, with the same UID, allocation, phase, bind time and GPU containers. Then the pod is
        in flight for the extender too, and by the rule every in-flight container of another pod
        with the same GPU count has the matched container's key (however far the cache lags)."""
        keys = self.config.keys
        fields = (keys.allocation, keys.allocation_phase, keys.bind_time)
        for pod in {p.uid: p for p in pods}.values():
            fresh = self._reads.read_pod(pod.namespace, pod.name)
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

    def _write_files(self, answer: ContainerAnswer) -> None:
        create_state_dir(answer.where)
        for slot in answer.slots:
            self.state.create_slot(slot)
        write_limits(
            answer.where.limits, answer.limits, qos=answer.qos, coordination=CONTAINER_COORDINATION_DIR
        )
        self.state.write_record(answer.where, answer.record)

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
        if heartbeat or patch:
            patch[keys.node_heartbeat] = format_time(now())
        if not patch:
            return False
        self.kube.annotate_node(patch)
        self._published_inventory = inventory
        return True

    def tidy_state(self) -> None:
        """Correct served records from the kubelet's pod-resources API, remove the state of
        containers whose pods are gone, and ask again for the ``allocated`` phase of pods served
        in full whose phase is still ``allocating`` (a write lost with a restart of the agent).
        Under the Allocate lock: matching reads the records."""
        with self._lock:
            served_before = set(self._served)
        pods = self.kube.node_pods()
        uids = {(p.view.namespace, p.view.name): p.view.uid for p in pods}
        owners = container_devices(self.config.pod_resources_socket, self.config.keys.vgpu)
        with self._lock:
            if owners is not None:
                for where, old, new in corrected_records(list(self.state.records()), owners, uids):
                    self.state.write_record(where, new)
                    log.info(
                        "%s: the kubelet gave its devices to %s container %s, not %s container %s",
                        where.root,
                        pod_ref(new.namespace, new.pod),
                        new.container,
                        pod_ref(old.namespace, old.pod),
                        old.container,
                    )
            # Pods served since the list began are alive though the list may not show them.
            live = set(uids.values()) | {uid for uid, _ in self._served - served_before}
            removed = self.state.remove_containers_except(live)
            self._served = self.state.served()
            served = set(self._served)
        if removed:
            log.info("removed the state of %d container(s) whose pods are gone", len(removed))
        for pod in pods:
            view = pod.view
            if (
                view.gpu_containers
                and view.request_error is None
                and is_allocating(view.annotations.get(self.config.keys.allocation_phase))
                and pod_complete(view, served)
                and self.phases.submit(view, Phase.ALLOCATED)
            ):
                log.info("pod %s: served in full, phase still allocating: setting it", view.ref)

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

    def run_presence_checks(self, present: Callable[[str], bool], stop: threading.Event) -> None:
        while not stop.wait(self.config.health_poll_seconds):
            for uuid in self.gpu_uuids:
                self.record_presence(uuid, present(uuid))
