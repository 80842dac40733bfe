"""The fake libcuda.so.1 under NVIDIA's driver bindings and the C client: devices as configured,
CUDA_VISIBLE_DEVICES, memory limited per GPU through every allocation API and resolution path,
memory shared across processes and returned by dead ones, cuGetProcAddress versions, config errors."""

from __future__ import annotations

import ctypes
import json
import signal
import sys
import time

import pytest

from fakegpu import BUILD_DIR, write_config
from tests.fakegpu.conftest import BINDINGS_PROBE, ClientProcesses, Gpus, fields

MIB = 2**20
GIB = 2**30
PATHS = ["linked", "dlopen", "procaddr", "procaddr-ptds"]
KINDS = ["mem", "pitch", "managed", "async", "pool", "vmm", "array", "array3d", "mipmap"]


def bindings_report(procs: ClientProcesses, env: dict[str, str], ordinal: int = 0) -> dict[str, object]:
    done = procs.run([sys.executable, BINDINGS_PROBE, str(ordinal)], env)
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout)
    return report


def test_cuda_bindings_sees_the_configured_gpus(gpus: Gpus, procs: ClientProcesses) -> None:
    report = bindings_report(procs, gpus.env())
    assert report["devices"] == [
        {
            "name": spec.model,
            "uuid": spec.uuid.removeprefix("GPU-").replace("-", ""),
            "total": spec.total_memory_mib * MIB,
            "pci": spec.pci_bus_id,
            "sms": spec.sm_count,
        }
        for spec in gpus.specs
    ]


def test_cuda_bindings_allocates_until_the_gpu_is_full(gpus: Gpus, procs: ClientProcesses) -> None:
    report = bindings_report(procs, gpus.env(), ordinal=1)
    assert report["info_before"] == [GIB, GIB]
    assert report["allocated"] == 4
    assert report["first_failure"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert report["info_full"] == [0, GIB]
    assert report["after_free"] == "CUDA_SUCCESS"
    assert report["copy_roundtrip"] is True
    assert report["info_after"] == [GIB, GIB]


@pytest.mark.parametrize(
    ("visible", "names"),
    [
        ("1,0", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]),
        ("1", ["NVIDIA H100 80GB HBM3"]),
        ("GPU-00000001", ["NVIDIA H100 80GB HBM3"]),
        ("00000000-0000", ["NVIDIA A100-SXM4-80GB"]),
        ("1,7,0", ["NVIDIA H100 80GB HBM3"]),
        ("0,0", ["NVIDIA A100-SXM4-80GB"]),
    ],
)
def test_cuda_visible_devices_reorders_and_hides(
    gpus: Gpus, procs: ClientProcesses, visible: str, names: list[str]
) -> None:
    report = bindings_report(procs, gpus.env(CUDA_VISIBLE_DEVICES=visible))
    devices = report["devices"]
    assert isinstance(devices, list)
    assert [d["name"] for d in devices] == names


@pytest.mark.parametrize("visible", ["", "7", "GPU-ffff"])
def test_cuda_visible_devices_hiding_everything_leaves_no_device(
    gpus: Gpus, procs: ClientProcesses, visible: str
) -> None:
    assert bindings_report(procs, gpus.env(CUDA_VISIBLE_DEVICES=visible)) == {"error": "CUDA_ERROR_NO_DEVICE"}


