"""The inventory (deviceplugin/inventory.py): health changes reach the slices and bump the version
that ListAndWatch and the publisher wait on; nothing else does."""

from __future__ import annotations

import threading

from deviceplugin.inventory import Inventory
from tessera.contract import HEALTHY, UNHEALTHY
from tests.deviceplugin.fakes import GPUS
from tests.waiting import wait_for


def test_a_health_change_marks_the_slices_and_bumps_the_version() -> None:
    inventory = Inventory(GPUS, health_poll_seconds=60)
    devices, version = inventory.devices()
    assert len(devices) == 40 and all(d.healthy for d in devices)
    inventory.record_xid("GPU-1", 13)  # the application's own fault: no change
    inventory.record_xid("GPU-9", 79)  # not this node's GPU
    assert inventory.wait_for_change(version, timeout=0.01) == version
    inventory.record_xid("GPU-1", 79)
    devices, changed = inventory.devices()
    assert changed == version + 1
    assert {d.id.split("::")[0] for d in devices if not d.healthy} == {"GPU-1"}
    assert [g.health for g in inventory.inventory()] == [HEALTHY, UNHEALTHY, HEALTHY, HEALTHY]
    # Gone and back: healthy again, two more versions.
    inventory.record_presence("GPU-1", False)
    inventory.record_presence("GPU-1", True)
    assert inventory.devices()[1] == version + 3
    assert all(g.health == HEALTHY for g in inventory.inventory())


def test_a_waiter_wakes_on_a_change_and_presence_checks_run_until_stopped() -> None:
    inventory = Inventory(GPUS, health_poll_seconds=0.01)
    _, version = inventory.devices()
    woken: list[int] = []
    waiter = threading.Thread(target=lambda: woken.append(inventory.wait_for_change(version, timeout=30)))
    waiter.start()
    stop = threading.Event()
    checks = threading.Thread(target=inventory.run_presence_checks, args=(lambda uuid: uuid != "GPU-2", stop))
    checks.start()
    waiter.join(30)
    assert woken == [version + 1]
    wait_for(lambda: inventory.inventory()[2].health == UNHEALTHY, what="GPU-2 marked gone")
    stop.set()
    checks.join(30)
    assert not checks.is_alive()
