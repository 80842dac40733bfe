"""Prepare / unprepare: the limits file, coordination slots and CDI spec a claim gets, its QoS class,
restarts, bad input."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_args

import pytest
from kubernetes import client

from draplugin.claims import OVERCOMMITTED, ClaimRef
from draplugin.driver import Driver
from nodeagent.kubeapi import EventTarget
from nodeagent.statedir import StateDir
from tessera.contract import (
    CONTAINER_COORDINATION_DIR,
    CONTAINER_HOOK_LIBRARY,
    CONTAINER_LD_SO_PRELOAD,
    CONTAINER_LIMITS_DIR,
    CONTAINER_STATE_DIR,
    COORDINATION_SLOT_BYTES,
    KEYS,
    MIB,
    ContractError,
    GpuInfo,
    GpuShareConfig,
    QosClass,
)
from tessera.placement.qos import QOS_LOWERED_REASON, QosThresholds

GIB = 1024 * MIB
NODE = "node-a"
A100 = GpuInfo(
    uuid="GPU-a100",
    index=0,
    model="NVIDIA A100-SXM4-40GB",
    total_memory_mib=40960,
    sm_count=108,
    compute_capability="8.0",
    split=1,
)
T4 = GpuInfo(
    uuid="GPU-t4",
    index=1,
    model="Tesla T4",
    total_memory_mib=15360,
    sm_count=40,
    compute_capability="7.5",
    split=1,
)
REF = ClaimRef(namespace="team", name="share", uid="0b1c2d3e-0000-4000-8000-000000000001")
JOB = ("job", "7c0d0e0f-0000-4000-8000-00000000000a")  # the pod the claim is reserved for
HIGH, SCAVENGER = 1_000_000, -10  # a high-priority and a scavenger PriorityClass's values


def pod(
    name: str = JOB[0], uid: str = JOB[1], priority: int | None = 0, namespace: str = "team"
) -> dict[str, object]:
    spec = {} if priority is None else {"priority": priority}
    return {"metadata": {"namespace": namespace, "name": name, "uid": uid}, "spec": spec}


def share_config(**fields: object) -> list[dict[str, object]]:
    """A claim's config: one GpuShareConfig with these fields."""
    parameters = {"apiVersion": KEYS.dra_config_api_version, "kind": "GpuShareConfig", **fields}
    return [{"source": "FromClaim", "opaque": {"driver": KEYS.dra_driver, "parameters": parameters}}]


def claim(
    ref: ClaimRef = REF,
    results: list[dict[str, object]] | None = None,
    config: list[dict[str, object]] | None = None,
    reserved: tuple[tuple[str, str], ...] = (JOB,),
) -> dict[str, object]:
    if results is None:
        results = [
            {
                "request": "gpu",
                "driver": KEYS.dra_driver,
                "pool": NODE,
                "device": "gpu-0",
                "shareID": "5a0e6c1f-1111-4000-8000-000000000002",
                "consumedCapacity": {"memory": "1Gi", "cores": "30"},
            }
        ]
    return {
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {
            "allocation": {"devices": {"results": results, "config": config or []}},
            "reservedFor": [{"resource": "pods", "name": name, "uid": uid} for name, uid in reserved],
        },
    }


class Claims:
    """The API server's claims and pods, as the driver reads them; counts the claim reads and keeps
    the events recorded on pods."""

    def __init__(self, *claims: Mapping[str, object], pods: tuple[dict[str, object], ...] = (pod(),)) -> None:
        self.by_name = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims}  # type: ignore[index]
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}  # type: ignore[index]
        self.reads = 0
        self.events: list[tuple[str, str, str]] = []  # pod, reason, message
        self.events_fail = False

    def read_claim(self, namespace: str, name: str) -> Mapping[str, object] | None:
        self.reads += 1
        return self.by_name.get((namespace, name))

    def read_pod(self, namespace: str, name: str) -> Mapping[str, object] | None:
        return self.pods.get((namespace, name))

    def warn(self, pod: EventTarget, reason: str, message: str) -> None:
        if self.events_fail:
            raise client.ApiException(status=403, reason="Forbidden")
        self.events.append((pod.name, reason, message))


