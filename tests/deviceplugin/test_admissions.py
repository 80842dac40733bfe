"""The kubelet's word on what it admitted (deviceplugin/admissions.py): the ``allocated`` phase is
for the pod the kubelet names, records are corrected from it, and the state of gone pods removed."""

from __future__ import annotations

from pathlib import Path

from deviceplugin.identity import ContainerRef as IdentityRef
from deviceplugin.podresources import Owners, PodResourcesError
from tessera.contract import (
    Phase,
)
from tests.deviceplugin.fakes import (
    Kubelet,
    bind,
    in_flight_pod,
    make_agent,
    served_on_disk,
    write_phases,
)


def test_the_allocated_phase_is_for_the_pod_the_kubelet_admitted(tmp_path: Path) -> None:
    """A burst of equal pods spilling from one GPU onto the next (the chart's failover test): the
    kubelet admits b before a, the agent's match is a (the older bind; the same answer). Only b may
    read as allocated: were it a, the extender would let the next GPU's key into flight while a
    still waits for admission, and a would be steered onto the next GPU and served a pod's
    container it does not belong to, leaving that pod with "no in-flight container asks for"."""
    a = in_flight_pod("a", {"main": [("GPU-0", 512, 2)]}, bind=0)
    b = in_flight_pod("b", {"main": [("GPU-0", 512, 2)]}, bind=1)
    c = in_flight_pod("c", {"main": [("GPU-1", 512, 2)]}, bind=2)
    kubelet = Kubelet()
    agent, kube = make_agent(tmp_path, [a, b], pod_resources=kubelet.pod_resources)
    kubelet.agent = agent

    kubelet.admit(b)
    assert served_on_disk(agent) == {("uid-a", "main")}  # the guess
    write_phases(agent)
    assert kube.phases == {"uid-b": Phase.ALLOCATED}
    assert served_on_disk(agent) == {("uid-b", "main")}  # corrected by what the kubelet says
    assert not bind(kube, c), "the extender must keep the A100's key out while a is in flight"

    kubelet.admit(a)
    write_phases(agent)
    assert kube.phases == {"uid-a": Phase.ALLOCATED, "uid-b": Phase.ALLOCATED}
    assert bind(kube, c)
    kubelet.admit(c)
    write_phases(agent)
    assert set(kube.phases) == {"uid-a", "uid-b", "uid-c"}
    held = {(r.pod, frozenset(r.device_ids), r.gpus[0].uuid) for _, r in agent.served.state.records()}
    assert held == {
        (o.pod, devices, next(iter(devices)).split("::")[0]) for devices, o in kubelet.owners.items()
    }


def test_slices_given_again_leave_one_record_for_their_new_container(tmp_path: Path) -> None:
    """The chaos test's case: a served container goes (its pod failed, still listed) and the kubelet
    gives the same slices to a new pod's container. The old record must not be rewritten to name the
    new container (two records for one container: its metrics and the NVML cross-check's allowance
    would count it twice), and the new one keeps its own quotas."""
    old = in_flight_pod("old", {"main": [("GPU-0", 512, 2)]}, bind=0)
    kubelet = Kubelet()
    agent, kube = make_agent(tmp_path, [old], pod_resources=kubelet.pod_resources)
    kubelet.agent = agent
    kubelet.admit(old)
    write_phases(agent)
    ((devices, _),) = kubelet.owners.items()
    del kubelet.owners[devices]  # the old container is gone; its pod is still on the node
    new = in_flight_pod("new", {"main": [("GPU-0", 1024, 4)]}, bind=1)
    kube.pods.append(new)
    agent.allocator.allocate([sorted(devices)])
    kubelet.owners[devices] = IdentityRef("ns", "new", "main")
    write_phases(agent)
    agent.admissions.tidy()
    records = [r for _, r in agent.served.state.records()]
    assert [(r.pod, r.gpus[0].memory_quota_mib, frozenset(r.device_ids)) for r in records] == [
        ("new", 1024, devices)
    ]
    assert kube.phases["uid-new"] == Phase.ALLOCATED


def test_a_pod_is_allocated_only_once_the_kubelet_names_it(tmp_path: Path) -> None:
    """Served but not yet named by the pod-resources API: no phase, asked again; a failing API is
    asked again too, and never taken as an answer."""
    p = in_flight_pod("p", {"x": [("GPU-0", 1024, 10)], "y": [("GPU-1", 2048, 50)]})
    owners: Owners = {}
    failing = [False]

    def pod_resources() -> Owners:
        if failing[0]:
            raise PodResourcesError("pod-resources List on /k.sock failed: connection refused")
        return dict(owners)

    agent, kube = make_agent(tmp_path, [p], pod_resources=pod_resources)
    agent.allocator.allocate([["GPU-0::0"]])
    assert agent.admissions.confirm()  # the kubelet has not named it yet: ask again
    owners[frozenset({"GPU-0::0"})] = IdentityRef("ns", "p", "x")
    assert not agent.admissions.confirm()
    agent.admissions.phases.drain()
    assert kube.phases == {}  # y is not admitted yet
    agent.allocator.allocate([["GPU-1::0"]])
    owners[frozenset({"GPU-1::0"})] = IdentityRef("ns", "p", "y")
    failing[0] = True
    assert agent.admissions.confirm()
    agent.admissions.tidy()
    agent.admissions.phases.drain()
    assert kube.phases == {}
    failing[0] = False
    assert not agent.admissions.confirm()
    agent.admissions.phases.drain()
    assert kube.phases == {"uid-p": Phase.ALLOCATED}


def test_state_of_containers_whose_pods_are_gone_is_removed(tmp_path: Path) -> None:
    pods = [in_flight_pod(name, {"main": [("GPU-0", 1024, 10)]}, bind=i) for i, name in enumerate("abc")]
    agent, kube = make_agent(tmp_path, pods)
    for i, _ in enumerate(pods):
        agent.allocator.allocate([[f"GPU-0::{i}"]])
    containers = tmp_path / "containers"
    assert sorted(p.name for p in containers.iterdir()) == ["uid-a", "uid-b", "uid-c"]
    kube.pods = [p for p in pods if p.name != "b"]
    agent.admissions.tidy()  # no kubelet pod-resources socket here: records stay as they are
    assert sorted(p.name for p in containers.iterdir()) == ["uid-a", "uid-c"]
    assert served_on_disk(agent) == {("uid-a", "main"), ("uid-c", "main")}
