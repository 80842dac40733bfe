"""Pure logic: what one allocated ResourceClaim gives its containers on this node.

The claim's allocation (``status.allocation.devices``) lists, per request, the device kube-scheduler
chose and, with consumable capacity, how much of its ``memory`` and ``cores`` the claim consumes.
A result without ``consumedCapacity`` (consumable capacity off) consumes what the request policy's
defaults say. The opaque config entries for this driver (``GpuShareConfig``) apply to the whole
claim: its containers share one limits file.

A claim's QoS class follows the pods' rule (docs/placement.md, "QoS class of a pod",
:mod:`tessera.placement.qos`): its config's ``qos`` plays the pod annotation's part, and the priority
that grants a class is the lowest of the pods the claim is reserved for (``status.reservedFor``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from draplugin.slices import capacity_of, defaults_for, device_name
from hook.limits import DeviceLimit
from nodeagent.records import PreparedRecord
from tessera.contract import (
    DRA_CORES_CAPACITY,
    DRA_MEMORY_CAPACITY,
    MIB,
    ContractError,
    ContractKeys,
    GpuInfo,
    GpuShareConfig,
    QosClass,
    parse_gpu_share_config,
    parse_integer_quantity,
)
from tessera.placement.qos import QosThresholds, qos_class, qos_lowered

# Why the driver does not prepare a claim yet (docs/dra.md, "Allocated past a device's capacity"):
# the phrase of its error, which the kubelet reports on the pod.
OVERCOMMITTED = "claims allocated past its capacity"


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepareResources."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"claim {self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One result of the claim's allocation that this driver serves on this node."""

    request: str
    pool: str
    device: str
    share_id: str | None
    uuid: str
    memory_quota_bytes: int
    cores: int


@dataclass(frozen=True, slots=True)
class ReservedPod:
    """A pod the claim is reserved for (in the claim's namespace, as the API server requires)."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    ref: ClaimRef
    devices: tuple[AllocatedDevice, ...]
    limits: tuple[DeviceLimit, ...]
    elastic: bool
    qos: QosClass | None  # the class its config asks for; None: the class its pods' priority grants
    reserved_for: tuple[ReservedPod, ...]
    # The UID of the pod the claim was made for from its ResourceClaimTemplate (its controlling
    # owner), whose alone it is for its life; None for a claim any pod of its namespace may share.
    owner_uid: str | None = None


def _object(value: object, field: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ContractError(f"{field}: expected an object, got {value!r}")
    return value


def _list(value: object, field: str) -> Sequence[object]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ContractError(f"{field}: expected a list, got {value!r}")
    return value


def _consumed(result: Mapping[str, object], gpu: GpuInfo, where: str) -> tuple[int, int]:
    consumed = _object(result.get("consumedCapacity") or {}, f"{where}.consumedCapacity")
    defaults = defaults_for(gpu)
    memory, cores = defaults.memory_quota_bytes, defaults.cores
    if DRA_MEMORY_CAPACITY in consumed:
        memory = parse_integer_quantity(
            consumed[DRA_MEMORY_CAPACITY], field=f"{where}.consumedCapacity.{DRA_MEMORY_CAPACITY}"
        )
    if DRA_CORES_CAPACITY in consumed:
        cores = parse_integer_quantity(
            consumed[DRA_CORES_CAPACITY], field=f"{where}.consumedCapacity.{DRA_CORES_CAPACITY}"
        )
    return memory, cores


def _share_config(allocation: Mapping[str, object], keys: ContractKeys) -> GpuShareConfig | None:
    """The claim's GpuShareConfig: each entry is checked, the last one holds (the claim's own come
    after its class's)."""
    found = None
    for n, entry in enumerate(_list(allocation.get("config"), "status.allocation.devices.config")):
        where = f"status.allocation.devices.config[{n}]"
        opaque = _object(entry, where).get("opaque")
        if opaque is None:
            continue
        opaque = _object(opaque, f"{where}.opaque")
        if opaque.get("driver") != keys.dra_driver:
            continue
        found = parse_gpu_share_config(opaque.get("parameters"), where=f"{where}.opaque.parameters")
    return found