def driver(tmp_path: Path, claims: Claims, qos: QosThresholds | None = None) -> Driver:
    state = StateDir(tmp_path / "state")
    state.prepare()
    return Driver(
        keys=KEYS,
        node=NODE,
        gpus=(A100, T4),
        state=state,
        cdi_dir=tmp_path / "cdi",
        hook_library=tmp_path / "libvgpu.so",
        claims=claims,
        pods=claims,
        qos=qos or QosThresholds(),
    )


def written(tmp_path: Path) -> list[str]:
    return sorted(
        str(p.relative_to(tmp_path))
        for p in tmp_path.rglob("*")
        if p.is_file() and ("claims" in p.parts or "cdi" in p.parts or "coordination" in p.parts)
    )


def limits_of(tmp_path: Path, ref: ClaimRef = REF) -> str:
    return (tmp_path / "state" / "claims" / ref.uid / "limits.d" / "limits").read_text()


def test_prepare_writes_the_limits_and_a_cdi_spec_mounting_them(tmp_path: Path) -> None:
    d = driver(tmp_path, Claims(claim()))
    [device] = d.prepare(REF)
    assert device.pool_name == NODE
    assert device.device_name == "gpu-0"
    assert device.request_names == ("gpu",)
    assert device.share_id == "5a0e6c1f-1111-4000-8000-000000000002"
    assert device.cdi_device_ids == (f"{KEYS.dra_driver}/gpu-share={REF.uid}",)
    where = tmp_path / "state" / "claims" / REF.uid
    limits = (where / "limits.d" / "limits").read_text()
    assert f"device GPU-a100 memory {GIB} cores 30\n" in limits
    assert "elastic 0\n" in limits
    assert (where / "limits.d" / "limits").stat().st_mode & 0o777 == 0o444
    # The class and the coordination area, in the lines the device plugin writes for a container.
    assert "qos standard\n" in limits
    assert f"coordination {CONTAINER_COORDINATION_DIR}\n" in limits
    slot = tmp_path / "state" / "coordination" / "GPU-a100" / "standard" / REF.uid
    assert slot.read_bytes() == bytes(COORDINATION_SLOT_BYTES)
    assert slot.stat().st_mode & 0o777 == 0o666
    [spec_path] = (tmp_path / "cdi").iterdir()
    spec = json.loads(spec_path.read_text())
    assert spec["kind"] == f"{KEYS.dra_driver}/gpu-share"
    [cdi_device] = spec["devices"]
    assert cdi_device["name"] == REF.uid
    edits = cdi_device["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-a100"]
    mounts = {m["containerPath"]: (m["hostPath"], m["options"][0]) for m in edits["mounts"]}
    area = tmp_path / "state" / "coordination" / "GPU-a100"
    assert mounts == {
        CONTAINER_LIMITS_DIR: (str(where / "limits.d"), "ro"),
        CONTAINER_STATE_DIR: (str(where / "state"), "rw"),
        CONTAINER_HOOK_LIBRARY: (str(tmp_path / "libvgpu.so"), "ro"),
        CONTAINER_LD_SO_PRELOAD: (str(tmp_path / "state" / "ld.so.preload"), "ro"),
        # The GPU's coordination area read-only, the claim's own slot writable: as a device plugin
        # container's (tests/deviceplugin/test_allocation.py).
        f"{CONTAINER_COORDINATION_DIR}/GPU-a100": (str(area), "ro"),
        f"{CONTAINER_COORDINATION_DIR}/GPU-a100.slot": (str(area / "standard" / REF.uid), "rw"),
    }


def test_prepare_is_idempotent_and_survives_a_restart_without_asking_again(tmp_path: Path) -> None:
    claims = Claims(claim())
    first = driver(tmp_path, claims).prepare(REF)
    assert driver(tmp_path, claims).prepare(REF) == first  # a new process, the same dirs
    assert claims.reads == 1


