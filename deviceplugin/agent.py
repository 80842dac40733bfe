"""The node agent's state and the operations the adapters call.

Holds the discovered GPUs and their health, serialises the matching of Allocate calls, writes the
per-container files and reports results to the API. Decisions are made by the pure modules
(:mod:`deviceplugin.devices`, :mod:`deviceplugin.matching`, :mod:`deviceplugin.response`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from deviceplugin.config import Config
from deviceplugin.devices import GpuHealth, VirtualDevice, virtual_devices, with_health
from deviceplugin.identity import corrected_records
from deviceplugin.kube import Kube, KubeUnavailableError
from deviceplugin.matching import (
    AllocationError,
    BrokenPod,
    ContainerRef,
    InFlight,
    PodView,
    match_container,
    pod_complete,
    preferred_devices,
    snapshot,
)
from deviceplugin.podresources import container_devices
from deviceplugin.response import ContainerAnswer, answer_for
from deviceplugin.statedir import StateDir
from hook.limits import write_limits
from tessera.contract import GpuInfo, Phase, dump_inventory, format_time, now, pod_ref

log = logging.getLogger(__name__)

FAILED_REASON = "TesseraAllocateFailed"
# How often served records are checked against the kubelet and dead containers' state removed.
TIDY_SECONDS = 5.0
# The container's processes run as any user; the hook in each must create and map the region file.
STATE_DIR_MODE = 0o777


class Agent:
    def __init__(self, config: Config, gpus: tuple[GpuInfo, ...], kube: Kube, state: StateDir) -> None:
        self.config = config
        self.kube = kube
        self.state = state
        self._gpus = gpus
        self._uuids = frozenset(g.uuid for g in gpus)
        self._health = {g.uuid: GpuHealth() for g in gpus}
        self._changed = threading.Condition()
        self._version = 0
        self._allocate_lock = threading.Lock()
        self._published_inventory: str | None = None

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
        fail the pod's admission, while Allocate can still decide once the API is back)."""
        try:
            pods = self.kube.pending_pods()
        except KubeUnavailableError as e:
            log.warning("GetPreferredAllocation without the pods: %s", e)
            pods = []
        state = snapshot(
            pods,
            keys=self.config.keys,
            node=self.config.node_name,
            node_gpus=self._uuids,
            served=self.state.served(),
            now=now(),
            inflight_timeout=self.config.inflight_timeout,
        )
        return preferred_devices(available, must_include, gpu_count, state)

    def allocate(self, requests: Sequence[Sequence[str]]) -> list[ContainerAnswer]:
        """Answers for the containers of one Allocate call, in order; raises :class:`AllocationError`.

        Matching and the served records happen under one lock, so two concurrent calls never pick
        the same container; the pod list may be read before it because records, not phases, say
        what is served.
        """
        pods = self.kube.pending_pods()
        try:
            chosen, answers, served = self._match_and_record(pods, requests)
        except AllocationError as e:
            log.warning("Allocate refused: %s", e.message)
            self._report_failure(e.concerned, e.message)
            raise
        for pod in {c.pod.uid: c.pod for c in chosen}.values():
            if pod_complete(pod, served):
                self._set_phase(pod, Phase.ALLOCATED)
        for c in chosen:
            log.info(
                "Allocate: pod %s container %s gets %s",
                c.pod.ref,
                c.container,
                ", ".join(f"{g.uuid} ({g.memory_mib} MiB, {g.cores}% cores)" for g in c.grants),
            )
        return answers

    def _match_and_record(
        self, pods: Sequence[PodView], requests: Sequence[Sequence[str]]
    ) -> tuple[list[InFlight], list[ContainerAnswer], set[ContainerRef]]:
        with self._allocate_lock:
            served = self.state.served()
            state = snapshot(
                pods,
                keys=self.config.keys,
                node=self.config.node_name,
                node_gpus=self._uuids,
                served=served,
                now=now(),
                inflight_timeout=self.config.inflight_timeout,
            )
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
            answers = [
                answer_for(c, ids, self.state, self.config.hook_library)
                for c, ids in zip(chosen, requests, strict=True)
            ]
            for answer in answers:
                self._write_files(answer)
            return chosen, answers, served | {c.ref for c in chosen}

    def _write_files(self, answer: ContainerAnswer) -> None:
        answer.where.state.mkdir(parents=True, exist_ok=True)
        os.chmod(answer.where.state, STATE_DIR_MODE)
        write_limits(answer.where.limits, answer.limits)
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
        """Correct served records from the kubelet's pod-resources API, and remove the state of
        containers whose pods are gone. Under the Allocate lock: matching reads the records."""
        uids = self.kube.pod_uids()
        owners = container_devices(self.config.pod_resources_socket, self.config.keys.vgpu)
        with self._allocate_lock:
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
            removed = self.state.remove_containers_except(set(uids.values()))
        if removed:
            log.info("removed the state of %d container(s) whose pods are gone", len(removed))

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
