"""Interception leaves the rest of the dynamic linker's behaviour alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sandbox import images
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


ROUTES = [
    "dlsym-handle",
    "dlvsym-next-dlsym",
    "dlvsym-default-dlsym",
    "dlvsym-libc-dlsym",
    "dlvsym-next-alloc",
    "dlsym-libc-dlvsym",
    "dlsym-next-dlvsym",
    "private-copy",
    "dlmopen-dlsym",
    "dlmopen-own-dlsym",
]


def test_no_lookup_reaches_a_function_around_the_hook(
    gpu: FakeGpus, processes: Processes, tmp_path: Path
) -> None:
    """glibc's dlvsym finds glibc's own dlsym (a versioned lookup skips the hook's unversioned one),
    and through it the driver's own cuMemAlloc_v2; a private copy of libcuda, and libcuda and libc
    loaded into a new link-map namespace (which has no preloaded library), have their own: the hook
    answers dlvsym as it answers dlsym, and either, asked for a driver function or for dlsym on any
    handle, gives its own. Each route gets the 1 GiB quota's four 256 MiB blocks. The same program
    tries the same routes from inside a container (tests/sandbox/test_escapes.py)."""
    program = images.compile_program(images.ESCAPE_SOURCE, tmp_path / "vgpu-escape")
    result = processes.run([program, "routes"], gpu.env(TESSERA_MEMORY_LIMIT="1g"))
    assert {line.split()[0]: line.split()[1:] for line in result.lines} == {
        route: ["hook", "4"] for route in ROUTES
    }, result.stdout

    # The control: without the hook, the same lookups reach glibc's functions and no quota applies.
    unhooked = processes.run([program, "routes"], gpu.env(hooked=False, TESSERA_MEMORY_LIMIT="1g"))
    found = {line.split()[0]: line.split()[1:] for line in unhooked.lines}
    assert int(found["dlvsym-libc-dlsym"][1]) > 4, unhooked.stdout