def test_runtime_visibility_applies_before_cuda_visible_devices(gpus: Gpus, procs: ClientProcesses) -> None:
    env = gpus.env(NVIDIA_VISIBLE_DEVICES=gpus.specs[1].uuid, CUDA_VISIBLE_DEVICES="0")
    devices = bindings_report(procs, env)["devices"]
    assert isinstance(devices, list)
    assert [d["name"] for d in devices] == ["NVIDIA H100 80GB HBM3"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_allocation_api_and_path_stops_at_the_gpu_size(
    gpus: Gpus, procs: ClientProcesses, path: str, kind: str
) -> None:
    lines = procs.cuclient(
        gpus.env(), "--path", path, "--device", "1", "alloc", kind, "256m", "5", "info", "free", "info"
    )
    results = [fields(line)["result"] for line in lines if line.startswith("alloc")]
    assert results == ["CUDA_SUCCESS"] * 4 + ["CUDA_ERROR_OUT_OF_MEMORY"]
    infos = [fields(line) for line in lines if line.startswith("info")]
    assert [int(i["free"]) for i in infos] == [0, 256 * MIB]
    assert {int(i["total"]) for i in infos} == {GIB}


@pytest.mark.parametrize("path", PATHS)
def test_the_old_32_bit_cuMemAlloc_is_served_below_version_3020(  # noqa: N802
    gpus: Gpus, procs: ClientProcesses, path: str
) -> None:
    lines = procs.cuclient(gpus.env(), "--path", path, "--device", "1", "alloc", "mem32", "64m", "1", "info")
    assert fields(lines[0])["result"] == "CUDA_SUCCESS"
    assert int(fields(lines[1])["free"]) == GIB - 64 * MIB


def test_processes_on_one_gpu_share_its_memory(gpus: Gpus, procs: ClientProcesses) -> None:
    holder = procs.start(
        [BUILD_DIR / "cuclient", "--device", "1", "alloc", "mem", "768m", "1", "hold"], gpus.env()
    )
    procs.expect(holder, "alloc kind=mem")
    procs.expect(holder, "hold ready")
    lines = procs.cuclient(gpus.env(), "--device", "1", "info", "alloc", "mem", "256m", "2")
    assert int(fields(lines[0])["free"]) == 256 * MIB
    assert [fields(line)["result"] for line in lines[1:]] == ["CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"]


def test_memory_of_exited_and_killed_processes_returns(gpus: Gpus, procs: ClientProcesses) -> None:
    procs.cuclient(gpus.env(), "--device", "1", "alloc", "mem", "512m", "1")  # exits without freeing
    holder = procs.start(
        [BUILD_DIR / "cuclient", "--device", "1", "alloc", "mem", "512m", "1", "hold"], gpus.env()
    )
    procs.expect(holder, "alloc kind=mem size=536870912 index=0 result=CUDA_SUCCESS")
    procs.expect(holder, "hold ready")
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    lines = procs.cuclient(gpus.env(), "--device", "1", "alloc", "mem", "1g", "1")
    assert fields(lines[0])["result"] == "CUDA_SUCCESS"


def test_destroying_a_context_frees_its_memory(gpus: Gpus, procs: ClientProcesses) -> None:
    code = (
        "from cuda.bindings import driver as d\n"
        "d.cuInit(0); dev = d.cuDeviceGet(1)[1]\n"
        "ctx = d.cuCtxCreate(None, 0, dev)[1]\n"
        "assert d.cuMemAlloc(768 << 20)[0] == d.CUresult.CUDA_SUCCESS\n"
        "used = d.cuMemGetInfo()[1]\n"
        "d.cuCtxDestroy(ctx)\n"
        "ctx = d.cuCtxCreate(None, 0, dev)[1]\n"
        "print(used, d.cuMemGetInfo()[1])\n"
    )
    done = procs.run([sys.executable, "-c", code], gpus.env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(256 * MIB), str(GIB)]


class ProcAddress:
    """cuGetProcAddress_v2 of the fake library, called in this process (it needs no cuInit)."""

    NOT_FOUND = 500
    SUCCESS, SYMBOL_NOT_FOUND, VERSION_NOT_SUFFICIENT = 0, 1, 2
    PER_THREAD = 2

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(str(BUILD_DIR / "libcuda.so.1"))
        self.fn = self.lib.cuGetProcAddress_v2
        self.fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64]
        self.fn.argtypes.append(ctypes.POINTER(ctypes.c_int))

    def query(self, name: str, version: int, flags: int = 0) -> tuple[int, int | None, int]:
        pointer, status = ctypes.c_void_p(), ctypes.c_int(-1)
        rc = self.fn(name.encode(), ctypes.byref(pointer), version, flags, ctypes.byref(status))
        return rc, pointer.value, status.value

    def symbol(self, name: str) -> int | None:
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value


