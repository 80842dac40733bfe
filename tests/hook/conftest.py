"""Fixtures for the hook's tests: the hook and the fake GPU built, the test clients compiled, and
hooked processes started (and always stopped) with a given quota.

Every hooked process runs with ``LD_PRELOAD=hook/build/libvgpu.so`` over the fake ``libcuda.so.1``
and ``libnvidia-ml.so.1`` (``LD_LIBRARY_PATH``), configured by a fake GPU description file.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import fakegpu
from tests.processes import Processes

ROOT = Path(__file__).resolve().parents[2]
HOOK_LIBRARY = fakegpu.HOOK_LIBRARY
CLIENT_SOURCE = Path(__file__).resolve().parent / "clients" / "hook_client.c"
BINDINGS_CLIENT = Path(__file__).resolve().parent / "clients" / "bindings_client.py"
NVML_CLIENT = Path(__file__).resolve().parent / "clients" / "nvml_client.py"
NVML_WATCH = Path(__file__).resolve().parent / "clients" / "nvml_watch.py"
GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Clients:
    linked: Path
    dynamic: Path

    def for_mode(self, mode: str) -> Path:
        return self.linked if mode == "link" else self.dynamic


@pytest.fixture(scope="session")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Clients:
    fakegpu.build_hook()
    fake_build = fakegpu.build()
    out = tmp_path_factory.mktemp("hook-clients")
    cuda_include = fakegpu.find_headers_dir("cuda.h")
    common = ["cc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{cuda_include}"]
    linked, dynamic = out / "hook_client_linked", out / "hook_client"
    subprocess.run(
        [
            *common,
            "-DLINKED",
            "-o",
            str(linked),
            str(CLIENT_SOURCE),
            f"-L{fake_build}",
            "-lcuda",
            "-ldl",
            "-pthread",
        ],
        check=True,
        timeout=120,
    )
    subprocess.run(
        [*common, "-o", str(dynamic), str(CLIENT_SOURCE), "-ldl", "-pthread"], check=True, timeout=120
    )
    return Clients(linked=linked, dynamic=dynamic)


@dataclass
class FakeGpus:
    """A fake GPU description file and what a hooked process needs to run on it."""

    config: Path
    state: Path
    uuids: list[str]
    region: Path
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(
        self, overrides: Mapping[str, str] | None = None, /, *, hooked: bool = True, **variables: str
    ) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "CUDA_", "NVIDIA_"))}
        env = fakegpu.client_env(self.config, self.state, base)
        env.update(TESSERA_REGION=str(self.region), PYTHONPATH=str(ROOT))
        if hooked:
            env["LD_PRELOAD"] = str(HOOK_LIBRARY)
        env.update(self.extra_env)
        env.update(overrides or {})
        env.update(variables)
        return env


def write_fake_gpus(directory: Path, count: int, *, memory_gib: int = 8) -> FakeGpus:
    specs = [fakegpu.example_gpu(i, memory_mib=memory_gib * 1024) for i in range(count)]
    config = fakegpu.write_config(directory / "gpus.conf", specs)
    return FakeGpus(
        config=config,
        state=directory / "fakegpu-state",
        uuids=[s.uuid for s in specs],
        region=directory / "region",
    )


@pytest.fixture
def gpu(tmp_path: Path, clients: Clients) -> FakeGpus:
    """One fake 8 GiB GPU."""
    return write_fake_gpus(tmp_path, 1)


@pytest.fixture
def two_gpus(tmp_path: Path, clients: Clients) -> FakeGpus:
    return write_fake_gpus(tmp_path, 2)


@pytest.fixture
def processes() -> Iterator[Processes]:
    running = Processes()
    try:
        yield running
    finally:
        running.stop_all()
