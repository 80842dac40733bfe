"""Measured use and what follows from it: each GPU's use for the Node, and best-effort containers
that borrow memory (their quotas follow what the others leave; they are evicted for guaranteed ones
that wait; deviceplugin/oversubscription.py). Each check ends with the driver's checks
(deviceplugin/driverchecks.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from deviceplugin.config import Config
from deviceplugin.driverchecks import Driver, DriverChecks
from deviceplugin.driveruse import CONTEXT_ALLOWANCE_BYTES
from deviceplugin.kube import Kube
from deviceplugin.oversubscription import Holder, driver_checked, measured_use, plan_gpu
from deviceplugin.served import PodTarget, ServedContainers
from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir
from tessera.contract import MIB, GpuInfo, NodeGpuUsage, QosClass, format_time, now, pod_ref

log = logging.getLogger(__name__)

# The Warning event on a best-effort pod evicted to give borrowed GPU memory back.
EVICTED_REASON = "TesseraBestEffortEvicted"
# An eviction asked for is asked again (the pod still served) after its grace period and this long.
EVICTION_RETRY_SECONDS = 30.0


class UsageChecks:
    def __init__(  # noqa: PLR0917 (the parts it reads)
        self,
        config: Config,
        gpus: tuple[GpuInfo, ...],
        kube: Kube,
        served: ServedContainers,
        driver: Driver,
        driver_checks: DriverChecks,
        on_evicted: Callable[[], object] | None = None,
    ) -> None:
        """``driver``: NVML's word; ``driver_checks``: what is done on it, after each check.
        ``on_evicted``: told of each eviction (the exporter's counter)."""
        self._config = config
        self._gpus = gpus
        self._kube = kube
        self._served = served
        self._driver = driver
        self._driver_checks = driver_checks
        self._on_evicted = on_evicted
        # Only the checks' own thread changes what follows; the publisher reads the measurement
        # (:meth:`latest`), replaced whole.
        self._claims_ignored: set[tuple[ContainerDir, str]] = set()
        self._evicting: dict[str, float] = {}  # pods being evicted: UID -> when asked (monotonic)
        # The last measurement, and the containers it measured.
        self._latest: tuple[NodeGpuUsage | None, frozenset[ContainerDir]] = (None, frozenset())
        self._wanted = threading.Event()
        self.evictions = 0

    def measured_usage(self) -> NodeGpuUsage | None:
        """Each GPU's use as of the last check (None before the first)."""
        return self._latest[0]

    def latest(self) -> tuple[NodeGpuUsage | None, frozenset[ContainerDir]]:
        """The last measurement and the containers it measured."""
        return self._latest

    def wake(self) -> None:
        """Check now (a container was served, or the loop is to see that it is stopped)."""
        self._wanted.set()

    def check(self) -> None:
        """Read every served container's region, measure each GPU's use, rewrite the limits of the
        containers whose quota or wait changed (best-effort ones that borrow memory follow what the
        others leave) and evict best-effort pods for guaranteed ones that wait for memory."""
        records = self._served.records()
        holders: dict[str, list[Holder[ContainerDir]]] = defaultdict(list)
        for where, record in records.items():
            usage = where.usage()
            for grant in record.gpus:
                device = usage.device(grant.uuid) if usage is not None else None
                holders[grant.uuid].append(
                    Holder(
                        key=where,
                        pod=record.pod_uid,
                        qos=record.qos,
                        grant_bytes=grant.memory_quota_mib * MIB,
                        oversubscribed=grant.oversubscribed and record.qos == QosClass.BEST_EFFORT,
                        used_bytes=device.memory_used_bytes if device is not None else 0,
                        waiting_bytes=device.memory_waiting_bytes if device is not None else 0,
                        served_at=record.served_at,
                    )
                )
        retry_after = time.monotonic() - self._config.eviction_grace_seconds - EVICTION_RETRY_SECONDS
        served_pods = {r.pod_uid for r in records.values()}
        self._evicting = {
            uid: at for uid, at in self._evicting.items() if uid in served_pods and at > retry_after
        }
        evicting = frozenset(w for w, r in records.items() if r.pod_uid in self._evicting)
        margin = self._config.oversubscription_margin_mib * MIB
        drivers = {gpu.uuid: self._driver.holders(gpu.uuid) for gpu in self._gpus}
        for gpu in self._gpus:
            claimed = holders.get(gpu.uuid, [])
            driver = drivers[gpu.uuid]
            by_pod = None if driver is None else {uid: held.used_bytes for uid, held in driver.pods.items()}
            checked = driver_checked(claimed, by_pod)
            self._report_claims(gpu.uuid, claimed, checked)
            holders[gpu.uuid] = checked
        free_memory = self._driver.free_memory
        plans = {
            gpu.uuid: plan_gpu(
                gpu.total_memory_mib * MIB, holders.get(gpu.uuid, []), margin, evicting, free_memory(gpu.uuid)
            )
            for gpu in self._gpus
        }
        self._served.apply_plans(plans)
        # The measurement's time has whole seconds, as the pods' bind times do, and the extender
        # counts a pod at its full request unless measured after the second it was bound in: a
        # container served in this second counts as measured only from the next check on.
        measured_at = now()
        second = int(measured_at.timestamp())
        measured = frozenset(w for w, r in records.items() if int(r.served_at) < second)
        measurement = NodeGpuUsage(
            time=format_time(measured_at),
            gpus=tuple(
                measured_use(gpu.uuid, holders.get(gpu.uuid, []), self._driver.utilization(gpu.uuid) or 0)
                for gpu in self._gpus
            ),
        )
        self._latest = (measurement, measured)
        for uuid, plan in plans.items():
            held = {h.key: h.used_bytes for h in holders.get(uuid, [])}
            for where in plan.evict:
                self._evict(records[where], uuid, plan.shortfall_bytes, held[where])
        self._driver_checks.check(records, drivers)

    def _report_claims(
        self, uuid: str, claimed: list[Holder[ContainerDir]], checked: list[Holder[ContainerDir]]
    ) -> None:
        """Log, once per container and GPU, a region that claims more than its grant or more than the
        driver says its pod holds (beyond a CUDA context's allowance): ignored for placement."""
        seen = set()
        for before, after in zip(claimed, checked, strict=True):
            key = (before.key, uuid)
            seen.add(key)
            beyond = before.used_bytes - max(after.used_bytes, 0)
            if beyond > CONTEXT_ALLOWANCE_BYTES or before.waiting_bytes > before.grant_bytes:
                if key not in self._claims_ignored:
                    log.warning(
                        "container %s on GPU %s claims %d MiB held and %d MiB waited for; the driver and "
                        "its grant of %d MiB bear out %d MiB: the claim is ignored",
                        before.key.root.name,
                        uuid,
                        before.used_bytes // MIB,
                        before.waiting_bytes // MIB,
                        before.grant_bytes // MIB,
                        after.used_bytes // MIB,
                    )
                    self._claims_ignored.add(key)
            else:
                self._claims_ignored.discard(key)
        self._claims_ignored = {k for k in self._claims_ignored if k[1] != uuid or k in seen}

    def _evict(self, record: ServedRecord, uuid: str, shortfall: int, held: int) -> None:
        """Delete a best-effort pod that borrows memory a guaranteed container waits for, with a
        short grace period (not the Eviction API: a disruption budget must not keep memory promised
        to another pod), and say why on the pod."""
        if record.pod_uid in self._evicting:
            return
        pod = PodTarget(record.namespace, record.pod, record.pod_uid)
        message = (
            f"evicted from GPU {uuid}: guaranteed containers wait for {-(-shortfall // MIB)} MiB of "
            f"the memory best-effort pods borrow there; this pod held {-(-held // MIB)} MiB (the newest "
            "go first)"
        )
        try:
            self._kube.delete_pod(pod.namespace, pod.name, pod.uid, self._config.eviction_grace_seconds)
        except Exception as e:  # asked again at the next check
            log.warning("pod %s: cannot evict: %s", pod_ref(pod.namespace, pod.name), e)
            return
        self._evicting[pod.uid] = time.monotonic()
        log.warning("pod %s %s", pod_ref(pod.namespace, pod.name), message)
        self.evictions += 1
        if self._on_evicted is not None:
            self._on_evicted()
        try:
            self._kube.warn(pod, EVICTED_REASON, message)
        except Exception as e:
            log.warning("pod %s: cannot record event: %s", pod_ref(pod.namespace, pod.name), e)

    def run(self, stop: threading.Event) -> None:
        """:meth:`check` every ``--usage-tick-seconds`` while a container borrows memory, else
        every ``--usage-publish-seconds`` (only the measured use needs it then), and at once after
        an Allocate, until ``stop``."""
        last_error = ""
        while not stop.is_set():
            try:
                self.check()
                last_error = ""
            except Exception as e:  # the loop must outlive any one failure; say so once
                if str(e) != last_error:
                    log.warning("checking the GPUs' use failed (retrying): %s", e)
                    last_error = str(e)
            config = self._config
            self._wanted.wait(
                config.usage_tick_seconds if self._served.borrowing() else config.usage_publish_seconds
            )
            self._wanted.clear()
