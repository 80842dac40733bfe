"""The DRA driver's /metrics: each prepared claim's per-container series, labelled as the device
plugin's with the claim's name (and its pod and container for a pod's own claim), measured with the
same readers, and nothing a tenant writes raising them; and which containers of a pod use a claim."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fakegpu
from draplugin.claims import claim_containers, plan_claim
from draplugin.metrics import ClaimCollector
from nodeagent.containermetrics import CONTAINER_LABELS
from nodeagent.health import HealthBook
from nodeagent.nvml import GpuReading
from nodeagent.statedir import REGION_NAME, StateDir
from tessera.contract import KEYS, MIB, GpuInfo
from tests.draplugin.test_driver import A100, GIB, JOB, NODE, REF, T4, Claims, claim, driver, pod

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(
    state: StateDir,
    book: HealthBook | None = None,
    reading: Callable[[str], GpuReading | None] = lambda uuid: None,
) -> Series:
    health = (book or HealthBook((A100.uuid, T4.uuid), 1.0)).state
    registry = CollectorRegistry()
    registry.register(ClaimCollector(NODE, (A100, T4), state, health=health, reading=reading))
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def labels(
    pod_name: str = JOB[0], container: str = "main", claim_name: str = REF.name
) -> frozenset[tuple[str, str]]:
    return frozenset(
        {
            "namespace": REF.namespace,
            "pod": pod_name,
            "container": container,
            "claim": claim_name,
            "Hostname": NODE,
            "UUID": A100.uuid,
            "modelName": A100.model,
        }.items()
    )


def owned(body: dict[str, object], owner: tuple[str, str] = JOB) -> dict[str, object]:
    """The claim as the ResourceClaim controller makes it from a pod's template: the pod controls it."""
    owner_reference = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": owner[0],
        "uid": owner[1],
        "controller": True,
    }
    body["metadata"] = {**body["metadata"], "ownerReferences": [owner_reference]}  # type: ignore[dict-item]
    return body


def using(name: str, uid: str, *containers: str) -> dict[str, object]:
    """A pod whose ``containers`` use the claim (its entry ``gpu`` names it), and one that does not."""
    body = pod(name, uid)
    body["spec"] = {
        "resourceClaims": [{"name": "gpu", "resourceClaimName": REF.name}],
        "containers": [{"name": c, "resources": {"claims": [{"name": "gpu"}]}} for c in containers]
        + [{"name": "sidecar"}],
    }
    return body


def test_a_pods_own_claim_has_the_container_series_with_its_pod_container_and_name(tmp_path: Path) -> None:
    d = driver(tmp_path, Claims(owned(claim()), pods=(using(*JOB, "main"),)))
    d.prepare(REF)
    found = scrape(d.state)
    one = labels()
    assert {name for name, _ in found} >= {
        "tessera_container_memory_quota_bytes",
        "tessera_container_memory_used_bytes",
        "tessera_container_memory_peak_bytes",
        "tessera_container_allocations_refused_total",
        "tessera_container_compute_quota_ratio",
        "tessera_container_gpu_busy_seconds_total",
        "tessera_container_throttled_seconds_total",
    }
    assert found["tessera_container_memory_quota_bytes", one] == GIB
    assert found["tessera_container_compute_quota_ratio", one] == 0.3
    # No process has used the GPU yet (no region): nothing held, nothing refused.
    assert found["tessera_container_memory_used_bytes", one] == 0
    assert found["tessera_container_allocations_refused_total", one] == 0
    # The device plugin's label names, no other.
    assert {name for lbls in (k[1] for k in found) for name, _ in lbls} == set(CONTAINER_LABELS)
    d.unprepare(REF)
    assert not [name for name, _ in scrape(d.state) if name.startswith("tessera_container_")]


