"""What the hook (C) and its Python side both spell, checked to be the same: every constant
mirrored between ``hook/src/contract.h`` / ``snapshot.h`` and ``hook/limits.py``,
``hook/region.py``, ``tessera.contract`` and ``docs/hook.md``.

The C side is read two ways: compiled into a probe (``clients/constants_probe.c``, no CUDA headers
needed) for the header constants and the snapshot struct's layout, and asked of ``libvgpu.so`` for
what the build passes in (the paths). The limits file's format is checked end to end: a file that
``hook.limits`` writes is read back by the hook.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest

from hook._library import load_library
from hook.limits import (
    CONTAINER_REGION_FILE,
    LIMITS_FORMAT_VERSION,
    LIMITS_VERSION_WITHOUT_OVERSUBSCRIBED,
    MAX_DEVICES,
    MAX_SHORTFALL_WAIT_MS,
    MAX_UUID_LENGTH,
    MPS_VERSION,
    OVERSUBSCRIBED_VERSION,
    DeviceLimit,
    write_limits,
)
from hook.region import _DeviceUsageC, device_usage_size, read_region
from nodeagent.statedir import StateDir
from tessera.contract import (
    CONTAINER_HOOK_LIBRARY,
    CONTAINER_LIMITS_FILE,
    COORDINATION_SLOT_BYTES,
    COORDINATION_SLOT_SUFFIX,
    MAX_CORES,
    QosClass,
)
from tests.hook.conftest import GIB, MIB, ROOT, Clients, FakeGpus, Processes

PROBE_SOURCE = Path(__file__).resolve().parent / "clients" / "constants_probe.c"
HOOK_SOURCES = ROOT / "hook" / "src"
HOOK_DOCS = ROOT / "docs" / "hook.md"
HOOK_TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def c_side(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The probe's `name value` lines."""
    probe = tmp_path_factory.mktemp("constants") / "constants_probe"
    flags = ["-std=gnu11", "-Wall", "-Wextra", "-Werror", f"-I{HOOK_SOURCES}"]
    subprocess.run(["cc", *flags, "-o", str(probe), str(PROBE_SOURCE)], check=True, timeout=120)
    out = subprocess.run([str(probe)], check=True, capture_output=True, text=True, timeout=30).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def test_limits_file_bounds_match(c_side: dict[str, str]) -> None:
    assert int(c_side["VGPU_LIMITS_VERSION"]) == LIMITS_FORMAT_VERSION
    assert int(c_side["VGPU_MAX_DEVICES"]) == MAX_DEVICES
    assert int(c_side["VGPU_UUID_LEN"]) == MAX_UUID_LENGTH + 1  # C counts the NUL
    assert int(c_side["VGPU_MAX_CORES"]) == MAX_CORES
    assert int(c_side["VGPU_MAX_SHORTFALL_WAIT_MS"]) == MAX_SHORTFALL_WAIT_MS
    # Files without an `oversubscribed` or `mps` line keep the version before them, for older hooks.
    assert int(c_side["VGPU_LIMITS_OVERSUBSCRIBED_VERSION"]) == OVERSUBSCRIBED_VERSION
    assert int(c_side["VGPU_LIMITS_MPS_VERSION"]) == MPS_VERSION == LIMITS_FORMAT_VERSION
    assert LIMITS_VERSION_WITHOUT_OVERSUBSCRIBED == OVERSUBSCRIBED_VERSION - 1 == MPS_VERSION - 2


def test_qos_classes_and_coordination_slots_match(c_side: dict[str, str]) -> None:
    assert {c_side[f"VGPU_QOS_{q.name}"] for q in QosClass} == {q.value for q in QosClass}
    assert c_side["VGPU_COORDINATION_SLOT_SUFFIX"] == COORDINATION_SLOT_SUFFIX
    assert int(c_side["VGPU_COORDINATION_SLOT_BYTES"]) == COORDINATION_SLOT_BYTES
    # The hook reads the versions from its oldest up to the one Python writes.
    assert int(c_side["VGPU_LIMITS_OLDEST_VERSION"]) <= LIMITS_FORMAT_VERSION


