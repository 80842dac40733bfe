"""What the driver says each pod holds on a GPU, and what the node agent does about it.

A container's accounting region is its own to write (docs/security.md); what NVML reports per
process (``nvmlDeviceGetComputeRunningProcesses``) it cannot forge. Each process is put in its pod by
its cgroup (``/proc/<pid>/cgroup``; the agent runs in the host's PID namespace for that, as NVML
reports host PIDs). On that word, and never on a region's:

- a pod holding more of a GPU than its quotas there allow, plus a CUDA context's allowance per
  process, is over quota (:func:`over_quota`); once it stays over for the grace period
  (:class:`OverQuotaTimer`) the agent stops it: its processes on that GPU are killed, with a Warning
  event saying why, and nothing of its neighbours is touched (or only reported: the agent's
  ``--over-quota-action report``);
- memory held by processes of pods the agent did not serve on that GPU, or of no pod at all, is
  *unmanaged*: GPU use outside Tessera (a pod that reached the GPU without the hook), reported by
  metric and event (:func:`unmanaged_bytes`).

The measured use the node publishes is taken from the same word (:mod:`deviceplugin.oversubscription`).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pynvml

from tessera.contract import MIB

log = logging.getLogger(__name__)

# CUDA contexts hold device memory the hook does not count (a few hundred MiB per process on real
# GPUs): a pod is over its quota by the driver only beyond its quotas plus this much per process.
CONTEXT_ALLOWANCE_BYTES = 512 * MIB
PROC = Path("/proc")
# The pod's UID in a cgroup path: ".../pod<uid>/<container>" (cgroupfs) or
# ".../kubepods-besteffort-pod<uid with _>.slice/..." (systemd).
_POD_IN_CGROUP = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
# The Warning event on a pod found over its quota (`kubectl describe pod` shows it).
OVER_QUOTA_REASON = "TesseraGpuMemoryOverQuota"
# The Warning event on a pod found using a GPU that Tessera did not give it.
UNMANAGED_REASON = "TesseraGpuUseUnmanaged"


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process on a GPU as the driver reports it: host PID, device memory it holds."""

    pid: int
    memory_used_bytes: int


def nvml_processes(uuid: str) -> tuple[GpuProcess, ...] | None:
    """The GPU's compute processes from NVML (the agent's session); None when NVML cannot say."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        infos = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError as e:
        log.debug("GPU %s: no per-process memory from NVML: %s", uuid, e)
        return None
    return tuple(GpuProcess(int(p.pid), int(p.usedGpuMemory or 0)) for p in infos)


def pod_uid_of(pid: int, proc: Path = PROC) -> str | None:
    """The UID of the pod whose cgroup holds the process, None if it is in no pod's (or gone)."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    found = _POD_IN_CGROUP.search(text)
    return found.group(1).replace("_", "-") if found else None


@dataclass(frozen=True, slots=True)
class PodMemory:
    """What the driver says a pod's processes hold on one GPU, and which processes (host PIDs)."""

    used_bytes: int
    pids: tuple[int, ...]

    @property
    def processes(self) -> int:
        return len(self.pids)


@dataclass(frozen=True, slots=True)
class GpuHolders:
    """One GPU's processes by the driver: per pod UID, and what processes in no pod hold."""

    pods: Mapping[str, PodMemory]
    outside_pods_bytes: int


def gpu_holders(
    uuid: str,
    processes: Callable[[str], tuple[GpuProcess, ...] | None] = nvml_processes,
    pod_of_pid: Callable[[int], str | None] = pod_uid_of,
) -> GpuHolders | None:
    """The GPU's processes by pod (a process's pod from its cgroup); None when NVML cannot say, or
    when it lists processes of which none is in a pod (the agent does not see the host's processes:
    not in the host's PID namespace)."""
    found = processes(uuid)
    if found is None:
        return None
    used: dict[str, int] = defaultdict(int)
    pids: dict[str, list[int]] = defaultdict(list)
    outside = 0
    for process in found:
        pod_uid = pod_of_pid(process.pid)
        if pod_uid is None:
            outside += process.memory_used_bytes
        else:
            used[pod_uid] += process.memory_used_bytes
            pids[pod_uid].append(process.pid)
    if found and not used:
        return None
    return GpuHolders({uid: PodMemory(used[uid], tuple(pids[uid])) for uid in used}, outside)


@dataclass(frozen=True, slots=True)
class OverQuota:
    """A pod whose processes hold more of a GPU's memory, by the driver, than its quotas allow."""

    namespace: str
    name: str
    uid: str
    gpu: str
    used_mib: int
    quota_mib: int

    @property
    def message(self) -> str:
        return (
            f"holds {self.used_mib} MiB on GPU {self.gpu} by NVML, over its quota of {self.quota_mib} MiB: "
            "its accounting region was bypassed or forged"
        )


def allowed_bytes(quota_bytes: int, held: PodMemory) -> int:
    """What a pod may hold on a GPU by the driver: its quotas there and a context per process."""
    return quota_bytes + CONTEXT_ALLOWANCE_BYTES * held.processes


def over_quota(quotas: Mapping[str, int], holders: GpuHolders) -> dict[str, PodMemory]:
    """The pods (by UID, among those with ``quotas`` on the GPU, in bytes) holding more than allowed."""
    return {
        uid: held
        for uid, held in holders.pods.items()
        if uid in quotas and held.used_bytes > allowed_bytes(quotas[uid], held)
    }


def unmanaged_bytes(served: Collection[str], holders: GpuHolders) -> dict[str, int]:
    """Per pod UID, what pods that have no quota on the GPU (``served``: the UIDs of those that do)
    hold there; processes in no pod under ``""``."""
    found = {uid: held.used_bytes for uid, held in holders.pods.items() if uid not in served}
    if holders.outside_pods_bytes:
        found[""] = holders.outside_pods_bytes
    return found


class OverQuotaTimer:
    """Since when each (pod UID, GPU) has been over quota, to act once it stays over for the grace
    period; each episode is acted on once."""

    def __init__(self, grace_seconds: float) -> None:
        self._grace = grace_seconds
        self._since: dict[tuple[str, str], float] = {}
        self._acted: set[tuple[str, str]] = set()

    def due(self, over: Iterable[tuple[str, str]], now: float) -> list[tuple[str, str]]:
        """Of ``over`` (the pairs over quota now), those over for the grace period and not yet acted
        on; a pair back within its quota starts afresh."""
        current = set(over)
        self._since = {key: self._since.get(key, now) for key in current}
        self._acted &= current
        ready = [key for key in current if now - self._since[key] >= self._grace and key not in self._acted]
        self._acted.update(ready)
        return sorted(ready)
