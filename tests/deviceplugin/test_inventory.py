"""The inventory (deviceplugin/inventory.py): health changes (nodeagent/health.py) reach the slices
and the Node's inventory, with the version that ListAndWatch and the publisher wait on."""

from __future__ import annotations

from deviceplugin.inventory import Inventory
from tessera.contract import HEALTHY, UNHEALTHY
from tests.deviceplugin.fakes import GPUS


def test_a_health_change_marks_the_slices_and_bumps_the_version() -> None:
    inventory = Inventory(GPUS, health_poll_seconds=60)
    devices, version = inventory.devices()
    assert len(devices) == 40 and all(d.healthy for d in devices)
    assert inventory.uuids == {g.uuid for g in GPUS}
    inventory.record_xid("GPU-1", 79)
    devices, changed = inventory.devices()
    assert changed == version + 1
    assert {d.id.split("::")[0] for d in devices if not d.healthy} == {"GPU-1"}
    assert [g.health for g in inventory.inventory()] == [HEALTHY, UNHEALTHY, HEALTHY, HEALTHY]
    inventory.record_presence("GPU-1", False)
    inventory.record_presence("GPU-1", True)
    assert inventory.devices()[1] == version + 3
    assert all(g.health == HEALTHY for g in inventory.inventory())
