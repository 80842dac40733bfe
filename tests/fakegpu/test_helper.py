"""The Python helper: config lines from specs, bad values named, controls written where the fake reads them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from fakegpu import client_env, example_gpu, gpu_uuid, inject_xid, set_lost, write_config


def test_write_config_writes_one_line_per_gpu(tmp_path: Path) -> None:
    spec = example_gpu(3, numa_node=1, nvlink_peers=(gpu_uuid(4),))
    path = write_config(tmp_path / "gpus.conf", [spec], driver_version="580.1", cuda_version=12080)
    assert path.read_text().splitlines()[1:] == [
        "driver version=580.1 cuda=12080",
        'gpu name="NVIDIA A100-SXM4-80GB" uuid=GPU-00000003-0000-4000-8000-000000000003 memory=81920MiB '
        "sms=108 cc=8.0 pci=0000:13:00.0 numa=1 nvlink=GPU-00000004-0000-4000-8000-000000000004",
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", 'say "hi"'),
        ("uuid", "GPU-123"),
        ("total_memory_mib", 0),
        ("sm_count", -1),
        ("compute_capability", "8.10"),
        ("pci_bus_id", "7:00"),
        ("numa_node", -1),
        ("nvlink_peers", ("nope",)),
    ],
)
def test_a_bad_spec_names_the_field(tmp_path: Path, field: str, value: Any) -> None:
    spec = dataclasses.replace(example_gpu(0), **{field: value})
    with pytest.raises(ValueError, match=f"FakeGpuSpec.{field}: bad value"):
        write_config(tmp_path / "gpus.conf", [spec])


def test_controls_land_in_the_state_dir(tmp_path: Path) -> None:
    uuid = gpu_uuid(0)
    inject_xid(tmp_path / "state", uuid, 79)
    inject_xid(tmp_path / "state", uuid, 48)
    assert (tmp_path / "state" / f"{uuid}.xid").read_text() == "79\n48\n"
    set_lost(tmp_path / "state", uuid, True)
    assert (tmp_path / "state" / f"{uuid}.lost").exists()
    set_lost(tmp_path / "state", uuid, False)
    assert not (tmp_path / "state" / f"{uuid}.lost").exists()
    with pytest.raises(ValueError, match="uuid: bad value"):
        set_lost(tmp_path / "state", "GPU-0", True)


def test_client_env_puts_the_fake_driver_first(tmp_path: Path) -> None:
    env = client_env(tmp_path / "c", tmp_path / "s", {"LD_LIBRARY_PATH": "/opt/lib", "KEEP": "1"})
    assert env["LD_LIBRARY_PATH"].endswith("tools/fakegpu/build:/opt/lib")
    assert env["FAKEGPU_CONFIG"] == str(tmp_path / "c")
    assert env["FAKEGPU_STATE"] == str(tmp_path / "s")
    assert env["KEEP"] == "1"
