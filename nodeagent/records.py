"""The agents' records on disk (what was served, what was prepared), and the one place that reads
them back.

A record is a JSON object whose ``version`` names its schema, as dra-example-driver's checkpoint
names its own::

    {"version": "v1", "namespace": "team-a", "pod": "train-0", ...}

A file without ``version`` was written before records had one: it is "v0". :func:`load_record`
knows every version it can read and upgrades an older record to the current one, step by step; a
record of a version it does not know (a newer agent's, read after a rollback) is refused with a
:class:`RecordError` naming the file and the version. A change to a record's fields adds a version
here, with the step that upgrades the one before it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from tessera.contract import GpuGrant, QosClass

RECORD_VERSION = "v2"
VERSION_FIELD = "version"
# The version of a record written before records had one.
UNVERSIONED = "v0"

Fields = dict[str, Any]
# Each older version, the version it upgrades to and how: v1 only added the version field; v2 added
# a prepared record's quotas, pod and containers, which a v1 record has none of (its claim has no
# per-container series until it is prepared again).
_UPGRADES: dict[str, tuple[str, Callable[[Fields], Fields]]] = {
    UNVERSIONED: ("v1", lambda fields: fields),
    "v1": ("v2", lambda fields: fields),
}
READABLE_VERSIONS = (*_UPGRADES, RECORD_VERSION)

Record = TypeVar("Record", bound=BaseModel)


class RecordError(ValueError):
    """A record that cannot be read; the message names the file and why."""


class ServedRecord(BaseModel):
    """What the device plugin gave one container (``allocation.json``): the exporter's labels and
    quotas come from here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str
    pod: str
    pod_uid: str
    container: str
    gpus: tuple[GpuGrant, ...]
    # The slice IDs the kubelet allocated: how the pod-resources API names this container.
    device_ids: tuple[str, ...] = ()
    # The pod's class (a record of before classes: standard), and when it was served (Unix time; 0
    # before this was kept): best-effort containers that borrow memory are evicted newest first.
    qos: QosClass = QosClass.STANDARD
    served_at: float = 0.0
    # Served on a node in MPS mode: the container has the daemon's pipe directory and /dev/shm, and
    # its limits file keeps its `mps` line for its life, whatever the node's mode later.
    mps: bool = False


class PreparedDevice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


class GpuQuota(BaseModel):
    """A prepared claim's quotas on one GPU, which its containers share (its limits file's line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: str
    memory_quota_bytes: int
    cores: int


class PreparedRecord(BaseModel):
    """What the DRA driver answered NodePrepareResources for one claim (``prepared.json``), and what
    the claim's series are labelled and measured against: its quotas, and the pod it was made for
    from its template (whose alone it is; "" for a claim any pod of its namespace may share) with
    that pod's containers that use it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]
    quotas: tuple[GpuQuota, ...] = ()
    pod: str = ""
    containers: tuple[str, ...] = ()


def dump_record(record: BaseModel) -> str:
    """The record's file content, at the current version."""
    return json.dumps(
        {VERSION_FIELD: RECORD_VERSION, **record.model_dump(mode="json")}, separators=(",", ":")
    )


def load_record(path: Path, model: type[Record]) -> Record:
    """The record in ``path``, upgraded to the current version; raises :class:`OSError` when the
    file cannot be read and :class:`RecordError` when its content cannot be."""
    text = path.read_text()
    try:
        fields = json.loads(text)
    except ValueError as e:
        raise RecordError(f"{path}: not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise RecordError(f"{path}: not a JSON object")
    version = fields.pop(VERSION_FIELD, UNVERSIONED)
    if version not in READABLE_VERSIONS:
        raise RecordError(
            f"{path}: record version {version!r} is not one this agent reads "
            f"({', '.join(READABLE_VERSIONS)}); written by a newer agent?"
        )
    while version != RECORD_VERSION:
        version, upgrade = _UPGRADES[version]
        fields = upgrade(fields)
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise RecordError(f"{path}: not a {model.__name__}: {e}") from None
