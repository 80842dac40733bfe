"""Interception leaves the rest of the dynamic linker's behaviour alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.hook.conftest import HOOK_LIBRARY, Clients, FakeGpus, Processes

PROBE = Path(__file__).resolve().parent / "clients" / "rtld_next_probe.c"


@pytest.mark.parametrize("hooked", [False, True])
def test_rtld_next_still_means_after_the_caller(
    hooked: bool, gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    """Another interposer loaded after the hook finds the next definition, not its own."""
    common = ["cc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fPIC"]
    first, second, program = tmp_path / "libfirst.so", tmp_path / "libsecond.so", tmp_path / "probe"
    subprocess.run([*common, "-shared", "-DPROBE_FIRST", "-o", str(first), str(PROBE), "-ldl"], check=True)
    subprocess.run([*common, "-shared", "-DPROBE_SECOND", "-o", str(second), str(PROBE)], check=True)
    subprocess.run([*common, "-o", str(program), str(PROBE), "-ldl"], check=True)
    preload = [str(HOOK_LIBRARY)] if hooked else []
    env = gpu.env(hooked=False, LD_PRELOAD=" ".join([*preload, str(first), str(second)]))
    assert processes.run([program], env).lines == ["2"]
