"""`make images`: the product image and the chart's scheduler image, built with buildah from the
repository's Dockerfile and deploy/images/scheduler.Dockerfile, then looked into.

The build is incremental (buildah's layer cache, the base image cached by its recipe), so after the
first run this costs seconds unless the product changed. Every working container a test creates is
removed when the test ends, failed or not; so is the build if it runs past its time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from sandbox.containerd import images
from sandbox.controlplane import ADMIN_TOKEN, LOOPBACK, ControlPlane, ManagedProcess, free_port, wait_http_ok
from sandbox.layout import Layout
from sandbox.processes import start, stop, wait_for

pytestmark = pytest.mark.images

BUILD_TIMEOUT = 1800.0
PRODUCT_PACKAGES = ("tessera", "extender", "nodeagent", "deviceplugin", "draplugin", "hook", "proto")
# The tools and what only they import: none of it may be in the product image.
NOT_SHIPPED = ("simulator", "sandbox", "fakegpu", "matplotlib", "rich")
HOOK_LIBRARY = "usr/local/tessera/libvgpu.so"
CONTAINER_PREFIX = "tessera-images-test-"
BASE_IMAGE = "localhost/tessera-base:bookworm"


def _version(repo_root: Path) -> str:
    match = re.search(r'^version = "([^"]+)"', (repo_root / "pyproject.toml").read_text(), re.M)
    assert match, "no version in pyproject.toml"
    return match.group(1)


def _scheduler_image(repo_root: Path) -> str:
    """The chart's kube-scheduler image on the pinned cluster version (its tag follows the cluster's)."""
    image = yaml.safe_load((repo_root / "charts" / "tessera" / "values.yaml").read_text())["scheduler"][
        "image"
    ]
    match = re.search(
        r'^K8S_VERSION="\$\{K8S_VERSION:-(v[^}]+)\}"$',
        (repo_root / "hack" / "k8s-binaries.sh").read_text(),
        re.M,
    )
    assert match, "no K8S_VERSION in hack/k8s-binaries.sh"
    return f"{image['registry']}/{image['repository']}:{image['tag'] or match.group(1)}"


def _buildah(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["buildah", "--storage-driver", "overlay", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check:
        assert result.returncode == 0, f"buildah {' '.join(args)}: {result.stderr}"
    return result


def _our_containers() -> list[str]:
    listed = _buildah("containers", "--format", "{{.ContainerName}}").stdout.split()
    return [name for name in listed if name.startswith(CONTAINER_PREFIX)]


@pytest.fixture(scope="module")
def built(repo_root: Path) -> dict[str, Path]:
    """`make images` run once for the module; the OCI archives by image name."""
    process = subprocess.Popen(
        ["make", "--no-print-directory", "images"],
        cwd=repo_root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=BUILD_TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, output[-6000:]
    out = repo_root / "build" / "images"
    return {
        f"docker.io/library/tessera:{_version(repo_root)}": out / "tessera.tar",
        _scheduler_image(repo_root): out / "kube-scheduler.tar",
        f"docker.io/library/tessera-example-python:{_version(repo_root)}": out / "tessera-example-python.tar",
    }


@pytest.fixture
def container() -> Iterator[Callable[[str], str]]:
    """``container(image)``: a buildah working container of ``image``; all removed after the test."""
    made: list[str] = []

    def make(image: str) -> str:
        name = CONTAINER_PREFIX + uuid.uuid4().hex[:8]
        made.append(name)
        _buildah("from", "--pull-never", "--name", name, image)
        return name

    yield make
    for name in made:
        _buildah("umount", name, check=False)
        _buildah("rm", name, check=False)
    assert not [name for name in _our_containers() if name in made]


def _run(name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return _buildah("run", "--isolation", "chroot", name, "--", *argv, check=False)


def _site_packages(root: Path) -> list[Path]:
    found = [
        *root.glob("opt/*/lib/python3*/site-packages"),
        *root.glob("usr/local/lib/python3*/site-packages"),
    ]
    assert found, f"no site-packages under {root}"
    return found


def test_the_product_image_holds_the_product_and_nothing_of_the_tools(
    built: dict[str, Path], container: Callable[[str], str]
) -> None:
    image = next(name for name in built if "/tessera:" in name)
    root = Path(_buildah("mount", container(image)).stdout.strip())
    installed = {p.name for d in _site_packages(root) for p in d.iterdir()}
    assert set(PRODUCT_PACKAGES) <= installed, set(PRODUCT_PACKAGES) - installed
    assert not set(NOT_SHIPPED) & installed, set(NOT_SHIPPED) & installed
    assert (root / HOOK_LIBRARY).is_file()
    assert (root / HOOK_LIBRARY).read_bytes()[:4] == b"\x7fELF"
    # The host's CA bundle is mounted over the build's during RUN steps only (hack/build-images.sh):
    # the image keeps its base image's bundle, whatever the build host trusts.
    base = Path(_buildah("mount", container(BASE_IMAGE)).stdout.strip())
    bundle = "etc/ssl/certs/ca-certificates.crt"
    assert (root / bundle).read_bytes() == (base / bundle).read_bytes()


def test_the_components_run_in_the_image_as_a_non_root_user(
    built: dict[str, Path], container: Callable[[str], str]
) -> None:
    image = next(name for name in built if "/tessera:" in name)
    config = json.loads(_buildah("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]
    uid = config["User"].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, config["User"]
    assert config["Entrypoint"] == ["tessera-device-plugin"]
    name = container(image)
    # buildah run runs as the image's user, as a container runtime would.
    whoami = _run(name, "id", "-u")
    assert whoami.returncode == 0 and whoami.stdout.strip() == uid, whoami.stderr
    for command in ("tessera-extender", "tessera-device-plugin", "tessera-mps-control", "tessera-dra"):
        result = _run(name, command, "--help")
        assert result.returncode == 0, f"{command} --help: {result.stdout}{result.stderr}"
        assert "usage:" in result.stdout.lower(), result.stdout


def test_the_example_workload_image_is_a_users_image_with_nvidias_clients_only(
    built: dict[str, Path], container: Callable[[str], str]
) -> None:
    """deploy/examples/python-workload: NVIDIA's Python clients from PyPI, nothing of Tessera (the
    hook reaches it through the node agent's Allocate, not through the image), a non-root user."""
    image = next(name for name in built if "tessera-example-python" in name)
    root = Path(_buildah("mount", container(image)).stdout.strip())
    installed = {p.name for d in _site_packages(root) for p in d.iterdir()}
    assert {"pynvml.py", "cuda"} <= installed, sorted(installed)
    assert not set(PRODUCT_PACKAGES) & installed
    assert not (root / HOOK_LIBRARY).exists()
    config = json.loads(_buildah("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["python3", "/usr/local/bin/quota_probe.py"]


def test_the_scheduler_image_runs_the_pinned_kube_scheduler(
    built: dict[str, Path], container: Callable[[str], str]
) -> None:
    image = next(name for name in built if "kube-scheduler" in name)
    result = _run(container(image), "kube-scheduler", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"Kubernetes {image.rsplit(':', 1)[1]}"


@pytest.mark.k8s
def test_the_scheduler_image_serves_as_its_non_root_user(
    built: dict[str, Path], container: Callable[[str], str], control_plane: ControlPlane, tmp_path: Path
) -> None:
    """The image as the chart runs it (command kube-scheduler --config=...), as the image's user
    (65532, no root), against the real API server: it starts and its /healthz answers."""
    image = next(name for name in built if "kube-scheduler" in name)
    files = tmp_path / "scheduler"
    files.mkdir(mode=0o755)
    files.chmod(0o755)
    mounted = "/etc/tessera-scheduler"
    (files / "ca.crt").write_bytes((control_plane.work_dir / "pki" / "apiserver.crt").read_bytes())
    (files / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: local\n  cluster:\n    server: {control_plane.api_url}\n"
        f"    certificate-authority: {mounted}/ca.crt\n"
        f"users:\n- name: admin\n  user:\n    token: {ADMIN_TOKEN}\n"
        "contexts:\n- name: local\n  context:\n    cluster: local\n    user: admin\n"
        "current-context: local\n"
    )
    (files / "config.yaml").write_text(
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
        f"clientConnection:\n  kubeconfig: {mounted}/kubeconfig\n"
        "leaderElection:\n  leaderElect: false\n"
        "profiles:\n  - schedulerName: tessera-scheduler\n"
    )
    for path in files.iterdir():
        path.chmod(0o644)
    port = free_port()
    scheduler = ManagedProcess(
        "kube-scheduler-image",
        [
            *("buildah", "--storage-driver", "overlay", "run", "--isolation", "chroot"),
            *("--volume", f"{files}:{mounted}:ro", container(image), "--"),
            *("kube-scheduler", f"--config={mounted}/config.yaml", f"--secure-port={port}"),
            f"--bind-address={LOOPBACK}",
        ],
        tmp_path / "kube-scheduler.log",
    )
    scheduler.start()
    try:
        wait_http_ok(f"https://{LOOPBACK}:{port}/healthz", scheduler, timeout=60)
    finally:
        scheduler.stop()


# A containerd of its own, but containerd 1.6 keeps some host paths whatever it is told
# (sandbox/layout.py): it runs in the sandbox lane, never beside a sandbox.
@pytest.mark.sandbox
def test_the_images_are_imported_into_a_running_sandbox_containerd(
    built: dict[str, Path], repo_root: Path
) -> None:
    """With a sandbox's containerd answering (here a private one laid out as the sandbox lays it out),
    the script imports the archives through the sandbox's own importer, under the names the kubelet
    asks for."""
    # A short root, as the sandbox's own: containerd's ttrpc socket path must fit sockaddr_un.
    layout = Layout(Path(tempfile.mkdtemp(prefix="tsi-", dir="/tmp")))
    layout.containerd_socket.parent.mkdir(parents=True)
    layout.containerd_config.write_text(
        "version = 2\n"
        f'root = "{layout.containerd_root}"\n'
        f'state = "{layout.containerd_state}"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{layout.containerd_socket}"\n'
    )
    containerd = start(
        "containerd", ["containerd", "--config", str(layout.containerd_config)], layout.log("containerd")
    )
    try:
        wait_for("the containerd socket", layout.containerd_socket.exists, containerd, timeout=60)
        result = subprocess.run(
            [str(repo_root / "hack" / "build-images.sh")],
            cwd=repo_root,
            env={**os.environ, "TESSERA_SANDBOX_ROOT": str(layout.root)},
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-6000:]
        assert "importing into the sandbox's containerd" in result.stderr
        assert set(built) <= set(images(layout)), images(layout)
    finally:
        stop(containerd)
        shutil.rmtree(layout.root, ignore_errors=True)


def test_the_oci_archives_name_their_image_in_full(built: dict[str, Path]) -> None:
    """`ctr images import` names an image by its reference annotation, and the kubelet asks for fully
    qualified names: tessera:0.1.0 is docker.io/library/tessera:0.1.0."""
    for image, archive in built.items():
        with tarfile.open(archive) as tar:
            member = tar.extractfile("index.json")
            assert member is not None
            index = json.load(member)
        names = [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]]
        assert names == [image], names
