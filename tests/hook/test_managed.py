"""Fail closed in Kubernetes: a hook that Tessera manages (loaded from the path the device plugin
mounts it at, or with that file present) takes its limits from the limits file only, and refuses
device memory when that file is missing, unreadable or broken, whatever the environment says.

The hook under test is a second build of ``libvgpu.so`` whose compiled-in paths (library, limits
file, region) lie in a temporary directory instead of ``/usr/local/tessera`` and ``/var/run/tessera``,
so that a test can stand where the device plugin stands.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import fakegpu
from hook.limits import DeviceLimit, write_limits
from hook.region import read_region
from tests.hook.conftest import GIB, MIB, ROOT, Clients, FakeGpus
from tests.processes import Processes

OOM = "error CUDA_ERROR_OUT_OF_MEMORY"


@dataclass(frozen=True)
class ManagedHook:
    """A hook built for a container rooted at `root`: `library` is where the device plugin would
    mount it, `limits` and `region` its compiled-in limits file and region."""

    root: Path
    build: Path

    @property
    def library(self) -> Path:
        return self.root / "tessera" / "libvgpu.so"

    @property
    def limits(self) -> Path:
        return self.root / "limits"

    @property
    def region(self) -> Path:
        return self.root / "state" / "region"


@pytest.fixture(scope="session")
def managed_build(tmp_path_factory: pytest.TempPathFactory, clients: Clients) -> ManagedHook:
    root = tmp_path_factory.mktemp("managed")
    hook = ManagedHook(root=root, build=root / "build")
    subprocess.run(
        [
            "make",
            "-s",
            "-C",
            str(ROOT / "hook"),
            f"PYTHON={sys.executable}",
            f"BUILD={hook.build}",
            f"HOOK_FILE={hook.library}",
            f"LIMITS_FILE={hook.limits}",
            f"REGION_FILE={hook.region}",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return hook


@pytest.fixture
def managed(managed_build: ManagedHook) -> Iterator[ManagedHook]:
    """The container as the device plugin leaves it, less the limits file (each test writes its own)."""
    hook = managed_build
    hook.library.parent.mkdir(exist_ok=True)
    shutil.copy(hook.build / "libvgpu.so", hook.library)
    hook.region.parent.mkdir(exist_ok=True)
    try:
        yield hook
    finally:
        for path in (hook.library.parent, hook.region.parent):
            shutil.rmtree(path, ignore_errors=True)
        if hook.limits.is_dir() and not hook.limits.is_symlink():
            shutil.rmtree(hook.limits)
        else:
            hook.limits.unlink(missing_ok=True)


def env_for(gpu: FakeGpus, library: Path, **variables: str) -> dict[str, str]:
    """A hooked process's environment, with every variable a tenant might set to raise its limits."""
    escape = gpu.config.parent / "generous-limits"
    write_limits(escape, [DeviceLimit(gpu.uuids[0], 8 * GIB, 0)], region=str(gpu.region))
    tenant = {
        "LD_PRELOAD": str(library),
        "TESSERA_LIMITS_FILE": str(escape),
        "TESSERA_MEMORY_LIMIT": "8g",
        "TESSERA_MEMORY_LIMIT_0": "8g",
    }
    return gpu.env({**tenant, **variables}, hooked=False)


def hook_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tessera-hook[")]


def test_managed_without_a_limits_file_refuses_memory_whatever_the_environment(
    managed: ManagedHook, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", "1m", "alloc", "1m"], env_for(gpu, managed.library)
    )
    assert result.lines == [OOM, OOM]
    (line,) = hook_lines(result.stderr)  # one line, not one per allocation
    assert line.endswith(f"limits file {managed.limits}: No such file or directory; refusing device memory")


def test_managed_without_limits_gets_the_smallest_compute_share(
    managed: ManagedHook, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    result = processes.run([clients.dynamic, "dlsym", "info"], env_for(gpu, managed.library))
    assert result.lines == ["info 0 0"], result.stderr
    device = read_region(managed.region).device(gpu.uuids[0])
    assert device is not None
    assert (device.memory_quota_bytes, device.cores) == (0, 1)


def make_fifo(path: Path) -> str:
    os.mkfifo(path)
    return "not a regular file"


def make_directory(path: Path) -> str:
    path.mkdir()
    return "not a regular file"


def make_symlink(path: Path) -> str:
    target = path.parent / "limits-elsewhere"
    write_limits(target, [DeviceLimit(fakegpu.gpu_uuid(0), 8 * GIB, 0)])
    path.symlink_to(target)
    return "Too many levels of symbolic links"


def make_garbage(path: Path) -> str:
    path.write_bytes(b"\x7fELF\x02\x01\x01 version 1\n")
    return "line 1: unknown line starting with"


def make_binary(path: Path) -> str:
    path.write_bytes(b"version 1\n\x00device")
    return "contains a NUL byte"


def make_huge(path: Path) -> str:
    path.write_text("version 1\n" + "# padding\n" * 10_000)
    return "larger than 65536 bytes"


def make_unreadable(path: Path) -> str:
    path.write_text("version 1\n")
    path.chmod(0)
    return "Permission denied" if os.geteuid() != 0 else "no device lines"


@pytest.mark.parametrize(
    "make", [make_fifo, make_directory, make_symlink, make_garbage, make_binary, make_huge, make_unreadable]
)
def test_managed_with_a_broken_limits_file_refuses_memory_at_once(
    make: object, managed: ManagedHook, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    assert callable(make)
    message = make(managed.limits)
    started = time.monotonic()
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", "1m"], env_for(gpu, managed.library), timeout=30
    )
    assert time.monotonic() - started < 20  # a FIFO does not hang the process
    assert result.lines == [OOM]
    (line,) = hook_lines(result.stderr)
    assert f"limits file {managed.limits}" in line and message in line, line


def test_managed_with_a_limits_file_holds_its_quota_and_ignores_the_environment(
    managed: ManagedHook, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    write_limits(managed.limits, [DeviceLimit(gpu.uuids[0], GIB, 0)], region=str(managed.region))
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", "768m", "alloc", "512m", "info"], env_for(gpu, managed.library)
    )
    assert result.lines == ["ok 0", OOM, f"info {256 * MIB} {GIB}"], result.stderr
    assert hook_lines(result.stderr) == []


def test_a_copy_preloaded_from_elsewhere_is_managed_while_the_mounted_library_is_there(
    managed: ManagedHook, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    copy = managed.build / "libvgpu.so"
    result = processes.run([clients.dynamic, "dlsym", "alloc", "1m"], env_for(gpu, copy))
    assert result.lines == [OOM]
    # Without the device plugin's mount the same library is unmanaged: today's standalone behaviour.
    shutil.rmtree(managed.library.parent)
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", "1g", "info"], env_for(gpu, copy, TESSERA_LIMITS_FILE="")
    )
    assert result.lines == ["ok 0", f"info {7 * GIB} {8 * GIB}"], result.stderr


def test_removing_the_library_after_it_loaded_leaves_it_managed(
    managed: ManagedHook, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    """What counts is where the library was loaded from, remembered by the loader."""
    process = processes.start(
        [clients.dynamic, "dlsym", "wait-stdin", "alloc", "1m"], env_for(gpu, managed.library)
    )
    assert process.stdout is not None and process.stdin is not None
    assert process.stdout.readline().strip() == "waiting"
    shutil.rmtree(managed.library.parent)
    process.stdin.write("go\n")
    process.stdin.flush()
    out, _ = process.communicate(timeout=60)
    assert out.splitlines() == [OOM]
