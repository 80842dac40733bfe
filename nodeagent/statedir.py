"""The host state dir of either node agent: per-container (or per-claim) limits, accounting state
and records.

Layout under ``--state-dir``::

    agent.lock                                 held (flock) by the one node agent running, which
                                               writes who it is (nodeagent/nodelock.py)
    ld.so.preload                              names the hook library; mounted read-only
    containers/<pod UID>/<container>/limits.d/limits
                                               the hook's limits, alone in a directory mounted
                                               read-only (a live resize replaces the file by a
                                               rename, which the container sees only through a
                                               mount of the directory)
    containers/<pod UID>/<container>/state/    the hook's shared accounting region; mounted read-write
    containers/<pod UID>/<container>/allocation.json
                                               what was served (pod, container, GPUs, quotas): a
                                               versioned record (nodeagent/records.py), written
                                               last, so it marks the container as served
    coordination/<GPU UUID>/<QoS class>/<pod UID>_<container>
                                               the container's slot of the GPU's coordination area
                                               (docs/hook.md, "QoS classes on the GPU"); the GPU's
                                               directory is mounted read-only in each container on it,
                                               the container's own slot writable
    coordination/<GPU UUID>/<QoS class>/<claim UID>
                                               a prepared DRA claim's slot, its containers' one (a
                                               UID has no underscore: never a container's name)
    claims/<claim UID>/                        a prepared DRA claim's files, laid out as a
                                               container's, its record in prepared.json
                                               (draplugin/driver.py)

The container sees only ``limits.d/`` (read-only), ``state/``, its GPUs' coordination directories
(read-only) and its own slots: nothing it can write raises its limits or its class.
The records survive a restart of the agent, so a restart never serves a container twice.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from hook.limits import CONTAINER_REGION_FILE
from hook.region import RegionError, RegionUsage, read_region
from nodeagent.records import PreparedRecord, RecordError, ServedRecord, dump_record, load_record
from tessera.contract import (
    CONTAINER_HOOK_LIBRARY,
    CONTAINER_STATE_DIR,
    COORDINATION_SLOT_BYTES,
    QosClass,
)
from tessera.files import write_atomically

# Pod UIDs and container names are DNS labels / UUIDs in the API; anything else is refused so a
# name can never point outside the state dir.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# A slot is named <pod UID>_<container>: neither a UUID nor a DNS label has an underscore.
_SLOT_SEPARATOR = "_"
# A slot is written by the container's user, whoever that is, through the one writable mount of it.
SLOT_MODE = 0o666
# The container's processes run as any user; the hook in each must create and map the region file.
STATE_DIR_MODE = 0o777


log = logging.getLogger(__name__)

# Unreadable records already reported: the records are read on every publish and every usage tick.
_reported: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _reported:
        _reported.add(message)
        log.warning("%s", message)


# The region's path inside the container's state dir (the hook reads it from the limits file).
REGION_NAME = CONTAINER_REGION_FILE.removeprefix(CONTAINER_STATE_DIR + "/")


def _check_names(*named: tuple[str, str]) -> None:
    for what, name in named:
        if not _SAFE_NAME.match(name):
            raise ValueError(f"{what}: {name!r} cannot name a directory")


@dataclass(frozen=True, slots=True)
class ContainerDir:
    root: Path

    @property
    def limits_dir(self) -> Path:
        return self.root / "limits.d"

    @property
    def limits(self) -> Path:
        return self.limits_dir / "limits"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def record(self) -> Path:
        return self.root / "allocation.json"

    @property
    def prepared(self) -> Path:
        """A prepared claim's record (the DRA driver's; a container's dir has none)."""
        return self.root / "prepared.json"

    @property
    def region(self) -> Path:
        """The container's accounting region, which its processes' hook writes."""
        return self.state / REGION_NAME

    def usage(self) -> RegionUsage | None:
        """What the region says; None before any process used a GPU, or (logged) when it cannot be
        read: the container wrote it, and may have broken it."""
        if not self.region.exists():
            return None
        try:
            return read_region(self.region)
        except RegionError as e:
            log.warning("%s", e)
            return None


