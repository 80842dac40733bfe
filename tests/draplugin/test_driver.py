"""Prepare / unprepare: the limits file and CDI spec a claim gets, restarts, bad input."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from draplugin.claims import ClaimRef
from draplugin.driver import Driver
from nodeagent.statedir import StateDir
from tessera.contract import (
    CONTAINER_HOOK_LIBRARY,
    CONTAINER_LD_SO_PRELOAD,
    CONTAINER_LIMITS_DIR,
    CONTAINER_STATE_DIR,
    KEYS,
    MIB,
    ContractError,
    GpuInfo,
)

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


def claim(
    ref: ClaimRef = REF,
    results: list[dict[str, object]] | None = None,
    config: list[dict[str, object]] | None = None,
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
        "status": {"allocation": {"devices": {"results": results, "config": config or []}}},
    }


class Claims:
    """The API server's claims, as the driver reads them; counts the reads."""

    def __init__(self, *claims: Mapping[str, object]) -> None:
        self.by_name = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims}  # type: ignore[index]
        self.reads = 0

    def read_claim(self, namespace: str, name: str) -> Mapping[str, object] | None:
        self.reads += 1
        return self.by_name.get((namespace, name))


def driver(tmp_path: Path, claims: Claims) -> Driver:
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
    )


def written(tmp_path: Path) -> list[str]:
    return sorted(
        str(p.relative_to(tmp_path))
        for p in tmp_path.rglob("*")
        if p.is_file() and ("claims" in p.parts or "cdi" in p.parts)
    )


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
    [spec_path] = (tmp_path / "cdi").iterdir()
    spec = json.loads(spec_path.read_text())
    assert spec["kind"] == f"{KEYS.dra_driver}/gpu-share"
    [cdi_device] = spec["devices"]
    assert cdi_device["name"] == REF.uid
    edits = cdi_device["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-a100"]
    mounts = {m["containerPath"]: (m["hostPath"], m["options"][0]) for m in edits["mounts"]}
    assert mounts == {
        CONTAINER_LIMITS_DIR: (str(where / "limits.d"), "ro"),
        CONTAINER_STATE_DIR: (str(where / "state"), "rw"),
        CONTAINER_HOOK_LIBRARY: (str(tmp_path / "libvgpu.so"), "ro"),
        CONTAINER_LD_SO_PRELOAD: (str(tmp_path / "state" / "ld.so.preload"), "ro"),
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
