"""Prepare and unprepare claims on this node, with every step checkpointed on disk.

Per prepared claim, under the state dir (:class:`nodeagent.statedir.StateDir`)::

    claims/<claim UID>/limits          the hook's limits, read-only in the claim's containers
    claims/<claim UID>/state/          the hook's accounting region, shared by those containers
    claims/<claim UID>/prepared.json   what NodePrepareResources answered; written last
    coordination/<GPU UUID>/<class>/<claim UID>
                                       the claim's slot in each of its GPUs' coordination areas

and the claim's CDI spec in the CDI dir. The claim's QoS class is decided at prepare from the pods it
is reserved for then (draplugin/claims.py) and written into its limits file, as the device plugin
writes a container's. A claim with a record is prepared: a repeated call (the
kubelet retries, or the driver restarted) answers from the record without asking the API server.
A claim without one is prepared from scratch, overwriting whatever a call cut short left (every file
is written through a rename). Nothing is written before the claim is checked; a write that fails
removes what the call wrote. Unprepare removes the spec, then the claim's directory; both are
idempotent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import urllib3
from kubernetes import client

from draplugin.cdi import cdi_device_id, render_spec, spec_file
from draplugin.claims import (
    ClaimRef,
    ReservedPod,
    claim_class,
    claim_containers,
    overcommit,
    plan_claim,
    reserved_pods,
)
from hook.limits import write_limits
from nodeagent.kubeapi import EventTarget
from nodeagent.records import GpuQuota, PreparedDevice, PreparedRecord, RecordError, dump_record, load_record
from nodeagent.statedir import ContainerDir, StateDir, create_state_dir
from tessera.contract import CONTAINER_COORDINATION_DIR, ContractError, ContractKeys, GpuInfo, pod_priority
from tessera.files import write_atomically
from tessera.placement.qos import QOS_LOWERED_REASON, QosThresholds

log = logging.getLogger(__name__)


class PodOfClaim(NamedTuple):
    """A pod the claim is reserved for, as read at prepare."""

    pod: ReservedPod
    priority: int
    containers: tuple[str, ...]  # those that use the claim


class ClaimReader(Protocol):
    def read_claim(self, namespace: str, name: str) -> Mapping[str, object] | None:
        """The ResourceClaim as JSON; None when it does not exist."""


class PodReader(Protocol):
    def read_pod(self, namespace: str, name: str) -> Mapping[str, object] | None:
        """The Pod as JSON; None when it does not exist."""

    def warn(self, pod: EventTarget, reason: str, message: str) -> None:
        """A Warning event on the pod."""


class Driver:
    def __init__(
        self,
        *,
        keys: ContractKeys,
        node: str,
        gpus: Sequence[GpuInfo],
        state: StateDir,
        cdi_dir: Path,
        hook_library: Path,
        claims: ClaimReader,
        pods: PodReader,
        qos: QosThresholds,
    ) -> None:
        self.keys = keys
        self.node = node
        self.gpus = tuple(gpus)
        self.state = state
        self.cdi_dir = cdi_dir
        self.hook_library = hook_library
        self._claims = claims
        self._pods = pods
        self.qos = qos
        # The kubelet may prepare a claim for a second pod while the first call is under way.
        self._lock = threading.Lock()

    def _claim_dir(self, ref: ClaimRef) -> ContainerDir:
        try:
            return self.state.claim(ref.uid)
        except ValueError as e:
            raise ContractError(f"{ref}: {e}") from None

    def recorded(self, ref: ClaimRef) -> PreparedRecord | None:
        path = self._claim_dir(ref).prepared
        try:
            record = load_record(path, PreparedRecord)
        except FileNotFoundError:
            return None
        except (OSError, RecordError) as e:
            log.warning("%s: preparing again: %s", ref, e)
            return None
        return record if record.uid == ref.uid else None

    def prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        """The claim's devices for the kubelet; raises :class:`ContractError` when it cannot be
        prepared here (the message says why) and the Kubernetes client's errors when the API server
        cannot be asked."""
        with self._lock:
            done = self.recorded(ref)
            if done is not None:
                return done.devices
            where = self._claim_dir(ref)
            claim = self._claims.read_claim(ref.namespace, ref.name)
            if claim is None:
                raise ContractError(f"{ref}: not found in the API server")
            plan = plan_claim(claim, ref, self.node, self.gpus, self.keys)
            records = [r for _, r in self.state.prepared_records()]
            if overcommit(plan, records, self.gpus):
                over = overcommit(plan, [r for r in records if self._allocated(r)], self.gpus)
                if over:
                    raise ContractError(f"{ref}: {over}")
            pods = self._read_pods(ref, plan.reserved_for)
            qos, lowered = claim_class(plan.qos, [p.priority for p in pods], self.qos, ref.namespace)
            cdi_id = cdi_device_id(self.keys, ref.uid)
            devices = tuple(
                PreparedDevice(
                    request_names=(d.request,),
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=(cdi_id,),
                    share_id=d.share_id,
                )
                for d in plan.devices
            )
            spec = spec_file(self.cdi_dir, self.keys, ref.uid)
            owner = next((p for p in pods if p.pod.uid == plan.owner_uid), None)
            slots = [(limit.uuid, self.state.claim_slot(limit.uuid, qos, ref.uid)) for limit in plan.limits]
            try:
                create_state_dir(where)
                for stale in self.state.claim_slots(ref.uid):  # of a prepare cut short
                    stale.unlink()
                for _, slot in slots:
                    self.state.create_slot(slot)
                write_limits(
                    where.limits,
                    plan.limits,
                    elastic=plan.elastic,
                    qos=qos,
                    coordination=CONTAINER_COORDINATION_DIR,
                )
                rendered = render_spec(
                    self.keys,
                    ref.uid,
                    slots=slots,
                    where=where,
                    state=self.state,
                    hook_library=self.hook_library,
                )
                write_atomically(spec, json.dumps(rendered, indent=2), mode=0o644)
                record = PreparedRecord(
                    namespace=ref.namespace,
                    name=ref.name,
                    uid=ref.uid,
                    devices=devices,
                    quotas=tuple(
                        GpuQuota(uuid=lim.uuid, memory_quota_bytes=lim.memory_quota_bytes, cores=lim.cores)
                        for lim in plan.limits
                    ),
                    pod=owner.pod.name if owner is not None else "",
                    containers=owner.containers if owner is not None else (),
                )
                write_atomically(where.prepared, dump_record(record), mode=0o644)
            except BaseException:
                self._remove(ref)
                raise
            log.info(
                "%s prepared (%s): %s",
                ref,
                qos.value,
                ", ".join(f"{lim.uuid} {lim.memory_quota_bytes} B {lim.cores}% cores" for lim in plan.limits),
            )
            if lowered:
                self._tell_lowered(ref, [p.pod for p in pods], lowered)
            return devices

    def _allocated(self, record: PreparedRecord) -> bool:
        """Whether a prepared claim is still allocated in the API server. One that is not (deleted,
        or deallocated) was not unprepared when it should have been: kube-scheduler has given its
        share again, so it holds none of its GPUs' capacity here either."""
        claim = self._claims.read_claim(record.namespace, record.name)
        metadata = None if claim is None else claim.get("metadata")
        status = None if claim is None else claim.get("status")
        allocated = (
            isinstance(metadata, Mapping)
            and metadata.get("uid") == record.uid
            and isinstance(status, Mapping)
            and bool(status.get("allocation"))
        )
        if not allocated:
            log.warning(
                "claim %s/%s (%s): prepared here but no longer allocated; its share is not counted",
                record.namespace,
                record.name,
                record.uid,
            )
        return allocated

    def _read_pods(self, ref: ClaimRef, reserved: Sequence[ReservedPod]) -> list[PodOfClaim]:
        """The claim's pods that still exist, with their priorities and their containers that use
        it; a :class:`ContractError` when none does (a pod deleted and created again under its name
        is another pod)."""
        found = []
        for pod in reserved:
            body = self._pods.read_pod(pod.namespace, pod.name)
            metadata = None if body is None else body.get("metadata")
            if body is None or not isinstance(metadata, Mapping) or metadata.get("uid") != pod.uid:
                continue
            try:
                found.append(PodOfClaim(pod, pod_priority(body), claim_containers(body, ref.name)))
            except ContractError as e:
                raise ContractError(f"{ref}: pod {pod.name}: {e}") from None
        if not found:
            raise ContractError(f"{ref}: none of the pods in status.reservedFor exists any more")
        return found

    def _tell_lowered(self, ref: ClaimRef, pods: Sequence[ReservedPod], why: str) -> None:
        """A Warning event on each pod of a claim whose class is lower than it asked for; one that
        cannot be recorded is logged (the claim is prepared: the pods run, with their granted class)."""
        for pod in pods:
            try:
                self._pods.warn(pod, QOS_LOWERED_REASON, f"{ref}: {why}")
            except (client.ApiException, OSError, urllib3.exceptions.HTTPError) as e:
                log.warning("%s: cannot tell pod %s that its class was lowered: %s", ref, pod.name, e)

    def prepared(self) -> list[PreparedRecord]:
        """Every claim prepared here, from its record (one without a readable record is being
        prepared, or will be prepared again at the kubelet's next call)."""
        with self._lock:
            return [record for _, record in self.state.prepared_records()]

    def tell_pods_on(self, device: str, reason: str, why: str) -> None:
        """A Warning event on each pod that a claim prepared here on ``device`` is reserved for (its
        ``status.reservedFor`` now); one that cannot be recorded is logged."""
        for record in self.prepared():
            if not any(d.device_name == device for d in record.devices):
                continue
            ref = ClaimRef(record.namespace, record.name, record.uid)
            try:
                claim = self._claims.read_claim(ref.namespace, ref.name)
                metadata = None if claim is None else claim.get("metadata")
                if claim is None or not isinstance(metadata, Mapping) or metadata.get("uid") != ref.uid:
                    continue  # deleted: its pods are gone too
                status = claim.get("status") or {}
                for pod in reserved_pods(status if isinstance(status, Mapping) else {}, ref):
                    self._pods.warn(pod, reason, f"{ref}: {why}")
            except (ContractError, client.ApiException, OSError, urllib3.exceptions.HTTPError) as e:
                log.warning("%s: cannot tell its pods %s: %s", ref, reason, e)

    def unprepare(self, ref: ClaimRef) -> None:
        with self._lock:
            self._remove(ref)

    def _remove(self, ref: ClaimRef) -> None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            spec_file(self.cdi_dir, self.keys, ref.uid).unlink()
        root = self._claim_dir(ref).root
        for slot in self.state.claim_slots(ref.uid):
            slot.unlink(missing_ok=True)
        if root.exists():
            shutil.rmtree(root)
            log.info("%s unprepared", ref)
