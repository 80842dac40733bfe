"""The driver's word acted on (deviceplugin/driveruse.py): a pod that stays over its quota by NVML
is stopped after a grace period (its processes on that GPU killed) or only reported, and a pod that
uses a GPU Tessera did not give it is told, once."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from deviceplugin.config import OVER_QUOTA_STOP, Config
from deviceplugin.driveruse import (
    OVER_QUOTA_REASON,
    UNMANAGED_REASON,
    GpuHolders,
    OverQuota,
    OverQuotaTimer,
    PodMemory,
    over_quota,
    unmanaged_bytes,
)
from deviceplugin.kube import Kube
from deviceplugin.podcache import PodCache
from deviceplugin.served import PodTarget
from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir
from tessera.contract import MIB, pod_ref

log = logging.getLogger(__name__)


def _kill(pid: int) -> None:
    """SIGKILL a process over its quota; one gone meanwhile, or not ours to signal, is logged."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError) as e:
        log.warning("process %d: cannot stop it: %s", pid, e)


@dataclass(frozen=True, slots=True)
class Driver:
    """What NVML says, per GPU by UUID (None where it cannot say), and how a process is stopped:
    utilisation in percent; what each pod's processes hold (deviceplugin/driveruse.py); free
    memory in bytes. Over-quota pods are stopped by killing their processes on the GPU (host PIDs:
    the agent runs in the host's PID namespace). ``clock``: the over-quota grace's (monotonic)."""

    utilization: Callable[[str], int | None] = lambda _: None
    holders: Callable[[str], GpuHolders | None] = lambda _: None
    free_memory: Callable[[str], int | None] = lambda _: None
    kill: Callable[[int], None] = _kill
    clock: Callable[[], float] = field(default=time.monotonic)


class DriverChecks:
    def __init__(self, config: Config, kube: Kube, driver: Driver, cache: PodCache | None = None) -> None:
        """``cache``: names the pods the driver shows on a GPU without a grant there (None: such a
        pod is logged by UID only)."""
        self._config = config
        self._kube = kube
        self._driver = driver
        self._cache = cache
        # Only the usage checks' thread calls :meth:`check`: no lock.
        self._over_quota = OverQuotaTimer(config.over_quota_grace_seconds)
        self._unmanaged_told: set[tuple[str, str]] = set()

    def check(
        self, records: Mapping[ContainerDir, ServedRecord], drivers: Mapping[str, GpuHolders | None]
    ) -> None:
        """Stop pods that stay over their quota by the driver (or report them), and tell pods that
        use a GPU Tessera did not give them (deviceplugin/driveruse.py)."""
        quotas: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        pods: dict[str, ServedRecord] = {}
        for record in records.values():
            pods[record.pod_uid] = record
            for grant in record.gpus:
                quotas[grant.uuid][record.pod_uid] += grant.memory_quota_mib * MIB
        over: dict[tuple[str, str], PodMemory] = {}
        unmanaged: set[tuple[str, str]] = set()
        for uuid, driver in drivers.items():
            if driver is None:
                continue
            for uid, held in over_quota(quotas[uuid], driver).items():
                over[uid, uuid] = held
            for uid, used in unmanaged_bytes(quotas[uuid].keys(), driver).items():
                if uid and used:
                    unmanaged.add((uid, uuid))
                    if (uid, uuid) not in self._unmanaged_told:
                        self._tell_unmanaged(uid, uuid, used)
        self._unmanaged_told = unmanaged
        for uid, uuid in self._over_quota.due(over, self._driver.clock()):
            record = pods[uid]
            held = over[uid, uuid]
            found = OverQuota(
                record.namespace, record.pod, uid, uuid, held.used_bytes // MIB, quotas[uuid][uid] // MIB
            )
            if self._config.over_quota_action == OVER_QUOTA_STOP:
                for pid in held.pids:
                    self._driver.kill(pid)
                action = f"; its processes on this GPU were stopped (PIDs {', '.join(map(str, held.pids))})"
            else:
                action = "; reported only (--over-quota-action report)"
            log.warning("pod %s %s%s", pod_ref(record.namespace, record.pod), found.message, action)
            self._warn(
                PodTarget(record.namespace, record.pod, uid), OVER_QUOTA_REASON, found.message + action
            )

    def _tell_unmanaged(self, uid: str, uuid: str, used: int) -> None:
        """A Warning event on a pod whose processes hold memory on a GPU Tessera did not give it."""
        node_pod = self._cache.pod(uid) if self._cache is not None else None
        message = (
            f"holds {-(-used // MIB)} MiB on GPU {uuid} by NVML without a Tessera allocation there: it "
            "reached the GPU around Tessera (no hook, no quota), e.g. through NVIDIA_VISIBLE_DEVICES"
        )
        if node_pod is None:
            log.warning("pod with UID %s %s", uid, message)
            return
        view = node_pod.view
        log.warning("pod %s %s", pod_ref(view.namespace, view.name), message)
        self._warn(PodTarget(view.namespace, view.name, view.uid), UNMANAGED_REASON, message)

    def _warn(self, target: PodTarget, reason: str, message: str) -> None:
        try:
            self._kube.warn(target, reason, message)
        except Exception as e:  # an event is told once; the log has it anyway
            log.warning(
                "pod %s: cannot record event %s: %s", pod_ref(target.namespace, target.name), reason, e
            )