def test_a_claim_that_is_not_one_pods_or_one_containers_names_none(tmp_path: Path) -> None:
    """Its quota and use are the claim's: no pod or container label could split them. A claim
    created on its own may be shared by any pod of its namespace, later ones too (the kubelet
    prepares it once per node), whichever pods it is reserved for at prepare."""
    second = ("job-2", "7c0d0e0f-0000-4000-8000-00000000000b")
    d = driver(tmp_path, Claims(claim(), pods=(using(*JOB, "main"),)))
    d.prepare(REF)
    assert scrape(d.state)["tessera_container_memory_quota_bytes", labels("", "")] == GIB
    d.unprepare(REF)
    # Controlled by a pod it is not reserved for (no pod may use it but that one): none either.
    d = driver(tmp_path, Claims(owned(claim(), second), pods=(using(*JOB, "main"),)))
    d.prepare(REF)
    assert scrape(d.state)["tessera_container_memory_quota_bytes", labels("", "")] == GIB
    d.unprepare(REF)
    # The pod's own, used by two of its containers: the pod, no container.
    d = driver(tmp_path, Claims(owned(claim()), pods=(using(*JOB, "main", "helper"),)))
    d.prepare(REF)
    assert scrape(d.state)["tessera_container_memory_quota_bytes", labels(container="")] == GIB


def gpu(info: GpuInfo) -> frozenset[tuple[str, str]]:
    return frozenset({"Hostname": NODE, "UUID": info.uuid, "modelName": info.model}.items())


def test_each_gpu_has_the_device_plugins_gpu_series_its_claims_quotas_adding_up(tmp_path: Path) -> None:
    """The series the overcommit alerts and the dashboard's GPU panels read, as the device plugin
    serves them: each GPU's allocation is the sum of the quotas of the claims prepared on it, its
    health the health book's, its memory and utilisation NVML's."""
    d = driver(tmp_path, Claims(owned(claim()), pods=(using(*JOB, "main"),)))
    book = HealthBook((A100.uuid, T4.uuid), 1.0)
    readings = {A100.uuid: GpuReading(A100.uuid, 40 * GIB, 3 * GIB, 0.25)}
    a100, t4 = gpu(A100), gpu(T4)
    assert scrape(d.state, book, readings.get)["tessera_gpu_memory_allocated_bytes", a100] == 0
    d.prepare(REF)
    found = scrape(d.state, book, readings.get)
    assert found["tessera_gpu_memory_allocated_bytes", a100] == GIB
    assert found["tessera_gpu_cores_allocated_ratio", a100] == 0.3
    assert found["tessera_gpu_memory_capacity_bytes", a100] == A100.total_memory_mib * MIB
    assert found["tessera_gpu_memory_allocated_bytes", t4] == 0
    assert found["tessera_gpu_cores_allocated_ratio", t4] == 0
    assert found["tessera_gpu_healthy", a100] == found["tessera_gpu_healthy", t4] == 1
    assert found["tessera_gpu_memory_used_bytes", a100] == 3 * GIB
    assert found["tessera_gpu_utilization_ratio", a100] == 0.25
    # NVML has no reading of the T4: none of its NVML series, the others stay.
    assert ("tessera_gpu_memory_used_bytes", t4) not in found
    book.record_xid(A100.uuid, 79)
    found = scrape(d.state, book, readings.get)
    assert found["tessera_gpu_healthy", a100] == 0
    assert found["tessera_gpu_healthy", t4] == 1
    d.unprepare(REF)
    assert scrape(d.state, book, readings.get)["tessera_gpu_memory_allocated_bytes", a100] == 0


def test_what_a_tenant_writes_raises_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The claim's containers write only its region (its record is the driver's, outside their
    mounts): a region that is no region reads as nothing used, the quota stays the record's."""
    fakegpu.build_hook()  # the region's reader
    d = driver(tmp_path, Claims(owned(claim()), pods=(using(*JOB, "main"),)))
    d.prepare(REF)
    region = d.state.claim(REF.uid).state / REGION_NAME
    region.write_bytes(b"\xff" * 4096)
    with caplog.at_level(logging.WARNING):
        found = scrape(d.state)
    assert found["tessera_container_memory_used_bytes", labels()] == 0
    assert found["tessera_container_memory_quota_bytes", labels()] == GIB
    region.unlink()
    os.mkfifo(region)  # never waited on
    assert scrape(d.state)["tessera_container_memory_used_bytes", labels()] == 0