def test_a_prepare_cut_short_is_redone(tmp_path: Path) -> None:
    claims = Claims(claim())
    d = driver(tmp_path, claims)
    d.prepare(REF)
    (tmp_path / "state" / "claims" / REF.uid / "prepared.json").unlink()  # died before the record
    (tmp_path / "state" / "claims" / REF.uid / "limits.d" / "limits").unlink()
    d.prepare(REF)
    assert claims.reads == 2
    assert "cores 30" in (tmp_path / "state" / "claims" / REF.uid / "limits.d" / "limits").read_text()


def test_unprepare_removes_everything_and_is_idempotent(tmp_path: Path) -> None:
    d = driver(tmp_path, Claims(claim()))
    d.prepare(REF)
    assert [p for p in written(tmp_path) if "coordination" in p] == [
        f"state/coordination/GPU-a100/standard/{REF.uid}"
    ]
    d.unprepare(REF)
    assert written(tmp_path) == []
    d.unprepare(REF)
    assert written(tmp_path) == []


def test_two_requests_on_one_gpu_add_up_and_other_drivers_are_ignored(tmp_path: Path) -> None:
    results = [
        {
            "request": "a",
            "driver": KEYS.dra_driver,
            "pool": NODE,
            "device": "gpu-1",
            "consumedCapacity": {"memory": "2Gi", "cores": "10"},
        },
        {
            "request": "b",
            "driver": KEYS.dra_driver,
            "pool": NODE,
            "device": "gpu-1",
            "consumedCapacity": {"memory": "1Gi", "cores": "20"},
        },
        {"request": "nic", "driver": "nic.example.com", "pool": "other", "device": "eth0"},
        {"request": "whole", "driver": KEYS.dra_driver, "pool": NODE, "device": "gpu-0"},
    ]
    devices = driver(tmp_path, Claims(claim(results=results))).prepare(REF)
    assert [(d.device_name, d.request_names) for d in devices] == [
        ("gpu-1", ("a",)),
        ("gpu-1", ("b",)),
        ("gpu-0", ("whole",)),
    ]
    limits = (tmp_path / "state" / "claims" / REF.uid / "limits.d" / "limits").read_text()
    assert f"device GPU-t4 memory {3 * GIB} cores 30\n" in limits
    # No consumedCapacity (consumable capacity off): the request policy's defaults.
    assert f"device GPU-a100 memory {40 * GIB} cores 0\n" in limits