@dataclass(frozen=True, slots=True)
class StateDir:
    root: Path

    @property
    def ld_so_preload(self) -> Path:
        return self.root / "ld.so.preload"

    @property
    def containers(self) -> Path:
        return self.root / "containers"

    @property
    def coordination(self) -> Path:
        return self.root / "coordination"

    @property
    def claims(self) -> Path:
        return self.root / "claims"

    def claim(self, claim_uid: str) -> ContainerDir:
        """The files of one prepared DRA claim: its containers share one limits file and state."""
        _check_names(("claim UID", claim_uid))
        return ContainerDir(self.claims / claim_uid)

    def container(self, pod_uid: str, container: str) -> ContainerDir:
        _check_names(("pod UID", pod_uid), ("container name", container))
        return ContainerDir(self.containers / pod_uid / container)

    def unused_container(self, pod_uid: str, container: str) -> ContainerDir:
        """A dir for a container about to be served: ``<pod UID>/<container>``, or when that is
        taken ``<pod UID>/<container>.<n>`` (a container name has no dot). Taken it is when the
        kubelet gave that dir to another pod than the one matched (deviceplugin/identity.py): the
        pod matched then is served again later, into a dir of its own."""
        where = self.container(pod_uid, container)
        n = 0
        while where.root.exists():
            n += 1
            where = self.container(pod_uid, f"{container}.{n}")
        return where

    def coordination_area(self, gpu_uuid: str) -> Path:
        """The GPU's coordination area: one directory per class, holding its containers' slots."""
        _check_names(("GPU UUID", gpu_uuid))
        return self.coordination / gpu_uuid

    def coordination_slot(self, gpu_uuid: str, qos: QosClass, pod_uid: str, container: str) -> Path:
        _check_names(("pod UID", pod_uid), ("container name", container))
        return self.coordination_area(gpu_uuid) / qos.value / f"{pod_uid}{_SLOT_SEPARATOR}{container}"

    def claim_slot(self, gpu_uuid: str, qos: QosClass, claim_uid: str) -> Path:
        """A prepared claim's slot: one for all its containers, as they share its limits."""
        _check_names(("claim UID", claim_uid))
        return self.coordination_area(gpu_uuid) / qos.value / claim_uid

    def claim_slots(self, claim_uid: str) -> list[Path]:
        """The claim's slots on every GPU, whatever their class."""
        _check_names(("claim UID", claim_uid))
        return sorted(self.coordination.glob(f"*/*/{claim_uid}"))

    @staticmethod
    def create_slot(slot: Path) -> None:
        """A zeroed slot (idle), writable by the container's user through its own mount; the
        directories above it are the node agent's alone."""
        slot.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomically(slot, bytes(COORDINATION_SLOT_BYTES), mode=SLOT_MODE)

    def prepare(self) -> None:
        """Create the dirs and the ld.so.preload file that every container mounts."""
        self.containers.mkdir(parents=True, exist_ok=True)
        self.coordination.mkdir(mode=0o755, exist_ok=True)
        write_atomically(self.ld_so_preload, f"{CONTAINER_HOOK_LIBRARY}\n", mode=0o644)

    def records(self) -> Iterator[tuple[ContainerDir, ServedRecord]]:
        for record_file in sorted(self.containers.glob("*/*/allocation.json")):
            record = self.record(ContainerDir(record_file.parent))
            if record is not None:
                yield ContainerDir(record_file.parent), record

    def prepared_records(self) -> Iterator[tuple[ContainerDir, PreparedRecord]]:
        """The prepared claims' records; one that cannot be read is said once and skipped, as is one
        naming another claim than its dir."""
        for record_file in sorted(self.claims.glob("*/prepared.json")):
            where = ContainerDir(record_file.parent)
            try:
                record = load_record(record_file, PreparedRecord)
            except FileNotFoundError:  # unprepared meanwhile
                continue
            except (OSError, RecordError) as e:
                _warn_once(str(e))
                continue
            if record.uid == where.root.name:
                yield where, record

    @staticmethod
    def record(where: ContainerDir) -> ServedRecord | None:
        """The container's record; None when it has none (removed by a clean-up, or not ours), or
        when it cannot be read (said once per file and reason: the others are still read)."""
        try:
            return load_record(where.record, ServedRecord)
        except FileNotFoundError:
            return None
        except (OSError, RecordError) as e:
            _warn_once(str(e))
            return None

    def write_record(self, where: ContainerDir, record: ServedRecord) -> None:
        write_atomically(where.record, dump_record(record), mode=0o644)

    @staticmethod
    def remove_record(where: ContainerDir) -> None:
        where.record.unlink(missing_ok=True)

    def remove_containers_except(self, live_uids: Collection[str]) -> list[Path]:
        """Delete the dirs of containers whose pod is no longer on the node, and their coordination
        slots; returns what was removed.

        A dir belongs to the pod its record names (see :mod:`deviceplugin.identity`), else to the
        pod UID in its path.
        """
        owners = {where.root: record.pod_uid for where, record in self.records()}
        removed = []
        for container_dir in sorted(self.containers.glob("*/*")):
            if owners.get(container_dir, container_dir.parent.name) not in live_uids:
                shutil.rmtree(container_dir, ignore_errors=True)
                removed.append(container_dir)
        for pod_dir in self.containers.iterdir() if self.containers.is_dir() else ():
            if pod_dir.is_dir() and not any(pod_dir.iterdir()):
                pod_dir.rmdir()
        # A slot lives as long as its container's dir (it is named like it, and mounted like it:
        # what it belongs to is what the dir's record says).
        for slot in sorted(self.coordination.glob("*/*/*")):
            pod_uid, _, container = slot.name.partition(_SLOT_SEPARATOR)
            if not (self.containers / pod_uid / container).is_dir():
                slot.unlink(missing_ok=True)
                removed.append(slot)
        return removed


def create_state_dir(where: ContainerDir) -> None:
    """The hook's accounting directory, writable by whichever user the container runs as."""
    where.state.mkdir(parents=True, exist_ok=True)
    os.chmod(where.state, STATE_DIR_MODE)
