"""The committed gRPC stubs match the .proto files, and the method paths are the kubelet's."""

from __future__ import annotations

import re
from pathlib import Path

from proto import generate
from proto.deviceplugin.v1beta1 import api_pb2 as dp
from proto.dra.v1 import api_pb2 as dra
from proto.pluginregistration.v1 import api_pb2 as reg
from proto.podresources.v1 import api_pb2 as pr

# Lines that name the generator's version, not the API: a newer grpcio-tools may differ only there.
_VERSION_STAMP = re.compile(
    r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*|    \d+,)$", flags=re.MULTILINE
)


def _normalized(path: Path) -> str:
    return _VERSION_STAMP.sub("<version>", path.read_text())


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*"))
    assert len(generated) == 2 * len(generate.PROTO_FILES)
    stale = [
        str(rel) for rel in generated if _normalized(tmp_path / rel) != _normalized(generate.REPO_ROOT / rel)
    ]
    assert not stale, f"stubs out of date, run `make -C proto`: {stale}"


def test_method_paths_are_the_kubelets() -> None:
    plugin = dp.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert {f"/{plugin.full_name}/{m.name}" for m in plugin.methods} == {
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        "/v1beta1.DevicePlugin/ListAndWatch",
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "/v1beta1.DevicePlugin/Allocate",
        "/v1beta1.DevicePlugin/PreStartContainer",
    }
    assert dp.DESCRIPTOR.services_by_name["Registration"].full_name == "v1beta1.Registration"
    lister = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert {f"/{lister.full_name}/{m.name}" for m in lister.methods} == {
        "/v1.PodResourcesLister/List",
        "/v1.PodResourcesLister/GetAllocatableResources",
        "/v1.PodResourcesLister/Get",
    }
    driver = dra.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert {f"/{driver.full_name}/{m.name}" for m in driver.methods} == {
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
    }
    registration = reg.DESCRIPTOR.services_by_name["Registration"]
    assert {f"/{registration.full_name}/{m.name}" for m in registration.methods} == {
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    }


def test_wire_field_numbers() -> None:
    def numbers(message: object) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(dp.RegisterRequest) == {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}
    assert numbers(dp.Device) == {"ID": 1, "health": 2, "topology": 3}
    assert numbers(dp.ContainerAllocateRequest) == {"devices_ids": 1}
    assert numbers(dp.ContainerPreferredAllocationRequest) == {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    }
    assert numbers(dp.ContainerAllocateResponse) == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    assert numbers(dp.Mount) == {"container_path": 1, "host_path": 2, "read_only": 3}
    assert numbers(pr.ContainerDevices) == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert numbers(pr.PodResources) == {
        "name": 1,
        "namespace": 2,
        "containers": 3,
        "cpu_ids": 4,
        "memory": 5,
    }


def test_dra_wire_field_numbers() -> None:
    def numbers(message: object) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(dra.Claim) == {"namespace": 1, "uid": 2, "name": 3}
    assert numbers(dra.NodePrepareResourcesRequest) == {"claims": 1}
    assert numbers(dra.NodePrepareResourcesResponse) == {"claims": 1}
    assert numbers(dra.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
    assert numbers(dra.Device) == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    assert numbers(dra.NodeUnprepareResourcesRequest) == {"claims": 1}
    assert numbers(dra.NodeUnprepareResourceResponse) == {"error": 1}
    assert numbers(reg.PluginInfo) == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert numbers(reg.RegistrationStatus) == {"plugin_registered": 1, "error": 2}
    assert numbers(reg.InfoRequest) == {}
    assert numbers(reg.RegistrationStatusResponse) == {}