def test_opaque_config_sets_elastic(tmp_path: Path) -> None:
    config = [
        {
            "source": "FromClass",
            "opaque": {
                "driver": KEYS.dra_driver,
                "parameters": {
                    "apiVersion": KEYS.dra_config_api_version,
                    "kind": "GpuShareConfig",
                    "elastic": True,
                },
            },
        },
        {"source": "FromClaim", "opaque": {"driver": "nic.example.com", "parameters": {"mtu": 9000}}},
    ]
    driver(tmp_path, Claims(claim(config=config))).prepare(REF)
    assert "elastic 1\n" in (tmp_path / "state" / "claims" / REF.uid / "limits.d" / "limits").read_text()


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"apiVersion": "tessera.io/v1alpha1", "kind": "GpuShareConfig", "elastic": "yes"},
            "parameters: elastic: Input should be a valid boolean",
        ),
        (
            {"apiVersion": "tessera.io/v1alpha1", "kind": "GpuShareConfig", "memory": "1Gi"},
            "parameters: memory: Extra inputs are not permitted",
        ),
        (
            {"apiVersion": "tessera.io/v9", "kind": "GpuShareConfig"},
            "parameters.apiVersion: 'tessera.io/v9' is not 'tessera.io/v1alpha1'",
        ),
        (
            {"apiVersion": "tessera.io/v1alpha1", "kind": "Other"},
            "parameters: kind: Input should be 'GpuShareConfig'",
        ),
        (["not", "an", "object"], "parameters: expected an object, got a list"),
        (
            {"apiVersion": "tessera.io/v1alpha1", "kind": "GpuShareConfig", "qos": "urgent"},
            "parameters: qos: Input should be 'latency-critical', 'standard' or 'best-effort' (got \"urgent\")",
        ),
        (
            {"apiVersion": "tessera.io/v1alpha1", "kind": "GpuShareConfig", "qos": ["best-effort"]},
            "parameters: qos: Input should be 'latency-critical', 'standard' or 'best-effort'",
        ),
    ],
)
def test_a_malformed_opaque_config_is_refused_with_nothing_written(
    tmp_path: Path, parameters: object, message: str
) -> None:
    config = [{"source": "FromClaim", "opaque": {"driver": KEYS.dra_driver, "parameters": parameters}}]
    with pytest.raises(ContractError) as refused:
        driver(tmp_path, Claims(claim(config=config))).prepare(REF)
    assert f"{REF}: status.allocation.devices.config[0].opaque.{message}" in str(refused.value)
    assert written(tmp_path) == []


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        (None, "not found in the API server"),
        (
            {**claim(), "metadata": {"namespace": "team", "name": "share", "uid": "other"}},
            "the API server has uid 'other'",
        ),
        ({**claim(), "status": {}}, "status.allocation is empty: the claim is not allocated"),
        (
            claim(
                results=[{"request": "gpu", "driver": KEYS.dra_driver, "pool": "node-b", "device": "gpu-0"}]
            ),
            "results[0].pool: 'node-b' is not this node's pool 'node-a'",
        ),
        (
            claim(results=[{"request": "gpu", "driver": KEYS.dra_driver, "pool": NODE, "device": "gpu-7"}]),
            "results[0].device: 'gpu-7' is not a GPU of node 'node-a'",
        ),
        (
            claim(
                results=[
                    {
                        "request": "gpu",
                        "driver": KEYS.dra_driver,
                        "pool": NODE,
                        "device": "gpu-0",
                        "consumedCapacity": {"memory": "lots"},
                    }
                ]
            ),
            "results[0].consumedCapacity.memory: 'lots' is not a quantity",
        ),
        (claim(results=[]), "no device of driver 'tessera.io' is allocated to it"),
        (claim(reserved=()), "status.reservedFor names no pod: the claim is not in use"),
        (
            claim(reserved=(("job", "0ther-uid"),)),  # the pod of that name is another pod now
            "none of the pods in status.reservedFor exists any more",
        ),
        (claim(reserved=(("gone", "1d"),)), "none of the pods in status.reservedFor exists any more"),
    ],
)
def test_a_claim_that_cannot_be_prepared_here_is_refused_with_nothing_written(
    tmp_path: Path, stored: dict[str, object] | None, message: str
) -> None:
    with pytest.raises(ContractError) as refused:
        driver(tmp_path, Claims(*([stored] if stored else []))).prepare(REF)
    assert str(refused.value).startswith(str(REF))
    assert message in str(refused.value)
    assert written(tmp_path) == []


def test_a_claim_uid_that_cannot_name_a_directory_is_refused(tmp_path: Path) -> None:
    bad = ClaimRef(namespace="team", name="share", uid="../../etc")
    with pytest.raises(ContractError, match=r"claim UID: '\.\./\.\./etc' cannot name a directory"):
        driver(tmp_path, Claims(claim(ref=bad))).prepare(bad)
    assert written(tmp_path) == []


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    d = driver(tmp_path, Claims(claim()))
    (tmp_path / "cdi").write_text("a file where the CDI dir should be")
    with pytest.raises(OSError):
        d.prepare(REF)
    assert not (tmp_path / "state" / "claims" / REF.uid).exists()


def test_the_config_spells_the_classes_as_pods_do() -> None:
    assert GpuShareConfig.model_fields["qos"].annotation == (
        Literal["latency-critical", "standard", "best-effort"] | None
    )
    assert get_args(get_args(GpuShareConfig.model_fields["qos"].annotation)[0]) == tuple(
        c.value for c in QosClass
    )