def test_cu_get_proc_address_honours_the_abi_version(built: object) -> None:
    proc = ProcAddress()
    assert proc.query("cuMemAlloc", 2000) == (0, proc.symbol("cuMemAlloc"), proc.SUCCESS)
    assert proc.query("cuMemAlloc", 3020) == (0, proc.symbol("cuMemAlloc_v2"), proc.SUCCESS)
    assert proc.query("cuMemAlloc", 13000)[1] == proc.symbol("cuMemAlloc_v2")
    assert proc.query("cuCtxCreate", 11040)[1] == proc.symbol("cuCtxCreate_v3")
    assert proc.query("cuCtxCreate", 12050)[1] == proc.symbol("cuCtxCreate_v4")
    assert proc.query("cuGetProcAddress", 11030)[1] == proc.symbol("cuGetProcAddress")
    assert proc.query("cuGetProcAddress", 12000)[1] == proc.symbol("cuGetProcAddress_v2")
    assert proc.query("cuLaunchKernel", 12000)[1] == proc.symbol("cuLaunchKernel")
    assert proc.query("cuLaunchKernel", 12000, proc.PER_THREAD)[1] == proc.symbol("cuLaunchKernel_ptsz")
    assert proc.query("cuMemcpyHtoD", 12000, proc.PER_THREAD)[1] == proc.symbol("cuMemcpyHtoD_v2_ptds")
    assert proc.query("cuMemAlloc", 12000, proc.PER_THREAD)[1] == proc.symbol("cuMemAlloc_v2")
    assert proc.query("cuMemAllocAsync", 11000) == (proc.NOT_FOUND, None, proc.VERSION_NOT_SUFFICIENT)
    assert proc.query("cuNoSuchCall", 13000) == (proc.NOT_FOUND, None, proc.SYMBOL_NOT_FOUND)
    assert proc.query("cuMemAlloc_v2", 13000) == (proc.NOT_FOUND, None, proc.SYMBOL_NOT_FOUND)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("gpu name=x uuid=GPU-1 memory=1GiB sms=1 cc=8.0 pci=0:1:0.0", "field 'uuid': bad value 'GPU-1'"),
        (
            "gpu name=x uuid=GPU-00000000-0000-4000-8000-000000000000 memory=12XB sms=1 cc=8.0 pci=0:1:0.0",
            "field 'memory': bad value '12XB'",
        ),
        ("gpu name=x uuid=GPU-00000000-0000-4000-8000-000000000000 memory=1GiB cc=8.0 pci=0:1:0.0", "'sms'"),
        ("gpu name=x colour=red", "unknown gpu field 'colour'"),
        ("driver util_window_ms=5", "field 'util_window_ms': bad value '5'"),
        ("driver timeslice_us=0", "field 'timeslice_us': bad value '0' (want 1 to 10000000)"),
        ("driver switch_us=-3", "field 'switch_us': bad value '-3' (want 0 to 1000000)"),
        (
            "gpu name=x uuid=GPU-00000000-0000-4000-8000-000000000000 memory=1GiB sms=1 cc=8.0 pci=0:1:0.0 "
            "timeslice_us=1ms",
            "field 'timeslice_us': bad value '1ms'",
        ),
        (
            "gpu name=x uuid=GPU-00000000-0000-4000-8000-000000000000 memory=1GiB sms=1 cc=8.0 pci=0:1:0.0 "
            "nvlink=GPU-00000009-0000-4000-8000-000000000009",
            "field 'nvlink': bad value 'GPU-00000009-0000-4000-8000-000000000009' (not the uuid of another gpu)",
        ),
        ("gpus name=x", "line must start with 'gpu' or 'driver'"),
    ],
)
def test_a_bad_config_names_the_field_and_the_value(
    gpus: Gpus, procs: ClientProcesses, line: str, message: str
) -> None:
    gpus.config.write_text(line + "\n")
    done = procs.run([BUILD_DIR / "cuclient", "info"], gpus.env())
    assert done.stdout.strip() == "init result=CUDA_ERROR_NO_DEVICE"
    assert f"{gpus.config}:1: " in done.stderr
    assert message in done.stderr