def reserved_pods(status: Mapping[str, object], ref: ClaimRef) -> tuple[ReservedPod, ...]:
    """The pods in ``status.reservedFor`` (other consumers, any API group's, grant no class)."""
    pods = []
    for n, raw in enumerate(_list(status.get("reservedFor"), f"{ref}: status.reservedFor")):
        consumer = _object(raw, f"{ref}: status.reservedFor[{n}]")
        if consumer.get("resource") == "pods" and not consumer.get("apiGroup"):
            pods.append(ReservedPod(ref.namespace, str(consumer.get("name")), str(consumer.get("uid"))))
    return tuple(pods)


def claim_class(
    asked: QosClass | None, priorities: Sequence[int], thresholds: QosThresholds, namespace: str
) -> tuple[QosClass, str]:
    """The claim's class, and why it is lower than asked ("" when it is not): the pods' rule, with
    the lowest priority among the claim's pods (``priorities``, at least one), as a class granted to
    all of them is the least any of them is granted."""
    priority = min(priorities)
    return (
        qos_class(asked, priority, thresholds, namespace),
        qos_lowered(asked, priority, thresholds, namespace),
    )


def plan_claim(
    claim: Mapping[str, object], ref: ClaimRef, node: str, gpus: Sequence[GpuInfo], keys: ContractKeys
) -> ClaimPlan:
    """The limits of ``claim`` on this node; a :class:`ContractError` naming the field when the claim
    cannot be prepared here (nothing is written before this succeeds)."""
    metadata = _object(claim.get("metadata"), f"{ref}: metadata")
    if metadata.get("uid") != ref.uid:
        raise ContractError(f"{ref}: the API server has uid {metadata.get('uid')!r} for it (a newer claim)")
    status = _object(claim.get("status") or {}, f"{ref}: status")
    if not status.get("allocation"):
        raise ContractError(f"{ref}: status.allocation is empty: the claim is not allocated")
    allocation = _object(
        _object(status["allocation"], f"{ref}: status.allocation").get("devices") or {},
        f"{ref}: status.allocation.devices",
    )
    by_name = {device_name(g): g for g in gpus}
    devices: list[AllocatedDevice] = []
    for n, raw in enumerate(_list(allocation.get("results"), "status.allocation.devices.results")):
        where = f"{ref}: status.allocation.devices.results[{n}]"
        result = _object(raw, where)
        if result.get("driver") != keys.dra_driver:
            continue
        if result.get("pool") != node:
            raise ContractError(f"{where}.pool: {result.get('pool')!r} is not this node's pool {node!r}")
        name = str(result.get("device"))
        gpu = by_name.get(name)
        if gpu is None:
            raise ContractError(f"{where}.device: {name!r} is not a GPU of node {node!r}")
        memory, cores = _consumed(result, gpu, where)
        share_id = result.get("shareID")
        devices.append(
            AllocatedDevice(
                request=str(result.get("request")),
                pool=node,
                device=name,
                share_id=str(share_id) if share_id is not None else None,
                uuid=gpu.uuid,
                memory_quota_bytes=memory,
                cores=cores,
            )
        )
    if not devices:
        raise ContractError(f"{ref}: no device of driver {keys.dra_driver!r} is allocated to it")
    reserved_for = reserved_pods(status, ref)
    if not reserved_for:
        # The kubelet prepares a claim only for a pod it is reserved for: this one is not in use.
        raise ContractError(f"{ref}: status.reservedFor names no pod: the claim is not in use")
    try:
        config = _share_config(allocation, keys)
    except ContractError as e:
        raise ContractError(f"{ref}: {e}") from None
    # Two requests of the claim on one GPU: its containers share one limits entry for that GPU.
    per_gpu: dict[str, DeviceLimit] = {}
    for d in devices:
        before = per_gpu.get(d.uuid, DeviceLimit(d.uuid, 0, 0))
        per_gpu[d.uuid] = DeviceLimit(
            d.uuid, before.memory_quota_bytes + d.memory_quota_bytes, before.cores + d.cores
        )
    limits = tuple(per_gpu.values())
    for limit in limits:
        try:
            limit.validate()
        except ContractError as e:
            raise ContractError(f"{ref}: {e}") from None
    return ClaimPlan(
        ref=ref,
        devices=tuple(devices),
        limits=limits,
        elastic=config is not None and config.elastic,
        qos=None if config is None else config.qos_class,
        reserved_for=reserved_for,
        owner_uid=_owner_pod(metadata),
    )