def test_region_reader_struct_matches_field_by_field(c_side: dict[str, str]) -> None:
    c_fields = {
        name.removeprefix("field."): tuple(int(v) for v in value.split())
        for name, value in c_side.items()
        if name.startswith("field.")
    }
    py_fields = {
        name: (getattr(_DeviceUsageC, name).offset, getattr(_DeviceUsageC, name).size)
        for name, _ in _DeviceUsageC._fields_
    }
    assert py_fields == c_fields
    assert ctypes.sizeof(_DeviceUsageC) == int(c_side["sizeof.vgpu_device_usage"])


def test_region_reader_struct_matches_the_library(clients: Clients) -> None:
    assert device_usage_size() == ctypes.sizeof(_DeviceUsageC)


def test_hook_defaults_match_the_contract(clients: Clients) -> None:
    library = load_library()
    for name in ("vgpu_default_limits_path", "vgpu_default_region_path", "vgpu_default_hook_path"):
        getattr(library, name).restype = ctypes.c_char_p
    assert library.vgpu_default_limits_path().decode() == CONTAINER_LIMITS_FILE
    assert library.vgpu_default_region_path().decode() == CONTAINER_REGION_FILE
    # Loaded from there (or with that file present), the hook is managed: only the limits file counts.
    assert library.vgpu_default_hook_path().decode() == CONTAINER_HOOK_LIBRARY


def test_environment_variables_are_the_documented_ones_and_each_is_tested(c_side: dict[str, str]) -> None:
    read_by_hook = {value for name, value in c_side.items() if name.startswith("VGPU_ENV_")}
    docs = HOOK_DOCS.read_text()
    documented = set(re.findall(r"`(TESSERA_[A-Z]+(?:_[A-Z]+)*)", docs))
    assert read_by_hook == documented
    # Each is set by some behaviour test of this directory (a rename on one side fails there).
    tests = "".join(p.read_text() for p in HOOK_TESTS.glob("*.py") if p.name != Path(__file__).name)
    assert {name for name in read_by_hook if name not in tests} == set()
    # The memory and cores variables also exist per CUDA ordinal, with the suffix _<i>.
    for per_ordinal in (c_side["VGPU_ENV_MEMORY_LIMIT"], c_side["VGPU_ENV_CORES"]):
        assert f"`{per_ordinal}_<i>`" in docs
        assert f"{per_ordinal}_0" in tests


def test_a_limits_file_written_by_python_is_read_by_the_hook(
    two_gpus: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    # Every line of the format, with values unlike the defaults: version, region, elastic, qos,
    # coordination, device.
    limits, region = tmp_path / "limits", tmp_path / "elsewhere" / "region"
    region.parent.mkdir()
    # The coordination area as the device plugin makes it; a hard link stands in for the mount of
    # the container's own slot next to its GPU's directory.
    state = StateDir(tmp_path / "node")
    state.prepare()
    slot = state.coordination_slot(two_gpus.uuids[0], QosClass.LATENCY_CRITICAL, "pod", "main")
    state.create_slot(slot)
    (state.coordination / f"{two_gpus.uuids[0]}{COORDINATION_SLOT_SUFFIX}").hardlink_to(slot)
    written = [DeviceLimit(two_gpus.uuids[0], 3 * GIB, 30), DeviceLimit(two_gpus.uuids[1], 512 * MIB, 0)]
    write_limits(
        limits,
        written,
        elastic=True,
        region=str(region),
        qos=QosClass.LATENCY_CRITICAL,
        coordination=str(state.coordination),
    )
    env = two_gpus.env(TESSERA_LIMITS_FILE=str(limits))
    result = processes.run([clients.dynamic, "dlsym", "info", "launch", "sleep_us_100", "10", "1"], env)
    assert result.lines[0] == f"info {3 * GIB} {3 * GIB}", result.stderr
    usage = read_region(region)
    read = {d.uuid: (d.memory_quota_bytes, d.cores, d.elastic) for d in usage.devices}
    assert read == {d.uuid: (d.memory_quota_bytes, d.cores, True) for d in written}
    # Latency-critical, it published its launches in its own slot.
    assert slot.read_bytes() != bytes(COORDINATION_SLOT_BYTES)