def prepared_class(tmp_path: Path, claims: Claims, qos: QosThresholds | None = None) -> str:
    """The class line of the claim's limits file, and the class dir of its slot (the same)."""
    driver(tmp_path, claims, qos).prepare(REF)
    [line] = [line for line in limits_of(tmp_path).splitlines() if line.startswith("qos ")]
    [slot] = (tmp_path / "state" / "coordination").glob(f"*/*/{REF.uid}")
    assert slot.parent.name == line.removeprefix("qos ")
    return slot.parent.name


@pytest.mark.parametrize(
    ("asked", "priority", "given"),
    [
        # Without qos: the class the pod's priority grants, as a pod without the annotation.
        (None, HIGH, "latency-critical"),
        (None, 0, "standard"),
        (None, None, "standard"),  # no priority: 0
        (None, SCAVENGER, "best-effort"),
        # Asking for the granted class or a lower one: that class.
        ("latency-critical", HIGH, "latency-critical"),
        ("best-effort", HIGH, "best-effort"),
        ("best-effort", 0, "best-effort"),
        ("standard", 0, "standard"),
    ],
)
def test_a_claim_gets_the_class_it_asks_for_within_what_its_pod_is_granted(
    tmp_path: Path, asked: str | None, priority: int | None, given: str
) -> None:
    claims = Claims(
        claim(config=share_config(**({} if asked is None else {"qos": asked}))),
        pods=(pod(priority=priority),),
    )
    assert prepared_class(tmp_path, claims) == given
    assert claims.events == []


def test_asking_for_more_than_granted_gets_the_granted_class_and_an_event_on_each_pod(tmp_path: Path) -> None:
    second = ("job-2", "7c0d0e0f-0000-4000-8000-00000000000b")
    claims = Claims(
        claim(config=share_config(qos="latency-critical"), reserved=(JOB, second)),
        pods=(pod(priority=HIGH), pod(*second, priority=SCAVENGER)),
    )
    # The lowest priority among the claim's pods grants its class: best-effort here.
    assert prepared_class(tmp_path, claims) == "best-effort"
    why = (
        f"{REF}: asked for QoS class latency-critical, runs as best-effort: priority {SCAVENGER} grants at "
        "most best-effort (latency-critical from 1000000, best-effort below 0) and namespace team is not one "
        "whose pods may ask for more"
    )
    assert claims.events == [("job", QOS_LOWERED_REASON, why), ("job-2", QOS_LOWERED_REASON, why)]
    # A repeated prepare answers from the record: no second event.
    driver(tmp_path, claims).prepare(REF)
    assert len(claims.events) == 2


def test_a_listed_namespace_may_ask_for_any_class(tmp_path: Path) -> None:
    claims = Claims(claim(config=share_config(qos="latency-critical")), pods=(pod(priority=SCAVENGER),))
    listed = QosThresholds(latency_critical_namespaces=frozenset({"team"}))
    assert prepared_class(tmp_path, claims, listed) == "latency-critical"
    assert claims.events == []


def test_the_thresholds_are_the_drivers(tmp_path: Path) -> None:
    claims = Claims(claim(), pods=(pod(priority=500),))
    assert (
        prepared_class(tmp_path, claims, QosThresholds(latency_critical_priority=500)) == "latency-critical"
    )


