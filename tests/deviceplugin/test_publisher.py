"""Publishing on the Node (deviceplugin/publisher.py): the inventory only when it changed."""

from __future__ import annotations

from pathlib import Path

from tessera.contract import (
    KEYS,
)
from tests.deviceplugin.fakes import (
    make_agent,
)


def test_inventory_is_patched_only_when_it_changes(tmp_path: Path) -> None:
    agent, kube = make_agent(tmp_path, [])
    assert agent.publisher.publish(heartbeat=False)
    first = dict(kube.node)
    assert KEYS.node_gpus in first and KEYS.node_heartbeat in first
    assert not agent.publisher.publish(heartbeat=False)
    agent.inventory.record_xid("GPU-1", 79)
    assert agent.publisher.publish(heartbeat=False)
    assert '"health":"Unhealthy"' in kube.node[KEYS.node_gpus]
    assert agent.publisher.publish(heartbeat=True)
