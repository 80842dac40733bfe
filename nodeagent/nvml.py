"""NVML adapter (nvidia-ml-py): GPU discovery, XID events, presence probes and live readings.

Everything here is a thin translation of NVML calls into plain data; decisions live in
:mod:`nodeagent.health`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from tessera.contract import MIB, GpuInfo

log = logging.getLogger(__name__)

SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")
# NVML reports these when a GPU is gone from the bus or its driver state is lost.
_GONE = (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_NotFound, pynvml.NVMLError_GpuNotFound)


class NvmlUnavailableError(RuntimeError):
    """NVML cannot be used on this node; the message says why."""


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _optional(call: Callable[[], Any], what: str, uuid: str) -> Any:
    """An NVML query the inventory can do without: None, with a debug line, when it fails."""
    try:
        return call()
    except pynvml.NVMLError as e:
        log.debug("GPU %s: %s not available from NVML: %s", uuid, what, e)
        return None


def sysfs_numa_node(pci_bus_id: str, root: Path = SYSFS_PCI_DEVICES) -> int | None:
    """The NUMA node of a PCI device from sysfs; NVML's bus ID has an 8-digit domain, sysfs 4."""
    try:
        domain, rest = pci_bus_id.lower().split(":", 1)
        text = (root / f"{int(domain, 16):04x}:{rest}" / "numa_node").read_text().strip()
        node = int(text)
    except (ValueError, OSError):
        return None
    return node if node >= 0 else None


@dataclass(frozen=True, slots=True)
class GpuReading:
    uuid: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_ratio: float


class Nvml:
    """One initialised NVML session."""

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NvmlUnavailableError(f"NVML cannot be initialised: {e}") from None
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            pynvml.nvmlShutdown()

    def discover(self, split: int) -> tuple[GpuInfo, ...]:
        """Every GPU NVML sees, as inventory entries advertised as ``split`` slices each."""
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            raise NvmlUnavailableError(f"NVML cannot count GPUs: {e}") from None
        found = [self._describe(index, split) for index in range(count)]
        by_bus = {g.pci_bus_id.lower(): g.uuid for g in found if g.pci_bus_id}
        return tuple(g.model_copy(update={"nvlink_peers": self._nvlink_peers(g, by_bus)}) for g in found)

    def _describe(self, index: int, split: int) -> GpuInfo:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            name = _text(pynvml.nvmlDeviceGetName(handle))
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        except pynvml.NVMLError as e:
            raise NvmlUnavailableError(f"GPU {index}: NVML cannot describe it: {e}") from None
        attributes = _optional(lambda: pynvml.nvmlDeviceGetAttributes(handle), "attributes", uuid)
        pci = _optional(lambda: pynvml.nvmlDeviceGetPciInfo(handle), "PCI info", uuid)
        bus_id = _text(pci.busId) if pci is not None else ""
        numa = _optional(lambda: pynvml.nvmlDeviceGetNumaNodeId(handle), "NUMA node", uuid)
        if numa is None or numa < 0:
            numa = sysfs_numa_node(bus_id) if bus_id else None
        return GpuInfo(
            uuid=uuid,
            index=index,
            model=name,
            total_memory_mib=memory // MIB,
            sm_count=attributes.multiprocessorCount if attributes is not None else 0,
            compute_capability=f"{major}.{minor}",
            pci_bus_id=bus_id,
            numa_node=numa,
            split=split,
        )

    def _nvlink_peers(self, gpu: GpuInfo, by_bus: dict[str, str]) -> tuple[str, ...]:
        """UUIDs of the local GPUs reachable over an active NVLink, as NVML reports them."""
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        peers: list[str] = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).lower()
            except pynvml.NVMLError:
                break  # no NVLink, or no more links
            peer = by_bus.get(remote)
            if peer and peer != gpu.uuid and peer not in peers:
                peers.append(peer)
        return tuple(peers)

    def present(self, uuid: str) -> bool:
        """Whether NVML still finds and answers for the GPU."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            pynvml.nvmlDeviceGetMemoryInfo(handle)
        except _GONE:
            return False
        except pynvml.NVMLError as e:
            log.warning("GPU %s: presence check failed, counted as gone: %s", uuid, e)
            return False
        return True

    def reading(self, uuid: str) -> GpuReading | None:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError:
            return None
        utilization = _optional(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle), "utilization", uuid)
        return GpuReading(
            uuid=uuid,
            memory_total_bytes=memory.total,
            memory_used_bytes=memory.used,
            utilization_ratio=utilization.gpu / 100 if utilization is not None else 0.0,
        )

    def watch_xids(
        self, uuids: tuple[str, ...], on_xid: Callable[[str, int], None], stop: threading.Event
    ) -> None:
        """Calls ``on_xid(uuid, xid)`` for every critical-XID event until ``stop`` is set.

        Returns at once (with a log line) where the driver offers no XID events: presence probes
        then remain the only health signal.
        """
        try:
            events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            log.warning("XID events unavailable, health from presence checks only: %s", e)
            return
        try:
            watched = 0
            for uuid in uuids:
                try:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
                    watched += 1
                except pynvml.NVMLError as e:
                    log.warning("GPU %s: XID events unavailable: %s", uuid, e)
            log.info("watching XID events of %d GPU(s)", watched)
            while not stop.is_set():
                try:
                    event = pynvml.nvmlEventSetWait_v2(events, 500)
                except pynvml.NVMLError_Timeout:
                    continue
                except pynvml.NVMLError as e:
                    log.warning("waiting for XID events failed: %s", e)
                    stop.wait(1.0)
                    continue
                if event.eventType & pynvml.nvmlEventTypeXidCriticalError:
                    try:
                        uuid = _text(pynvml.nvmlDeviceGetUUID(event.device))
                    except pynvml.NVMLError as e:
                        log.warning("XID %d on a GPU NVML cannot name: %s", event.eventData, e)
                        continue
                    on_xid(uuid, int(event.eventData))
        finally:
            pynvml.nvmlEventSetFree(events)


def gpu_reader(nvml: Nvml | None) -> Callable[[str], GpuReading | None]:
    """NVML's reading of a GPU by UUID, as both agents' metrics take it; none where NVML is absent."""
    return nvml.reading if nvml is not None else lambda uuid: None


def discover_gpus(split: int) -> tuple[Nvml | None, tuple[GpuInfo, ...]]:
    """The node's GPUs; none, with one log line saying why, when NVML is missing or finds none."""
    try:
        nvml = Nvml()
    except NvmlUnavailableError as e:
        log.warning("no GPUs advertised: %s", e)
        return None, ()
    try:
        gpus = nvml.discover(split)
    except NvmlUnavailableError as e:
        log.warning("no GPUs advertised: %s", e)
        nvml.close()
        return None, ()
    if not gpus:
        log.warning("no GPUs advertised: NVML reports 0 GPUs on this node")
    for gpu in gpus:
        log.info(
            "GPU %d %s: %s, %d MiB, %d SMs, compute %s, PCI %s, NUMA %s, NVLink peers %s, %d slices",
            gpu.index,
            gpu.uuid,
            gpu.model,
            gpu.total_memory_mib,
            gpu.sm_count,
            gpu.compute_capability,
            gpu.pci_bus_id or "-",
            gpu.numa_node if gpu.numa_node is not None else "-",
            ",".join(gpu.nvlink_peers) or "-",
            gpu.split,
        )
    return nvml, gpus
