"""The driver's checks (deviceplugin/driverchecks.py): a pod over its quota by NVML is stopped after
a grace period (or only reported), GPU use outside Tessera is told, and what a container writes in
its own region changes neither."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from deviceplugin.driverchecks import Driver
from deviceplugin.driveruse import GpuHolders, PodMemory
from tessera.contract import MIB
from tests.deviceplugin.fakes import in_flight_pod, make_agent

GIB = 1024 * MIB


class NamedPods:
    """The agent's pod cache, as far as naming a pod by its UID goes (not synced for Allocate, which
    asks the API)."""

    def __init__(self, pods: dict[str, Any]) -> None:
        self.pods = pods

    def pending_pods(self) -> None:
        return None

    def node_pods(self) -> None:
        return None

    def pod(self, uid: str) -> Any:
        view = self.pods.get(uid)
        return None if view is None else SimpleNamespace(view=view)


def test_a_pod_over_its_quota_by_nvml_is_stopped_after_the_grace_and_its_neighbour_untouched(
    tmp_path: Path,
) -> None:
    greedy = in_flight_pod("greedy", {"main": [("GPU-0", 1024, 0)]}, bind=0)
    honest = in_flight_pod("honest", {"main": [("GPU-0", 1024, 0)]}, bind=1)
    outsider = in_flight_pod("outsider", {"main": [("GPU-1", 1024, 0)]}, bind=2)
    # The greedy pod's region says nothing (zeroed); NVML says it holds 3 GiB in two processes. A pod
    # Tessera gave no GPU holds 2 GiB of GPU-0 (it reached it around Tessera).
    driver = GpuHolders(
        {
            greedy.uid: PodMemory(3 * GIB, (4001, 4002)),
            honest.uid: PodMemory(GIB, (5001,)),
            outsider.uid: PodMemory(2 * GIB, (6001,)),
        },
        outside_pods_bytes=0,
    )
    killed: list[int] = []
    clock = [1000.0]
    agent, kube = make_agent(
        tmp_path,
        [greedy, honest],
        cache=NamedPods({outsider.uid: outsider}),
        driver=Driver(
            holders=lambda uuid: driver if uuid == "GPU-0" else None,
            kill=killed.append,
            clock=lambda: clock[0],
        ),
    )
    agent.allocator.allocate([["GPU-0::0"]])
    agent.allocator.allocate([["GPU-0::1"]])
    agent.usage.check()
    assert killed == []  # over, within its grace
    clock[0] += 5.0
    agent.usage.check()
    assert killed == [4001, 4002]  # the greedy pod's processes on that GPU, no other
    clock[0] += 5.0
    agent.usage.check()
    assert killed == [4001, 4002]  # once per episode
    over = [m for name, m in kube.events if name == "greedy"]
    assert len(over) == 1 and over[0].startswith(
        "holds 3072 MiB on GPU GPU-0 by NVML, over its quota of 1024"
    )
    assert "its processes on this GPU were stopped (PIDs 4001, 4002)" in over[0]
    told = [m for name, m in kube.events if name == "outsider"]
    assert len(told) == 1 and told[0].startswith(
        "holds 2048 MiB on GPU GPU-0 by NVML without a Tessera allocation"
    )
    assert not [m for name, m in kube.events if name == "honest"]
    # The measured use is NVML's: 3 + 1 GiB of the served pods, whatever their regions say.
    usage = agent.usage.measured_usage()
    assert usage is not None
    assert {g.uuid: g.guaranteed_used_mib for g in usage.gpus}["GPU-0"] == 4096


def test_report_only_kills_nothing(tmp_path: Path) -> None:
    greedy = in_flight_pod("greedy", {"main": [("GPU-0", 1024, 0)]}, bind=0)
    killed: list[int] = []
    clock = [0.0]
    agent, kube = make_agent(
        tmp_path,
        [greedy],
        flags=["--over-quota-action=report", "--over-quota-grace-seconds=2"],
        driver=Driver(
            holders=lambda uuid: GpuHolders({greedy.uid: PodMemory(3 * GIB, (4001,))}, 0),
            kill=killed.append,
            clock=lambda: clock[0],
        ),
    )
    agent.allocator.allocate([["GPU-0::0"]])
    agent.usage.check()
    clock[0] = 2.0
    agent.usage.check()
    assert killed == []
    [(name, message)] = kube.events
    assert name == "greedy" and message.endswith("; reported only (--over-quota-action report)")