def test_records_that_are_not_a_claims_own_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = driver(tmp_path, Claims(claim(), pods=(using(*JOB, "main"),)))
    d.prepare(REF)
    record = json.loads(d.state.claim(REF.uid).prepared.read_text())
    # A record copied under another claim's dir names another claim: not that claim's.
    other = d.state.claim("0b1c2d3e-0000-4000-8000-000000000099")
    other.root.mkdir()
    other.prepared.write_text(json.dumps(record))
    broken = d.state.claim("0b1c2d3e-0000-4000-8000-000000000098")
    broken.root.mkdir()
    broken.prepared.write_text("{")
    # A record of before v2 has no quotas: no series until the claim is prepared again.
    older = d.state.claim("0b1c2d3e-0000-4000-8000-000000000097")
    older.root.mkdir()
    v1 = {k: v for k, v in record.items() if k not in ("quotas", "pod", "containers")}
    older.prepared.write_text(json.dumps({**v1, "version": "v1", "uid": older.root.name, "name": "old"}))
    with caplog.at_level(logging.WARNING):
        found = scrape(d.state)
        scrape(d.state)
    assert {dict(k[1])["claim"] for k in found if k[0].startswith("tessera_container_")} == {REF.name}
    assert caplog.text.count(f"{broken.prepared}: not JSON") == 1


def test_the_containers_of_a_pod_that_use_a_claim() -> None:
    body = {
        "spec": {
            "resourceClaims": [
                {"name": "direct", "resourceClaimName": "share"},
                {"name": "templated", "resourceClaimTemplateName": "gpu-template"},
                {"name": "elsewhere", "resourceClaimName": "other"},
            ],
            "initContainers": [{"name": "warm", "resources": {"claims": [{"name": "templated"}]}}],
            "containers": [
                {"name": "main", "resources": {"claims": [{"name": "direct"}]}},
                {"name": "train", "resources": {"claims": [{"name": "templated", "request": "gpu"}]}},
                {"name": "net", "resources": {"claims": [{"name": "elsewhere"}]}},
                {"name": "plain"},
            ],
        },
        "status": {"resourceClaimStatuses": [{"name": "templated", "resourceClaimName": "job-gpu-x7k2p"}]},
    }
    assert claim_containers(body, "share") == ("main",)
    assert claim_containers(body, "job-gpu-x7k2p") == ("warm", "train")
    assert claim_containers(body, "unknown") == ()
    # Only labels come of it: what cannot be read names no container.
    assert claim_containers({"spec": {"resourceClaims": "x", "containers": [1]}}, "share") == ()
    assert claim_containers({"spec": None}, "share") == ()


@pytest.mark.parametrize(
    ("references", "owner"),
    [
        ([{"apiVersion": "v1", "kind": "Pod", "name": "job", "uid": "u-1", "controller": True}], "u-1"),
        # Owned, not controlled; or controlled by something else than a pod: any pod may share it.
        ([{"apiVersion": "v1", "kind": "Pod", "name": "job", "uid": "u-1"}], None),
        (
            [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "u-2", "controller": True}],
            None,
        ),
        ("not a list", None),
        (None, None),
    ],
)
def test_a_pods_own_claim_is_the_one_it_controls(references: object, owner: str | None) -> None:
    body = claim()
    body["metadata"] = {**body["metadata"], "ownerReferences": references}  # type: ignore[dict-item]
    assert plan_claim(body, REF, NODE, (A100, T4), KEYS).owner_uid == owner