def test_a_bad_nvidia_visible_devices_is_reported(gpus: Gpus, procs: ClientProcesses) -> None:
    done = procs.run([BUILD_DIR / "cuclient", "info"], gpus.env(NVIDIA_VISIBLE_DEVICES="0,GPU-nope"))
    assert done.stdout.strip() == "init result=CUDA_ERROR_NO_DEVICE"
    assert "NVIDIA_VISIBLE_DEVICES: bad value 'GPU-nope' (no such gpu)" in done.stderr


def test_config_round_trips_through_write_config(gpus: Gpus, procs: ClientProcesses) -> None:
    write_config(gpus.config, gpus.specs, driver_version="575.1", cuda_version=12090)
    done = procs.run(
        [sys.executable, "-c", "from cuda.bindings import driver as d; print(d.cuDriverGetVersion()[1])"],
        gpus.env(),
    )
    assert done.stdout.strip() == "12090"


def test_a_missing_config_is_reported(gpus: Gpus, procs: ClientProcesses) -> None:
    env = gpus.env()
    del env["FAKEGPU_CONFIG"]
    done = procs.run([BUILD_DIR / "cuclient", "info"], env)
    assert done.stdout.strip() == "init result=CUDA_ERROR_NO_DEVICE"
    assert "FAKEGPU_CONFIG is not set" in done.stderr


NEW_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc"]


@pytest.mark.sandbox  # needs root for PID namespaces, as containers sharing a fake GPU have
def test_processes_in_other_pid_namespaces_are_accounted(gpus: Gpus, procs: ClientProcesses) -> None:
    # Both clients are pid 1 in their own namespace, as in two containers sharing the state dir.
    holder = procs.start(
        [*NEW_PID_NAMESPACE, BUILD_DIR / "cuclient", "--device", "1", "alloc", "mem", "512m", "1", "hold"],
        gpus.env(),
    )
    procs.expect(holder, "alloc kind=mem size=536870912 index=0 result=CUDA_SUCCESS")
    procs.expect(holder, "hold ready")
    other = procs.run(
        [*NEW_PID_NAMESPACE, BUILD_DIR / "cuclient", "--device", "1", "alloc", "mem", "512m", "2"], gpus.env()
    )
    assert [fields(line)["result"] for line in other.stdout.splitlines()] == [
        "CUDA_SUCCESS",
        "CUDA_ERROR_OUT_OF_MEMORY",
    ]
    procs.stop(holder)  # its namespace's pid 1 may still be exiting when the unshare parent is reaped
    deadline = time.monotonic() + 10
    result = ""
    while result != "CUDA_SUCCESS" and time.monotonic() < deadline:
        after = procs.run(
            [*NEW_PID_NAMESPACE, BUILD_DIR / "cuclient", "--device", "1", "alloc", "mem", "1g", "1"],
            gpus.env(),
        )
        result = fields(after.stdout.splitlines()[0])["result"]
    assert result == "CUDA_SUCCESS"


def test_a_child_forked_while_threads_allocate_never_hangs(gpus: Gpus, procs: ClientProcesses) -> None:
    lines = procs.cuclient(gpus.env(), "forks", "300")
    assert fields(lines[0]) == {"count": "300", "ok": "300"}