def overcommit(plan: ClaimPlan, prepared: Iterable[PreparedRecord], gpus: Sequence[GpuInfo]) -> str:
    """Why preparing ``plan`` beside the claims already ``prepared`` here would give one of its GPUs'
    claims more than the GPU has ("" when it fits).

    kube-scheduler never allocates past a device's capacity, as it knows the device. It can lose one
    allocation, though: a bind whose answer an API server restart cut off, when the bind in fact
    succeeded, makes it undo the pod's claims in its cache while the claim stays allocated, and it
    gives the same capacity again. This node prepares every claim on its GPUs and so sees both: it
    prepares the one that does not fit only once others are unprepared (the kubelet retries)."""
    by_uuid = {g.uuid: g for g in gpus}
    records = [r for r in prepared if r.uid != plan.ref.uid]
    for limit in plan.limits:
        gpu = by_uuid[limit.uuid]
        capacity = capacity_of(gpu)
        beside = [(r, q) for r in records for q in r.quotas if q.uuid == limit.uuid]
        memory = limit.memory_quota_bytes + sum(q.memory_quota_bytes for _, q in beside)
        cores = limit.cores + sum(q.cores for _, q in beside)
        if memory > capacity.memory_bytes or cores > capacity.cores:
            names = ", ".join(f"{r.namespace}/{r.name}" for r, _ in beside) or "none"
            return (
                f"{device_name(gpu)} ({gpu.uuid}) would give its claims {memory // MIB} MiB of its "
                f"{capacity.memory_bytes // MIB} and {cores} of its {capacity.cores} cores with this one "
                f"({limit.memory_quota_bytes // MIB} MiB, {limit.cores} cores) beside those prepared on it "
                f"({names}): {OVERCOMMITTED}; preparing it once enough of them are unprepared"
            )
    return ""


def _owner_pod(metadata: Mapping[str, object]) -> str | None:
    """The UID of the pod that controls the claim (the ResourceClaim controller makes a claim from a
    pod's template with that pod as its controller); only labels come of it."""
    for owner in _entries(metadata.get("ownerReferences")):
        if owner.get("kind") == "Pod" and owner.get("apiVersion") == "v1" and owner.get("controller") is True:
            return str(owner.get("uid"))
    return None


def _entries(value: object) -> list[Mapping[str, object]]:
    """The objects of a list in a pod, anything else skipped."""
    return [e for e in value if isinstance(e, Mapping)] if isinstance(value, list) else []


def claim_containers(pod: Mapping[str, object], claim: str) -> tuple[str, ...]:
    """The names of the pod's containers that use ``claim``: through the entry of the pod's
    ``spec.resourceClaims`` that names it, or whose claim made from a template it is
    (``status.resourceClaimStatuses``). Only labels come of this: what cannot be read counts as no
    container."""
    spec = pod.get("spec")
    status = pod.get("status")
    if not isinstance(spec, Mapping):
        return ()
    made = {
        e.get("name"): e.get("resourceClaimName")
        for e in _entries(status.get("resourceClaimStatuses") if isinstance(status, Mapping) else None)
    }
    entries = {
        e.get("name")
        for e in _entries(spec.get("resourceClaims"))
        if (e.get("resourceClaimName") or made.get(e.get("name"))) == claim
    }
    names = []
    for container in _entries(spec.get("initContainers")) + _entries(spec.get("containers")):
        resources = container.get("resources")
        uses = _entries(resources.get("claims")) if isinstance(resources, Mapping) else []
        if entries and any(use.get("name") in entries for use in uses):
            names.append(str(container.get("name")))
    return tuple(names)
