"""The containers this node serves: their records in the state dir, the files Allocate writes for
them (limits files included), and what Allocate holds while it decides.

Every part that reads and changes the records together (Allocate's matching, the kubelet's
confirmations, the clean-up, a live resize, the usage check's new quotas) does so under
:attr:`ServedContainers.lock`, so two Allocate calls never pick the same container and a record is
never corrected while a match reads it. The methods take the lock themselves (it is re-entrant); a
part holds it across several calls where they must see one state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from deviceplugin.config import Config
from deviceplugin.identity import corrected_records
from deviceplugin.matching import ContainerRef, InFlight, PodView, grants_text
from deviceplugin.mps_daemon import mps_paths
from deviceplugin.oversubscription import GpuPlan
from deviceplugin.podresources import Owners
from deviceplugin.response import ContainerAnswer, answer_for, resized_grants
from deviceplugin.sharing import MpsPolicy
from hook.limits import DeviceLimit, write_limits
from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir, StateDir, create_state_dir
from tessera.contract import CONTAINER_COORDINATION_DIR, Allocation, QosClass, SharingMode, pod_ref

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PodTarget:
    """A served pod, as an event names it."""

    namespace: str
    name: str
    uid: str


class ServedContainers:
    def __init__(self, config: Config, state: StateDir, sharing: SharingMode) -> None:
        """``sharing``: the node's mode (:func:`deviceplugin.sharing.node_sharing_mode`)."""
        self.state = state
        self._config = config
        # Under MPS: each container's client settings by class, and the daemon's directories.
        self._mps_policy = MpsPolicy(config.mps_best_effort_threads)
        self._mps_paths = mps_paths(config.state_dir) if sharing == SharingMode.MPS else None
        # Guards everything below; notified when reservations end.
        self.lock = threading.Condition(threading.RLock())
        # The records in the state dir (read at start and by each clean-up, then kept with them),
        # and what they say is served.
        self._records: dict[ContainerDir, ServedRecord] = dict(state.records())
        self._served: set[ContainerRef] = _refs(self._records)
        # Containers matched from the pod cache whose pods are being confirmed with the API, and the
        # Allocate calls from a fresh list that wait for those reservations to end.
        self._reserved: set[ContainerRef] = set()
        self._fallbacks_waiting = 0
        # Containers served whose admission the kubelet has not confirmed yet: dir -> the pod
        # matched (the guess) and when it was served (monotonic).
        self._unconfirmed: dict[ContainerDir, tuple[PodView, float]] = {}
        # Each GPU's plan as of the last usage check, and the limits last written per container.
        self._plans: dict[str, GpuPlan[ContainerDir]] = {}
        self._written: dict[ContainerDir, tuple[DeviceLimit, ...]] = {}

    # ---------------------------------------------------------------------------------------------
    # Reading

    def records(self) -> dict[ContainerDir, ServedRecord]:
        with self.lock:
            return dict(self._records)

    def record(self, where: ContainerDir) -> ServedRecord | None:
        with self.lock:
            return self._records.get(where)

    def served(self) -> set[ContainerRef]:
        with self.lock:
            return set(self._served)

    def taken(self) -> set[ContainerRef]:
        """The containers served or reserved: none of them may be matched again."""
        with self.lock:
            return self._served | self._reserved

    def borrowing(self) -> bool:
        """Whether a served container borrows memory (an oversubscribed best-effort grant)."""
        with self.lock:
            return any(
                r.qos == QosClass.BEST_EFFORT and any(g.oversubscribed for g in r.gpus)
                for r in self._records.values()
            )

    def oversubscribed_gpus(self) -> frozenset[str]:
        """The GPUs whose memory best-effort containers borrow, as of the last usage check."""
        with self.lock:
            return frozenset(uuid for uuid, plan in self._plans.items() if plan.oversubscribed)

    # ---------------------------------------------------------------------------------------------
    # Reservations (Allocate from the pod cache)

    def fallback_waiting(self) -> bool:
        """Whether an Allocate from a fresh list waits for the reservations to end (then no new
        ones are made)."""
        with self.lock:
            return self._fallbacks_waiting > 0

    def reserve(self, refs: set[ContainerRef]) -> None:
        with self.lock:
            self._reserved |= refs

    def release(self, refs: set[ContainerRef]) -> None:
        with self.lock:
            self._reserved -= refs
            self.lock.notify_all()

    def wait_for_reservations(self) -> None:
        """Wait until no container is reserved; the caller holds the lock."""
        self._fallbacks_waiting += 1
        try:
            self.lock.wait_for(lambda: not self._reserved)
        finally:
            self._fallbacks_waiting -= 1

    # ---------------------------------------------------------------------------------------------
    # Serving

    def serve(self, chosen: Sequence[InFlight], requests: Sequence[Sequence[str]]) -> list[ContainerAnswer]:
        """Write the containers' files and records; the answers for the kubelet."""
        config = self._config
        with self.lock:
            answers = [
                answer_for(
                    c,
                    ids,
                    self.state,
                    self.state.unused_container(c.pod.uid, c.container),
                    config.hook_library,
                    mps=self._mps_paths,
                    devices=config.device_list_strategy,
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
            return answers

    def _write_files(self, answer: ContainerAnswer) -> None:
        create_state_dir(answer.where)
        for slot in answer.slots:
            self.state.create_slot(slot)
        self._write_limits(answer.where, answer.record)
        self.state.write_record(answer.where, answer.record)

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

    # ---------------------------------------------------------------------------------------------
    # Confirmation by the kubelet, and clean-up

    def unconfirmed(self) -> list[tuple[ContainerDir, PodView, float]]:
        """The containers served that the kubelet has not named yet: dir, pod matched, when served."""
        with self.lock:
            return [(where, pod, at) for where, (pod, at) in self._unconfirmed.items()]

    def settle(self, where: ContainerDir) -> None:
        """Stop waiting for the kubelet to name this container."""
        with self.lock:
            self._unconfirmed.pop(where, None)

    def correct(
        self, records: Sequence[tuple[ContainerDir, ServedRecord]], owners: Owners, pods: Sequence[PodView]
    ) -> None:
        """Rewrite the records whose devices the kubelet gave to another pod or container than the
        record names, and the served set with them."""
        uids = {(p.namespace, p.name): p.uid for p in pods}
        with self.lock:
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

    def remove_except(self, live: set[str]) -> list[Path]:
        """Remove the state of containers whose pods (by UID) are not ``live``, and read the
        records again; returns what was removed."""
        with self.lock:
            removed = self.state.remove_containers_except(live)
            self._records = dict(self.state.records())
            self._served = _refs(self._records)
            return removed

    # ---------------------------------------------------------------------------------------------
    # Limits: live resize and borrowed memory

    def resize(self, changed: Mapping[str, Allocation]) -> int:
        """Rewrite the limits file and the record of every served container whose pod (by UID) has
        a changed allocation giving it other quotas on the same GPUs; returns how many."""
        count = 0
        with self.lock:
            for where, record in list(self._records.items()):
                allocation = changed.get(record.pod_uid)
                grants = None if allocation is None else resized_grants(record, allocation)
                if grants is None:
                    continue
                resized = record.model_copy(update={"gpus": grants})
                self._write_limits(where, resized)
                self.state.write_record(where, resized)
                self._records[where] = resized
                log.info(
                    "pod %s container %s resized: %s",
                    pod_ref(resized.namespace, resized.pod),
                    resized.container,
                    grants_text(grants),
                )
                count += 1
        return count

    def apply_plans(self, plans: dict[str, GpuPlan[ContainerDir]]) -> None:
        """Take the GPUs' new plans and rewrite the limits of the containers they change."""
        with self.lock:
            self._plans = plans
            for where, record in self._records.items():
                if self._written.get(where) != self._limits_for(where, record):
                    self._write_limits(where, record)
            for gone in set(self._written) - set(self._records):
                del self._written[gone]

    def _limits_for(self, where: ContainerDir, record: ServedRecord) -> tuple[DeviceLimit, ...]:
        """The container's limits: its grants, except that a best-effort container borrowing a GPU's
        memory has the quota the GPU's plan gives it, and a guaranteed container on a GPU whose memory
        is borrowed waits for it when short (docs/deviceplugin.md); under the lock."""
        wait_ms = round(self._config.shortfall_wait_seconds * 1000)
        limits = []
        for grant in record.gpus:
            limit = DeviceLimit.from_grant(grant)
            plan = self._plans.get(grant.uuid)
            if plan is not None:
                limit = replace(
                    limit,
                    memory_quota_bytes=plan.quotas.get(where, limit.memory_quota_bytes),
                    shortfall_wait_ms=wait_ms
                    if plan.oversubscribed and record.qos != QosClass.BEST_EFFORT
                    else 0,
                )
            limits.append(limit)
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
            mps=self._mps_policy.client(record.qos) if record.mps else None,
        )
        self._written[where] = limits


def _refs(records: dict[ContainerDir, ServedRecord]) -> set[ContainerRef]:
    """The containers the records say are served."""
    return {(r.pod_uid, r.container) for r in records.values()}