def test_an_event_that_cannot_be_recorded_does_not_fail_the_prepare(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    claims = Claims(claim(config=share_config(qos="latency-critical")), pods=(pod(priority=0),))
    claims.events_fail = True
    assert prepared_class(tmp_path, claims) == "standard"
    assert "cannot tell pod job that its class was lowered: (403)" in caplog.text


def test_consumers_other_than_pods_grant_nothing(tmp_path: Path) -> None:
    stored = claim(reserved=())
    stored["status"]["reservedFor"] = [  # type: ignore[index]
        {"apiGroup": "example.com", "resource": "pods", "name": JOB[0], "uid": JOB[1]}
    ]
    with pytest.raises(ContractError, match=r"status\.reservedFor names no pod"):
        driver(tmp_path, Claims(stored)).prepare(REF)


def test_a_pod_with_a_malformed_priority_fails_the_prepare(tmp_path: Path) -> None:
    bad = pod()
    bad["spec"] = {"priority": "high"}
    with pytest.raises(ContractError, match=r"pod job: spec.priority: must be an integer"):
        driver(tmp_path, Claims(claim(), pods=(bad,))).prepare(REF)
    assert written(tmp_path) == []


def test_a_claim_on_two_gpus_gets_a_slot_and_mounts_on_each(tmp_path: Path) -> None:
    results = [
        {"request": "a", "driver": KEYS.dra_driver, "pool": NODE, "device": "gpu-0"},
        {"request": "b", "driver": KEYS.dra_driver, "pool": NODE, "device": "gpu-1"},
    ]
    claims = Claims(claim(results=results, config=share_config(qos="best-effort")))
    driver(tmp_path, claims).prepare(REF)
    coordination = tmp_path / "state" / "coordination"
    assert sorted(str(p.relative_to(coordination)) for p in coordination.glob(f"*/*/{REF.uid}")) == [
        f"GPU-a100/best-effort/{REF.uid}",
        f"GPU-t4/best-effort/{REF.uid}",
    ]
    [spec_path] = (tmp_path / "cdi").iterdir()
    [device] = json.loads(spec_path.read_text())["devices"]
    mounts = {m["containerPath"]: m["options"][0] for m in device["containerEdits"]["mounts"]}
    for uuid in ("GPU-a100", "GPU-t4"):
        assert mounts[f"{CONTAINER_COORDINATION_DIR}/{uuid}"] == "ro"
        assert mounts[f"{CONTAINER_COORDINATION_DIR}/{uuid}.slot"] == "rw"
    assert "qos best-effort\n" in limits_of(tmp_path)


def test_a_slot_left_by_a_prepare_cut_short_goes(tmp_path: Path) -> None:
    stale = tmp_path / "state" / "coordination" / "GPU-a100" / "latency-critical" / REF.uid
    d = driver(tmp_path, Claims(claim()))
    StateDir.create_slot(stale)
    d.prepare(REF)
    assert not stale.exists()
    assert (stale.parent.parent / "standard" / REF.uid).exists()


def test_the_pods_of_the_claims_prepared_on_a_device_are_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """From the prepared records and each claim's reservedFor now; a claim deleted since, or one whose
    events cannot be recorded, is skipped (logged)."""
    second = ("job-2", "7c0d0e0f-0000-4000-8000-00000000000b")
    on_t4 = ClaimRef("team", "other", "0b1c2d3e-0000-4000-8000-000000000003")
    t4_result = {"request": "gpu", "driver": KEYS.dra_driver, "pool": NODE, "device": "gpu-1"}
    claims = Claims(
        claim(reserved=(JOB, second)),
        claim(on_t4, results=[t4_result], reserved=(("t4-job", "7c0d0e0f-0000-4000-8000-00000000000c"),)),
        pods=(pod(), pod(*second), pod("t4-job", "7c0d0e0f-0000-4000-8000-00000000000c")),
    )
    prepared = driver(tmp_path, claims)
    prepared.prepare(REF)
    prepared.prepare(on_t4)
    (tmp_path / "state" / "claims" / "being-prepared").mkdir()  # no record yet: not prepared
    assert {r.name for r in prepared.prepared()} == {"share", "other"}
    prepared.tell_pods_on("gpu-0", "TesseraGpuUnhealthy", "GPU gone")
    assert claims.events == [
        ("job", "TesseraGpuUnhealthy", f"{REF}: GPU gone"),
        ("job-2", "TesseraGpuUnhealthy", f"{REF}: GPU gone"),
    ]
    claims.events.clear()
    del claims.by_name[("team", "share")]
    prepared.tell_pods_on("gpu-0", "TesseraGpuUnhealthy", "GPU gone")
    assert claims.events == []
    claims.events_fail = True
    prepared.tell_pods_on("gpu-1", "TesseraGpuUnhealthy", "GPU gone")
    assert f"{on_t4}: cannot tell its pods TesseraGpuUnhealthy: (403)" in caplog.text
    prepared.unprepare(REF)
    prepared.unprepare(on_t4)
    assert [r.name for r in prepared.prepared()] == []


def _claim_of(n: int, memory: str, cores: str, device: str = "gpu-0") -> tuple[ClaimRef, dict[str, object]]:
    """Claim ``n`` (its pod ``job-<n>``) of ``memory`` and ``cores`` on ``device``."""
    ref = ClaimRef(namespace="team", name=f"share-{n}", uid=f"0b1c2d3e-0000-4000-8000-00000000010{n}")
    result = {
        "request": "gpu",
        "driver": KEYS.dra_driver,
        "pool": NODE,
        "device": device,
        "shareID": f"5a0e6c1f-1111-4000-8000-00000000010{n}",
        "consumedCapacity": {"memory": memory, "cores": cores},
    }
    return ref, claim(ref, results=[result], reserved=((f"job-{n}", f"uid-{n}"),))


def _claims_of(*made: tuple[ClaimRef, dict[str, object]]) -> Claims:
    return Claims(*(c for _, c in made), pods=tuple(pod(f"job-{n}", f"uid-{n}") for n in range(len(made))))


@pytest.mark.parametrize(
    ("third", "fits"),
    [
        (("8Gi", "40"), True),  # 40 GiB and 100 cores in all: exactly the A100
        (("9Gi", "10"), False),  # 41 GiB of memory
        (("1Gi", "41"), False),  # 101 cores
        (("15Gi", "100", "gpu-1"), True),  # the other GPU's claims do not count
    ],
)
def test_a_claim_allocated_past_its_gpus_capacity_is_prepared_only_once_others_are_unprepared(
    tmp_path: Path, third: tuple[str, ...], fits: bool
) -> None:
    """kube-scheduler can allocate a device's capacity twice when it loses track of an allocation
    (docs/dra.md, "Allocated past a device's capacity"); the node never gives more than the GPU has."""
    made = [_claim_of(0, "16Gi", "30"), _claim_of(1, "16Gi", "30"), _claim_of(2, *third)]
    d = driver(tmp_path, _claims_of(*made))
    for ref, _ in made[:2]:
        d.prepare(ref)
    before = written(tmp_path)
    ref, _ = made[2]
    if fits:
        d.prepare(ref)
        return
    with pytest.raises(ContractError) as refused:
        d.prepare(ref)
    assert str(refused.value).startswith(f"{ref}: gpu-")
    assert OVERCOMMITTED in str(refused.value)
    assert "beside those prepared on it (team/share-0, team/share-1)" in str(refused.value)
    assert written(tmp_path) == before  # nothing of the refused claim
    d.unprepare(made[0][0])
    d.prepare(ref)  # the kubelet's next try, once enough is unprepared
    assert [r.uid for r in d.prepared()] == sorted([made[1][0].uid, ref.uid])


@pytest.mark.parametrize("gone", ["deleted", "deallocated", "made again"])
def test_a_prepared_claim_no_longer_allocated_holds_no_capacity(tmp_path: Path, gone: str) -> None:
    """A record the kubelet never had unprepared (its claim deleted, deallocated, or another claim
    under its name now) does not keep a newly allocated claim off the GPU."""
    made = [_claim_of(0, "24Gi", "60"), _claim_of(1, "24Gi", "60")]
    claims = _claims_of(*made)
    d = driver(tmp_path, claims)
    d.prepare(made[0][0])
    stale = claims.by_name[("team", "share-0")]
    if gone == "deleted":
        del claims.by_name[("team", "share-0")]
    elif gone == "deallocated":
        stale["status"] = {}
    else:
        stale["metadata"] = {**stale["metadata"], "uid": "another"}  # type: ignore[dict-item]
    d.prepare(made[1][0])
    assert {r.uid for r in d.prepared()} == {made[0][0].uid, made[1][0].uid}
