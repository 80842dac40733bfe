"""The contract between Tessera's components.

This module alone spells the resource names, the annotation keys and the JSON shapes that the device
plugin, the extender, the hook's limits file and the CLI exchange through the Kubernetes API. Every
component imports what it needs from here; none re-spells a key.

The domain (default ``tessera.io``) is set in one place: ``TESSERA_DOMAIN`` in the environment, or
:func:`keys_for` for a component given a ``--domain`` flag.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import localcontext
from enum import StrEnum
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

DEFAULT_DOMAIN = "tessera.io"
DOMAIN_ENV = "TESSERA_DOMAIN"

# The kubelet device plugin API version and the health strings it compares exactly.
DEVICE_PLUGIN_API_VERSION = "v1beta1"
HEALTHY: Literal["Healthy"] = "Healthy"
UNHEALTHY: Literal["Unhealthy"] = "Unhealthy"

# Virtual device IDs are "<GPU-UUID>::<n>", the form dcgm-exporter understands for shared GPUs.
SLICE_SEPARATOR = "::"

# Inside a container: where the device plugin mounts the hook's inputs.
# The limits file sits alone in a directory mounted read-only: the device plugin replaces it by a
# rename on a live resize, which a mount of the file itself would never show (it pins the old inode).
CONTAINER_LIMITS_DIR = "/var/run/tessera/limits.d"
CONTAINER_LIMITS_FILE = f"{CONTAINER_LIMITS_DIR}/limits"
CONTAINER_STATE_DIR = "/var/run/tessera/state"
CONTAINER_HOOK_LIBRARY = "/usr/local/tessera/libvgpu.so"
CONTAINER_LD_SO_PRELOAD = "/etc/ld.so.preload"
# The coordination areas of the container's GPUs (docs/hook.md, "QoS classes on the GPU"): the GPU's
# directory at <dir>/<uuid> (read-only), the container's own slot at <dir>/<uuid><suffix> (writable).
# The hook's copies are in hook/src/contract.h (VGPU_COORDINATION_SLOT_SUFFIX, _BYTES).
CONTAINER_COORDINATION_DIR = "/var/run/tessera/coordination"
COORDINATION_SLOT_SUFFIX = ".slot"
COORDINATION_SLOT_BYTES = 64
# On a node in MPS mode (docs/deviceplugin.md, "MPS mode"): the node's MPS control daemon's pipe
# directory (read-write: a client connects through it) and the daemon's /dev/shm (the server and its
# clients share memory through it), both mounted into every container with a GPU share.
CONTAINER_MPS_PIPE_DIR = "/var/run/tessera/mps"
CONTAINER_MPS_SHM_DIR = "/dev/shm"
# How a container's GPUs are named to the NVIDIA container toolkit: in NVIDIA_VISIBLE_DEVICES
# (``envvar``), or as mounts under this directory, one per GPU, with NVIDIA_VISIBLE_DEVICES naming
# the directory (``volume-mounts``: what a toolkit that ignores the variable from unprivileged
# containers honours, so that a pod cannot name GPUs itself; docs/install.md).
CONTAINER_DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"


class DeviceListStrategy(StrEnum):
    ENVVAR = "envvar"
    VOLUME_MOUNTS = "volume-mounts"


MAX_CORES = 100
# Quotas are MiB on the wire (resources, annotations) and bytes in the hook's limits file.
MIB = 2**20

# A Kubernetes object or request body as decoded JSON.
JsonObject = dict[str, Any]


def pod_ref(namespace: str, name: str) -> str:
    """A pod's ``namespace/name``, as messages and logs name it."""
    return f"{namespace}/{name}"


Parsed = TypeVar("Parsed")


class ContractError(ValueError):
    """Input that breaks the contract. The message names the field and the value."""


class PodShapeError(ContractError):
    """A pod whose JSON is not shaped like a Kubernetes Pod: a field of the wrong type (a list where
    an object belongs, a number for a name). The API server stores no such pod, so only a malformed
    request carries one; the message names the field."""


def _kind(value: object) -> str:
    """A JSON value's kind, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _mapping(value: object, field: str) -> Mapping[str, Any]:
    """``value`` as an object (null or absent: empty), else a PodShapeError naming ``field``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PodShapeError(f"{field}: must be an object, got {_kind(value)}")
    return value


