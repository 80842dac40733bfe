"""The host state dir: per-container limits, accounting state and allocation records.

Layout under ``--state-dir``::

    ld.so.preload                              names the hook library; mounted read-only
    containers/<pod UID>/<container>/limits    the hook's limits; mounted read-only
    containers/<pod UID>/<container>/state/    the hook's shared accounting region; mounted read-write
    containers/<pod UID>/<container>/allocation.json
                                               what was served (pod, container, GPUs, quotas); written
                                               last, so it marks the container as served

The container sees only ``limits`` (read-only) and ``state/``: nothing it can write raises its limits.
The records survive a restart of the agent, so a restart never serves a container twice.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from tessera.contract import CONTAINER_HOOK_LIBRARY, GpuGrant

# Pod UIDs and container names are DNS labels / UUIDs in the API; anything else is refused so a
# name can never point outside the state dir.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class ServedRecord(BaseModel):
    """What the agent gave one container: the exporter's labels and quotas come from here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str
    pod: str
    pod_uid: str
    container: str
    gpus: tuple[GpuGrant, ...]
    # The slice IDs the kubelet allocated: how the pod-resources API names this container.
    device_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ContainerDir:
    root: Path

    @property
    def limits(self) -> Path:
        return self.root / "limits"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def record(self) -> Path:
        return self.root / "allocation.json"


@dataclass(frozen=True, slots=True)
class StateDir:
    root: Path

    @property
    def ld_so_preload(self) -> Path:
        return self.root / "ld.so.preload"

    @property
    def containers(self) -> Path:
        return self.root / "containers"

    def container(self, pod_uid: str, container: str) -> ContainerDir:
        for what, name in (("pod UID", pod_uid), ("container name", container)):
            if not _SAFE_NAME.match(name):
                raise ValueError(f"{what}: {name!r} cannot name a directory")
        return ContainerDir(self.containers / pod_uid / container)

    def prepare(self) -> None:
        """Create the dirs and the ld.so.preload file that every container mounts."""
        self.containers.mkdir(parents=True, exist_ok=True)
        write_atomically(self.ld_so_preload, f"{CONTAINER_HOOK_LIBRARY}\n", mode=0o644)

    def served(self) -> set[tuple[str, str]]:
        """(pod UID, container) of every container that has a record."""
        return {(r.pod_uid, r.container) for _, r in self.records()}

    def records(self) -> Iterator[tuple[ContainerDir, ServedRecord]]:
        for record_file in sorted(self.containers.glob("*/*/allocation.json")):
            try:
                record = ServedRecord.model_validate_json(record_file.read_text())
            except (OSError, ValidationError):
                continue  # half-removed by a concurrent clean-up, or not ours
            yield ContainerDir(record_file.parent), record

    def write_record(self, where: ContainerDir, record: ServedRecord) -> None:
        write_atomically(where.record, record.model_dump_json(), mode=0o644)

    def remove_containers_except(self, live_uids: Collection[str]) -> list[Path]:
        """Delete the dirs of containers whose pod is no longer on the node; returns the dirs removed.

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
        return removed


def write_atomically(path: Path, text: str, *, mode: int) -> None:
    """Write through a temporary file and a rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
