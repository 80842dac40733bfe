"""A host of its own (sandbox.ownhost), where a second sandbox runs beside the first: what it hides
from the machine and what it keeps from it, without a sandbox in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox import host, ownhost
from sandbox.layout import CGROUP_ROOT_ENV, HOST_NODE_PATHS, cgroup_root_of
from tests.waiting import wait_for

# Pure parts first; the rest makes namespaces and mounts (root: the `sandbox` marker).


def test_the_overlays_are_the_top_directories_holding_the_private_paths() -> None:
    assert ownhost.overlaid() == [Path("/opt"), Path("/run"), Path("/var")]
    assert set(HOST_NODE_PATHS) < set(ownhost.PRIVATE_PATHS)
    assert ownhost.overlaid((Path("/a/b"), Path("/a/c"), Path("/d"))) == [Path("/a"), Path("/d")]


def test_a_cgroup_root_from_the_environment_is_one_plain_name() -> None:
    assert cgroup_root_of({}) == "tessera-sandbox"
    assert cgroup_root_of({CGROUP_ROOT_ENV: ownhost.cgroup_root("dra")}) == "tessera-sandbox-dra"
    for bad in ("", "../x", "a/b", "Upper"):
        with pytest.raises(ValueError, match=f"{CGROUP_ROOT_ENV}={bad!r}"):
            cgroup_root_of({CGROUP_ROOT_ENV: bad})


def test_bad_arguments_are_refused_before_anything_is_made(tmp_path: Path) -> None:
    for argv, expected in (
        (["dra", str(tmp_path)], "usage"),
        (["Dra!", str(tmp_path), "true"], "NAME 'Dra!'"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "sandbox.ownhost", *argv],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2 and expected in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def _inside(directory: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox.ownhost", "t", str(directory), *command],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.sandbox
def test_the_node_paths_start_absent_and_nothing_written_under_the_overlays_reaches_the_machine(
    tmp_path: Path,
) -> None:
    marker = f"ownhost-test-{os.getpid()}"
    written = [
        Path("/var/lib/kubelet") / marker,
        Path("/run/netns") / marker,
        Path("/run/containerd") / marker,
        Path("/var/tmp") / marker,
        Path("/opt") / marker,
    ]
    script = "\n".join(
        [
            "set -e",
            "ip -o link show | cut -d: -f2 | sed 's/^ /link /'",
            *(f'[ ! -e {p} ] || echo "present {p}"' for p in ownhost.PRIVATE_PATHS),
            *(f"mkdir -p {p}" for p in written),
            f'echo "cgroup root ${CGROUP_ROOT_ENV}"',
        ]
    )
    try:
        done = _inside(tmp_path / "host", "bash", "-c", script)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["link lo", "cgroup root tessera-sandbox-t"]
        assert [p for p in written if p.exists()] == []
        assert (tmp_path / "host" / "upper" / "var" / "lib" / "kubelet" / marker).is_dir()
    finally:
        for p in written:
            if p.exists():
                shutil.rmtree(p)


@pytest.mark.sandbox
def test_preflight_inside_counts_no_runtime_of_the_machine_and_the_machine_none_of_it(tmp_path: Path) -> None:
    """A containerd of the machine's shares none of the host paths with a sandbox in its own host,
    nor one of the own host's with the machine's sandbox."""
    program = tmp_path / "containerd"
    shutil.copy("/bin/sleep", program)
    outside = subprocess.Popen([str(program), "60"])
    count = "from sandbox import host; print(sorted(p for p, _ in host.processes_named(['containerd'])))"
    try:
        # Seen once it has run the program (a child not yet past exec still has its parent's name).
        wait_for(
            lambda: outside.pid in dict(host.processes_named(["containerd"])),
            timeout=30,
            what="the machine's containerd counted outside",
        )
        script = f'{program} 60 & echo $!; {sys.executable} -c "{count}"; kill $!'
        done = _inside(tmp_path / "host", "bash", "-c", script)
        assert done.returncode == 0, done.stderr
        inside_pid, seen_inside = done.stdout.splitlines()
        assert str(outside.pid) not in seen_inside
        assert seen_inside == f"[{inside_pid}]"
    finally:
        outside.kill()
        outside.wait()