def _sequence(value: object, field: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise PodShapeError(f"{field}: must be a list, got {_kind(value)}")
    return list(value)


class Phase(StrEnum):
    """Progress of a placement decision, written on the pod."""

    ALLOCATING = "allocating"
    ALLOCATED = "allocated"
    FAILED = "failed"


class Policy(StrEnum):
    BINPACK = "binpack"
    SPREAD = "spread"
    FRAGMENTATION = "fragmentation"


class SharingMode(StrEnum):
    """How a node's GPUs are shared (docs/install.md, "MPS node pools"), by its Node's
    :attr:`ContractKeys.node_sharing` label.

    ``timeslice``: every container's processes have contexts of their own, which the GPU time-slices.
    ``mps``: every container's processes are clients of the node's MPS control daemon; their kernels
    run side by side in one server context per GPU.
    """

    TIMESLICE = "timeslice"
    MPS = "mps"


def parse_sharing_mode(value: str, *, source: str) -> SharingMode:
    """``value`` as a :class:`SharingMode`; ``source`` names where it came from (the label and the
    node, a flag) in the :class:`ContractError` a bad value raises."""
    try:
        return SharingMode(value)
    except ValueError:
        allowed = " or ".join(m.value for m in SharingMode)
        raise ContractError(f"{source}: {value!r} is not {allowed}") from None


class QosClass(StrEnum):
    """A pod's class on a shared GPU (docs/placement.md, "QoS classes").

    ``standard``: a hard share. ``latency-critical``: a guaranteed share that goes first.
    ``best-effort``: only the time and memory the others leave.
    """

    LATENCY_CRITICAL = "latency-critical"
    STANDARD = "standard"
    BEST_EFFORT = "best-effort"


@dataclass(frozen=True, slots=True)
class ContractKeys:
    """Every resource name and annotation key, under one domain."""

    domain: str

    @property
    def vgpu(self) -> str:
        return f"{self.domain}/vgpu"

    @property
    def vgpu_memory(self) -> str:
        return f"{self.domain}/vgpu-memory"

    @property
    def vgpu_cores(self) -> str:
        return f"{self.domain}/vgpu-cores"

    @property
    def node_gpus(self) -> str:
        return f"{self.domain}/gpus"

    @property
    def node_heartbeat(self) -> str:
        return f"{self.domain}/heartbeat"

    @property
    def node_gpu_usage(self) -> str:
        """What each GPU really uses, measured by the node agent (:class:`NodeGpuUsage`)."""
        return f"{self.domain}/gpu-usage"

    @property
    def node_sharing(self) -> str:
        """A label of a Node, set by the cluster's admins per node pool: its GPUs' :class:`SharingMode`
        (absent: the node agent's ``--sharing``, by default ``timeslice``)."""
        return f"{self.domain}/sharing"

    @property
    def node_mode(self) -> str:
        """A label of a Node, set by the cluster's admins per node pool: ``dra`` where the chart's
        ``mode: mixed`` runs the DRA driver instead of the device plugin (docs/dra.md, "One mode per
        node")."""
        return f"{self.domain}/mode"

    @property
    def gpu_models(self) -> str:
        return f"{self.domain}/gpu-models"

    @property
    def gpu_models_exclude(self) -> str:
        return f"{self.domain}/gpu-models-exclude"

    @property
    def workload(self) -> str:
        return f"{self.domain}/workload"

    @property
    def min_speed(self) -> str:
        return f"{self.domain}/min-speed"

    @property
    def policy(self) -> str:
        return f"{self.domain}/policy"

    @property
    def allocation(self) -> str:
        return f"{self.domain}/allocation"

    @property
    def allocation_phase(self) -> str:
        return f"{self.domain}/allocation-phase"

    @property
    def bind_time(self) -> str:
        return f"{self.domain}/bind-time"

    @property
    def qos(self) -> str:
        return f"{self.domain}/qos"

    @property
    def resize(self) -> str:
        """A user's request for new quotas on a running pod (live resize)."""
        return f"{self.domain}/resize"

    @property
    def resize_status(self) -> str:
        """The outcome of the last resize request, written by Tessera."""
        return f"{self.domain}/resize-status"

    @property
    def resources(self) -> tuple[str, str, str]:
        return (self.vgpu, self.vgpu_memory, self.vgpu_cores)

    @property
    def preferences(self) -> tuple[str, ...]:
        """The annotations a user writes to steer placement (:func:`parse_preferences`)."""
        return (
            self.gpu_models,
            self.gpu_models_exclude,
            self.workload,
            self.min_speed,
            self.policy,
            self.qos,
        )

    @property
    def dra_driver(self) -> str:
        """The DRA driver's name: in its ResourceSlices, claim results, attributes and capacities."""
        return self.domain

    @property
    def dra_device_class(self) -> str:
        """The DeviceClass users' claims name to get a share of a GPU."""
        return f"gpu-share.{self.domain}"

    @property
    def whole_gpu(self) -> str:
        """The extended resource a pod asks in its limits for whole GPUs from the DRA driver, without
        a claim: the DeviceClass's ``extendedResourceName`` (docs/dra.md, "Whole GPUs"). Not
        :attr:`vgpu`, which the device plugin advertises and the extender places."""
        return f"{self.domain}/whole-gpu"

    @property
    def dra_config_api_version(self) -> str:
        """``apiVersion`` of the opaque per-claim configuration (:class:`GpuShareConfig`)."""
        return f"{self.domain}/v1alpha1"

    @property
    def dra_slice_digest(self) -> str:
        """On the DRA driver's ResourceSlice: a digest of the devices it last published."""
        return f"{self.domain}/devices-digest"

    @property
    def dra_unhealthy_taint(self) -> str:
        """The key of the device taint the DRA driver puts on a GPU that is unhealthy; its value says
        why (``xid-<n>``, ``gone``)."""
        return f"{self.domain}/unhealthy"

    @property
    def cdi_kind(self) -> str:
        """The CDI ``vendor/class`` of the devices the DRA driver prepares."""
        return f"{self.domain}/gpu-share"


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def keys_for(domain: str) -> ContractKeys:
    """Keys under ``domain``; refuses a domain Kubernetes would not accept as a resource prefix."""
    if len(domain) > 253 or not _DNS_SUBDOMAIN.match(domain) or "kubernetes.io" in domain:
        raise ContractError(f"domain: {domain!r} is not a DNS subdomain usable for extended resources")
    return ContractKeys(domain)


KEYS = keys_for(os.environ.get(DOMAIN_ENV, DEFAULT_DOMAIN))


# --------------------------------------------------------------------------------------------------
# DRA (docs/dra.md): the names a ResourceSlice and a claim share with the DRA driver.

DRA_MEMORY_CAPACITY = "memory"  # bytes
DRA_CORES_CAPACITY = "cores"  # percent of the GPU's time; 0 = no compute quota


class GpuShareConfig(BaseModel):
    """A claim's opaque configuration for the DRA driver (``spec.devices.config[].opaque.parameters``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    apiVersion: str  # noqa: N815 (the Kubernetes spelling)
    kind: Literal["GpuShareConfig"]
    # The hook lets the claim's containers use idle GPU time beyond their cores (docs/hook.md).
    elastic: bool = False
    # The QoS class the claim asks for, spelled as a pod's annotation spells it (QosClass's values;
    # strict validation takes no enum from JSON text); absent, the class its pods' priority grants
    # (docs/dra.md, "QoS classes of a claim").
    qos: Literal["latency-critical", "standard", "best-effort"] | None = None

    @property
    def qos_class(self) -> QosClass | None:
        return None if self.qos is None else QosClass(self.qos)


def parse_gpu_share_config(parameters: object, *, where: str, keys: ContractKeys = KEYS) -> GpuShareConfig:
    """The opaque parameters of one config entry; a :class:`ContractError` naming the field."""
    if not isinstance(parameters, Mapping):
        raise ContractError(f"{where}: expected an object, got {_kind(parameters)}")
    try:
        parsed = GpuShareConfig.model_validate(parameters, strict=True)
    except ValidationError as e:
        raise ContractError(f"{where}: {_first_error(e)}") from None
    if parsed.apiVersion != keys.dra_config_api_version:
        raise ContractError(
            f"{where}.apiVersion: {parsed.apiVersion!r} is not {keys.dra_config_api_version!r}"
        )
    return parsed


# --------------------------------------------------------------------------------------------------
# Node inventory: published by the device plugin, read by the extender.


class _Strict(BaseModel):
    # A field whose name in code (docs/glossary.md) is not its published JSON name has that name as
    # its aliases: JSON is written by it and read by it alone (_validated), code builds by the field's.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, serialize_by_alias=True)


class GpuInfo(_Strict):
    """One physical GPU as the node agent found it through NVML."""

    uuid: str = Field(min_length=1)
    index: int = Field(ge=0)
    model: str = Field(min_length=1)
    total_memory_mib: int = Field(gt=0, validation_alias="memory_mib", serialization_alias="memory_mib")
    sm_count: int = Field(ge=0)
    compute_capability: str = Field(pattern=r"^\d+\.\d+$")
    pci_bus_id: str = ""
    numa_node: int | None = None
    nvlink_peers: tuple[str, ...] = ()
    health: Literal["Healthy", "Unhealthy"] = HEALTHY
    split: int = Field(ge=1, description="virtual devices (slices) this GPU is advertised as")

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY


_INVENTORY = TypeAdapter(tuple[GpuInfo, ...])


def dump_inventory(gpus: tuple[GpuInfo, ...] | list[GpuInfo]) -> str:
    return _INVENTORY.dump_json(tuple(gpus)).decode()


def parse_inventory(text: str, *, node: str = "") -> tuple[GpuInfo, ...]:
    return _validated(_INVENTORY, text, f"node {node!r}: " if node else "", KEYS.node_gpus)


class GpuUsage(_Strict):
    """One GPU's measured use: the memory its containers hold (their accounting regions) and how busy
    it is (NVML). Best-effort pods may be placed against this instead of requests (docs/placement.md)."""

    uuid: str = Field(min_length=1)
    memory_used_mib: int = Field(ge=0)
    # The part of memory_used_mib held by guaranteed (standard, latency-critical) containers.
    guaranteed_used_mib: int = Field(ge=0)
    utilization_percent: int = Field(ge=0, le=100)

    @model_validator(mode="after")
    def _guaranteed_within_used(self) -> GpuUsage:
        if self.guaranteed_used_mib > self.memory_used_mib:
            used, guaranteed = self.memory_used_mib, self.guaranteed_used_mib
            raise ValueError(f"guaranteed_used_mib {guaranteed} exceeds memory_used_mib {used}")
        return self


class NodeGpuUsage(_Strict):
    """The node annotation ``<domain>/gpu-usage``, rewritten by the node agent as use changes."""

    time: str = Field(min_length=1)  # RFC 3339, when it was measured (format_time)
    gpus: tuple[GpuUsage, ...]


_NODE_GPU_USAGE = TypeAdapter(NodeGpuUsage)


def dump_gpu_usage(usage: NodeGpuUsage) -> str:
    return usage.model_dump_json()


def parse_gpu_usage(text: str, *, node: str = "") -> NodeGpuUsage:
    return _validated(_NODE_GPU_USAGE, text, f"node {node!r}: " if node else "", KEYS.node_gpu_usage)


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with seconds, the form Kubernetes itself writes."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str, *, field: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ContractError(f"{field}: {text!r} is not an RFC 3339 time") from None
    if moment.tzinfo is None:
        raise ContractError(f"{field}: {text!r} has no time zone")
    return moment


# --------------------------------------------------------------------------------------------------
# The decision: written by the extender at bind, read by the device plugin at Allocate.


class GpuGrant(_Strict):
    """One GPU given to one container, with the container's quotas on it."""

    uuid: str = Field(min_length=1)
    memory_quota_mib: int = Field(gt=0, validation_alias="memory_mib", serialization_alias="memory_mib")
    # Share of the GPU's time in percent; 0 = none reserved.
    cores: int = Field(ge=0, le=MAX_CORES)
    # Best-effort only: placed against the GPU's measured use, not requests. The memory is borrowed
    # from what guaranteed pods requested but leave unused, so the container's quota at any moment is
    # at most what they leave unused, and the grant counts for nothing when guaranteed pods are placed.
    oversubscribed: bool = False


class ContainerAllocation(_Strict):
    name: str = Field(min_length=1)
    gpus: tuple[GpuGrant, ...] = Field(min_length=1)

    @field_validator("gpus")
    @classmethod
    def _distinct(cls, gpus: tuple[GpuGrant, ...]) -> tuple[GpuGrant, ...]:
        uuids = [g.uuid for g in gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"a container's GPUs must be distinct, got {uuids}")
        return gpus


class Allocation(_Strict):
    """The pod annotation ``<domain>/allocation``: which GPUs each container gets, on which node, and
    the pod's QoS class as the extender decided it (a container cannot raise its own: only Tessera
    writes this annotation)."""

    node: str = Field(min_length=1)
    containers: tuple[ContainerAllocation, ...] = Field(min_length=1)
    qos: QosClass = QosClass.STANDARD

    @model_validator(mode="after")
    def _only_best_effort_oversubscribes(self) -> Allocation:
        if self.qos != QosClass.BEST_EFFORT and any(
            g.oversubscribed for c in self.containers for g in c.gpus
        ):
            raise ValueError(
                f"only a best-effort allocation may be oversubscribed, this one is {self.qos.value}"
            )
        return self

    def for_container(self, name: str) -> ContainerAllocation | None:
        return next((c for c in self.containers if c.name == name), None)


def dump_allocation(allocation: Allocation) -> str:
    return allocation.model_dump_json()


_ALLOCATION = TypeAdapter(Allocation)


def parse_allocation(text: str, *, pod: str = "") -> Allocation:
    return _validated(_ALLOCATION, text, f"pod {pod}: " if pod else "", KEYS.allocation)


def _validated(adapter: TypeAdapter[Parsed], text: str, where: str, annotation: str) -> Parsed:
    """``text`` (an annotation's JSON) as ``adapter``'s type, or a ContractError naming where it was
    read, the annotation and the first field in error."""
    try:
        return adapter.validate_json(text, by_name=False)
    except ValidationError as e:
        raise ContractError(f"{where}annotation {annotation}: {_first_error(e)}") from None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    value = err.get("input")
    shown = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
    return f"{loc or 'value'}: {err['msg']} (got {shown})"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# --------------------------------------------------------------------------------------------------
# A pod's requests, parsed into typed per-container requests.


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """What one container asks for: ``gpu_count`` distinct GPUs, each with this memory and compute share.

    ``memory_mib`` None means the whole GPU's memory; ``cores`` None means no compute reserved.
    """

    name: str
    gpu_count: int
    memory_quota_mib: int | None
    cores: int | None


@dataclass(frozen=True, slots=True)
class PodPreferences:
    """Placement wishes a user writes as pod annotations."""

    models: tuple[str, ...] = ()
    models_exclude: tuple[str, ...] = ()
    workload: str | None = None
    min_speed: float | None = None
    policy: Policy | None = None
    # None: not written on the pod (the class then follows the pod's priority, docs/placement.md).
    qos: QosClass | None = None


@dataclass(frozen=True, slots=True)
class PodRequest:
    containers: tuple[ContainerRequest, ...]
    preferences: PodPreferences

    @property
    def wants_gpu(self) -> bool:
        return bool(self.containers)


# Enough significant digits for the largest suffix factor (1024**6 has 19) on top of the number's.
_SUFFIX_DIGITS = 20
# The syntax of a Kubernetes quantity: a decimal number, then a suffix (letters) or a decimal
# exponent. Checked here only so that bad input is worded as what it is; the value, suffixes
# included, is the official client's (kubernetes.utils.parse_quantity).
# Kubernetes keeps a quantity in an int64; anything longer than this is no quantity it accepts.
_MAX_QUANTITY = 2**63 - 1
_MAX_DIGITS = 18
_MAX_QUANTITY_TEXT = 64
_QUANTITY = re.compile(r"^(?:[+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)([a-zA-Z]*|[eE][+-]?[0-9]+)$")


def parse_integer_quantity(value: object, *, field: str) -> int:
    """A Kubernetes quantity that must be a whole number (as extended resources must be).

    ``"4096"``, ``4096``, ``"4Ki"`` and ``"4000m"`` are integers; ``"0.5"`` and ``"1500m"`` are not.
    """
    if isinstance(value, bool):
        raise ContractError(f"{field}: {value!r} must be an integer")
    if isinstance(value, int):
        if abs(value) > _MAX_QUANTITY:
            raise ContractError(f"{field}: {value!r} is out of range")
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= _MAX_DIGITS:
        return int(value)  # the common case ("4096"), without the regular expression and Decimal
    if not isinstance(value, str | float):
        raise ContractError(f"{field}: {_shown(value)} is not a quantity")
    text = str(value).strip()
    if len(text) > _MAX_QUANTITY_TEXT:
        raise ContractError(
            f"{field}: {_shown(value)} is not a quantity (over {_MAX_QUANTITY_TEXT} characters)"
        )
    match = _QUANTITY.match(text)
    if not match:
        raise ContractError(f"{field}: {value!r} is not a quantity")
    # Imported here: kubernetes.utils loads the whole API client (0.2 s), which the components that
    # only read the contract (the hook's writer, the simulator) never need for a plain "4096".
    from kubernetes.utils import parse_quantity  # noqa: PLC0415

    try:
        with localcontext() as exact:
            exact.prec = len(text) + _SUFFIX_DIGITS  # no rounding: "1.0000…01Ki" is no integer
            amount = parse_quantity(text)
            in_range = amount.is_finite() and abs(amount) <= _MAX_QUANTITY
    except ArithmeticError:  # decimal's Overflow: an exponent past its context's
        in_range = False
    except ValueError:
        raise ContractError(f"{field}: {value!r} has an unknown suffix {match.group(1)!r}") from None
    if not in_range:
        raise ContractError(f"{field}: {value!r} is out of range")
    if amount != amount.to_integral_value():
        raise ContractError(f"{field}: {value!r} must be an integer")
    return int(amount)


def _shown(value: object) -> str:
    """``value`` for a message: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _container_request(container: object, where: str, keys: ContractKeys) -> ContainerRequest | None:
    container = _mapping(container, where)
    raw_name = container.get("name")
    if raw_name is not None and not isinstance(raw_name, str):
        raise PodShapeError(f"{where}: name: must be a string, got {_kind(raw_name)}")
    name = raw_name or ""
    resources = _mapping(container.get("resources"), f"container {name!r}: resources")
    limits = _mapping(resources.get("limits"), f"container {name!r}: resources.limits")
    requests = _mapping(resources.get("requests"), f"container {name!r}: resources.requests")
    values: dict[str, int] = {}
    for resource in keys.resources:
        field = f"container {name!r}: {resource}"
        limit = limits.get(resource)
        request = requests.get(resource)
        if limit is None and request is None:
            continue
        parsed_limit = None if limit is None else parse_integer_quantity(limit, field=field)
        parsed_request = None if request is None else parse_integer_quantity(request, field=field)
        if parsed_limit is not None and parsed_request is not None and parsed_limit != parsed_request:
            raise ContractError(
                f"{field}: request {request!r} differs from limit {limit!r}; they must be equal"
            )
        values[resource] = parsed_limit if parsed_limit is not None else parsed_request  # type: ignore[assignment]
    if not values:
        return None
    vgpu = values.get(keys.vgpu)
    memory = values.get(keys.vgpu_memory)
    cores = values.get(keys.vgpu_cores)
    if vgpu is None:
        asked = ", ".join(r for r in (keys.vgpu_memory, keys.vgpu_cores) if r in values)
        raise ContractError(f"container {name!r}: {asked} asked without {keys.vgpu}")
    if vgpu < 1:
        raise ContractError(f"container {name!r}: {keys.vgpu}: {vgpu} must be at least 1")
    if memory is not None and memory <= 0:
        raise ContractError(f"container {name!r}: {keys.vgpu_memory}: {memory} must be more than 0 MiB")
    if cores is not None and not 1 <= cores <= MAX_CORES:
        raise ContractError(f"container {name!r}: {keys.vgpu_cores}: {cores} is outside 1..{MAX_CORES}")
    return ContainerRequest(name=name, gpu_count=vgpu, memory_quota_mib=memory, cores=cores)


# A pod's placement wishes are its owner's text and are echoed into every node's filter reason, the
# pod's condition, events and kube-scheduler's log: bounded here, where they are read. NVML's model
# names are about 20-40 characters ("NVIDIA H100 80GB HBM3"); workload classes are short words.
MAX_PREFERENCE_NAME = 64
MAX_MODELS = 32


def _bounded_name(name: str, key: str) -> str:
    if len(name) > MAX_PREFERENCE_NAME:
        raise ContractError(
            f"annotation {key}: {_shown(name)} is longer than {MAX_PREFERENCE_NAME} characters"
        )
    return name


def _split_models(text: str, key: str) -> tuple[str, ...]:
    models = tuple(_bounded_name(part.strip(), key) for part in text.split(",") if part.strip())
    if len(models) > MAX_MODELS:
        raise ContractError(f"annotation {key}: {len(models)} models, at most {MAX_MODELS}")
    return models


_Choice = TypeVar("_Choice", bound=StrEnum)


def _choice(annotations: Mapping[str, str], key: str, kind: type[_Choice]) -> _Choice | None:
    """The annotation ``key`` as one of ``kind``'s values (case and spaces aside); None when absent."""
    raw = annotations.get(key)
    if raw is None:
        return None
    try:
        return kind(raw.strip().lower())
    except ValueError:
        allowed = ", ".join(v.value for v in kind)
        raise ContractError(f"annotation {key}: {_shown(raw)} is not one of {allowed}") from None


def parse_preferences(annotations: Mapping[str, str] | None, keys: ContractKeys = KEYS) -> PodPreferences:
    annotations = _mapping(annotations, "metadata.annotations")
    for key in keys.preferences:
        value = annotations.get(key)
        if value is not None and not isinstance(value, str):
            raise PodShapeError(f"annotation {key}: must be a string, got {_kind(value)}")
    min_speed: float | None = None
    raw_speed = annotations.get(keys.min_speed)
    if raw_speed is not None:
        try:
            min_speed = float(raw_speed)
        except ValueError:
            raise ContractError(f"annotation {keys.min_speed}: {_shown(raw_speed)} is not a number") from None
        if not 0 < min_speed < float("inf"):
            raise ContractError(f"annotation {keys.min_speed}: {_shown(raw_speed)} must be a positive number")
    policy = _choice(annotations, keys.policy, Policy)
    qos = _choice(annotations, keys.qos, QosClass)
    workload = annotations.get(keys.workload)
    if workload is not None and not workload.strip():
        raise ContractError(f"annotation {keys.workload}: {_shown(workload)} is empty")
    return PodPreferences(
        models=_split_models(annotations.get(keys.gpu_models) or "", keys.gpu_models),
        models_exclude=_split_models(annotations.get(keys.gpu_models_exclude) or "", keys.gpu_models_exclude),
        workload=_bounded_name(workload.strip(), keys.workload) if workload else None,
        min_speed=min_speed,
        policy=policy,
        qos=qos,
    )


def parse_container_requests(
    pod: Mapping[str, Any], keys: ContractKeys = KEYS
) -> tuple[ContainerRequest, ...]:
    """The GPU requests of a pod's containers (given as Kubernetes API JSON), in spec order: the
    order the kubelet allocates them in. Containers that ask for no GPU are left out.

    Raises :class:`ContractError` naming the container, the resource and the value.
    """
    pod = _mapping(pod, "pod")
    spec = _mapping(pod.get("spec"), "spec")
    containers: list[ContainerRequest] = []
    for i, container in enumerate(_sequence(spec.get("containers"), "spec.containers")):
        parsed = _container_request(container, f"spec.containers[{i}]", keys)
        if parsed is not None:
            containers.append(parsed)
    for i, container in enumerate(_sequence(spec.get("initContainers"), "spec.initContainers")):
        if _container_request(container, f"spec.initContainers[{i}]", keys) is not None:
            raise ContractError(
                f"init container {container.get('name')!r}: {keys.vgpu} is supported on containers only"
            )
    return tuple(containers)


def parse_pod_request(pod: Mapping[str, Any], keys: ContractKeys = KEYS) -> PodRequest:
    """Typed requests of a pod given as Kubernetes API JSON (camelCase keys, as on the wire).

    Raises :class:`ContractError` naming the container, the resource and the value.
    """
    pod = _mapping(pod, "pod")
    containers = parse_container_requests(pod, keys)
    metadata = _mapping(pod.get("metadata"), "metadata")
    preferences = parse_preferences(metadata.get("annotations"), keys)
    return PodRequest(containers=containers, preferences=preferences)


def pod_priority(pod: Mapping[str, Any]) -> int:
    """A pod's priority as kube-scheduler reads it: ``spec.priority`` (the API server sets it from the
    pod's PriorityClass), 0 when absent. Raises :class:`PodShapeError` when it is not an integer."""
    spec = _mapping(_mapping(pod, "pod").get("spec"), "spec")
    priority = spec.get("priority")
    if priority is None:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise PodShapeError(f"spec.priority: must be an integer, got {_kind(priority)}")
    return priority


# --------------------------------------------------------------------------------------------------
# Live resize: the user's request (annotation ``<domain>/resize``) and Tessera's answer
# (``<domain>/resize-status``). docs/placement.md, "Live resize".


class QuotaChange(_Strict):
    """New quotas for one container, on each of its GPUs; None keeps the current one."""

    memory_quota_mib: int | None = Field(
        default=None, gt=0, validation_alias="memory_mib", serialization_alias="memory_mib"
    )
    cores: int | None = Field(default=None, ge=1, le=MAX_CORES)


class ResizeRequest(_Strict):
    """What ``<domain>/resize`` asks: new quotas by container name; ``""`` names the pod's only GPU
    container (the form without a container name)."""

    containers: dict[str, QuotaChange] = Field(min_length=1)


class ResizeOutcome(StrEnum):
    APPLIED = "applied"
    REFUSED = "refused"


class ResizeStatus(_Strict):
    """``<domain>/resize-status``: the outcome of the last resize request, written by Tessera."""

    request: str  # the annotation's text it answers
    outcome: ResizeOutcome
    message: str
    time: str


_RESIZE_FIELDS = {"memory": "memory_mib", "cores": "cores"}


def _resize_entry(text: str, where: str) -> QuotaChange:
    """``memory=6144,cores=40`` (either, or both) as a QuotaChange."""
    values: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = (piece.strip() for piece in part.partition("="))
        if not sep or name not in _RESIZE_FIELDS:
            raise ContractError(
                f"{where}: {_shown(part.strip())} is not memory=<MiB> or cores=<1-{MAX_CORES}>"
            )
        if _RESIZE_FIELDS[name] in values:
            raise ContractError(f"{where}: {name} is given twice")
        if not (value.isascii() and value.isdigit() and len(value) <= _MAX_DIGITS):
            raise ContractError(f"{where}: {name}: {_shown(value)} is not a whole number")
        number = int(value)
        if name == "memory" and number <= 0:
            raise ContractError(f"{where}: memory: {number} must be more than 0 MiB")
        if name == "cores" and not 1 <= number <= MAX_CORES:
            raise ContractError(f"{where}: cores: {number} is outside 1..{MAX_CORES}")
        values[_RESIZE_FIELDS[name]] = number
    return QuotaChange(**values)


def parse_resize(text: object, keys: ContractKeys = KEYS) -> ResizeRequest:
    """The annotation ``<domain>/resize``: ``memory=6144,cores=40`` for a pod with one GPU container,
    or ``<container>:memory=6144;<container>:cores=40`` naming each container resized (memory in MiB
    per GPU, cores in percent of each GPU). Raises :class:`ContractError` naming the annotation, the
    container and the value."""
    where = f"annotation {keys.resize}"
    if not isinstance(text, str):
        raise PodShapeError(f"{where}: must be a string, got {_kind(text)}")
    if len(text) > _MAX_RESIZE_TEXT:
        raise ContractError(f"{where}: {_shown(text)} is longer than {_MAX_RESIZE_TEXT} characters")
    containers: dict[str, QuotaChange] = {}
    entries = [entry.strip() for entry in text.split(";") if entry.strip()]
    if not entries:
        raise ContractError(f"{where}: {_shown(text)} asks nothing (expected memory=<MiB>,cores=<percent>)")
    for entry in entries:
        name, sep, quotas = entry.rpartition(":")
        name = name.strip()
        if sep and not _SAFE_CONTAINER.match(name):
            raise ContractError(f"{where}: {_shown(name)} is not a container name")
        if (name in containers) or (len(entries) > 1 and not name):
            raise ContractError(
                f"{where}: {_shown(text)} must name each container once (<container>:memory=...;...)"
            )
        containers[name] = _resize_entry(quotas, f"{where}: {f'container {name!r}' if name else 'value'}")
    return ResizeRequest(containers=containers)


_MAX_RESIZE_TEXT = 4096
_SAFE_CONTAINER = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

_RESIZE_STATUS = TypeAdapter(ResizeStatus)


def dump_resize_status(status: ResizeStatus) -> str:
    return status.model_dump_json()


def parse_resize_status(text: str, *, pod: str = "") -> ResizeStatus:
    return _validated(_RESIZE_STATUS, text, f"pod {pod}: " if pod else "", KEYS.resize_status)


def slice_id(uuid: str, n: int) -> str:
    return f"{uuid}{SLICE_SEPARATOR}{n}"


def slice_gpu(device_id: str) -> str:
    """The physical GPU UUID of a virtual device ID."""
    uuid, sep, n = device_id.rpartition(SLICE_SEPARATOR)
    if not sep or not uuid or not n.isdigit():
        raise ContractError(f"device ID: {device_id!r} is not of the form <GPU-UUID>{SLICE_SEPARATOR}<n>")
    return uuid


def now() -> datetime:
    return datetime.now(UTC)
