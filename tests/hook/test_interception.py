"""Interception leaves the rest of the dynamic linker's behaviour alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import fakegpu
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


DLVSYM_ESCAPE = Path(__file__).resolve().parent / "clients" / "dlvsym_escape.c"
DLVSYM_ATTEMPTS = [
    "dlvsym-next-dlsym",
    "dlvsym-default-dlsym",
    "dlvsym-libc-dlsym",
    "dlvsym-next-alloc",
    "dlsym-libc-dlvsym",
    "dlsym-next-dlvsym",
]


def test_dlvsym_reaches_no_function_around_the_hook(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    """glibc's dlvsym finds glibc's own dlsym (a versioned lookup skips the hook's unversioned one),
    and through it the driver's own cuMemAlloc_v2: the hook answers dlvsym as it answers dlsym."""
    program = tmp_path / "dlvsym_escape"
    include = fakegpu.find_headers_dir("cuda.h")
    subprocess.run(
        [
            "cc",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{include}",
            "-o",
            str(program),
            str(DLVSYM_ESCAPE),
            "-ldl",
        ],
        check=True,
        timeout=120,
    )
    result = processes.run([program], gpu.env(TESSERA_MEMORY_LIMIT="1g"))
    found = {line.split()[0]: line.split()[1:] for line in result.lines}
    assert found.pop("dlsym-handle") == ["hook", "held"], result.stdout
    for attempt in DLVSYM_ATTEMPTS:
        assert found.pop(attempt) == ["hook", "held"], (attempt, result.stdout)
    # glibc finds no cuMemAlloc_v2 of a version in the driver (it has none): nothing to escape through.
    assert found.pop("dlvsym-handle-alloc") in (["absent", "-"], ["hook", "held"]), result.stdout
    assert found == {}

    # The control: without the hook, the same lookups reach glibc's functions and no quota applies.
    unhooked = processes.run([program], gpu.env(hooked=False, TESSERA_MEMORY_LIMIT="1g"))
    assert "dlvsym-libc-dlsym hook escaped" in unhooked.lines, unhooked.stdout
