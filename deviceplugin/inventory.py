"""The node's GPUs and their health: the slices the kubelet is offered and the inventory the Node
carries. XID events and presence checks change a GPU's health (:class:`nodeagent.health.HealthBook`);
every change bumps a version that ListAndWatch and the publisher wait on."""

from __future__ import annotations

from deviceplugin.devices import VirtualDevice, virtual_devices, with_health
from nodeagent.health import HealthBook
from tessera.contract import GpuInfo


class Inventory(HealthBook):
    def __init__(self, gpus: tuple[GpuInfo, ...], health_poll_seconds: float) -> None:
        """``gpus``: as discovered; ``health_poll_seconds``: the pause between presence checks."""
        super().__init__((g.uuid for g in gpus), health_poll_seconds)
        self.gpus = gpus
        self.uuids = frozenset(self.gpu_uuids)

    def inventory(self) -> tuple[GpuInfo, ...]:
        return with_health(self.gpus, self.state().gpus)

    def devices(self) -> tuple[tuple[VirtualDevice, ...], int]:
        """The full slice list and its version (bumped on every health change)."""
        state = self.state()
        return virtual_devices(with_health(self.gpus, state.gpus)), state.version
