"""A real Kubernetes control plane as local processes: etcd, kube-apiserver, kube-scheduler and
kube-controller-manager.

Used by the tests (through ``tests/conftest.py``) and by ``tessera sandbox``. Binaries come from
``hack/k8s-binaries.sh``, which builds them from Go modules into a cache outside the work tree.
Everything listens on 127.0.0.1 with free ports, and every process started here is stopped by
:meth:`ControlPlane.stop` (each runs in its own process group, so children go with it).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.layout import SERVICE_CIDR

# The Kubernetes version everything is built at (hack/k8s-binaries.sh has the same default).
K8S_VERSION = "v1.34.10"
# The newest Kubernetes, which the DRA path needs (consumable capacity, on by default since 1.36):
# built by K8S_VERSION=v1.37.2 hack/k8s-binaries.sh.
DRA_K8S_VERSION = "v1.37.2"
BIN_ENV = "TESSERA_K8S_BIN"
CACHE_ENV = "TESSERA_K8S_CACHE"
ADMIN_TOKEN = "tessera-admin-token"
LOOPBACK = "127.0.0.1"

REQUIRED_BINARIES = ("etcd", "kube-apiserver", "kube-scheduler")


class ControlPlaneError(RuntimeError):
    """A control-plane process could not be started or did not become ready."""


def bin_dir_for(version: str) -> Path:
    """Where hack/k8s-binaries.sh puts a version's binaries by default (K8S_VERSION=<version>)."""
    return Path.home() / ".cache" / "tessera" / f"k8s-{version}" / "bin"


def default_bin_dir() -> Path:
    if os.environ.get(BIN_ENV):
        return Path(os.environ[BIN_ENV])
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "bin"
    return bin_dir_for(K8S_VERSION)


def find_binaries(bin_dir: Path | None = None, names: Sequence[str] = REQUIRED_BINARIES) -> Path:
    """The directory holding ``names``; a clear error saying how to build them when absent."""
    directory = bin_dir or default_bin_dir()
    missing = [n for n in names if not os.access(directory / n, os.X_OK)]
    if missing:
        raise ControlPlaneError(
            f"{', '.join(missing)} not found in {directory}: run hack/k8s-binaries.sh "
            f"(or set {BIN_ENV} to a directory holding them)"
        )
    return directory


# Where free_port looks when the kernel's ephemeral range cannot be read (Linux's default is
# 32768-60999).
_EPHEMERAL_DEFAULT = (32768, 60999)
_LOWEST_PORT = 10000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


# Every port free_port has handed out in this process. A port is free only until its server binds
# it, so two calls before either server starts could otherwise name the same port (CI saw an
# extender's verbs and health ports collide); never handing one out twice closes that window.
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A port free on the loopback address now and never handed out before by this process, below
    the kernel's ephemeral range when there is room: a server restarted on its port (etcd,
    kube-apiserver, the kubelet in the chaos test) must find it free again, and a port from the
    ephemeral range can meanwhile become the local end of any outgoing connection on the host,
    which keeps it for as long as that connection lives."""
    with _handed_out_lock:
        for port in _port_candidates():
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    raise ControlPlaneError("no free loopback port left that this process has not handed out already")


def _port_candidates() -> Iterator[int]:
    """Random ports below the ephemeral range when it leaves room, then ports the kernel picks."""
    low, _ = _ephemeral_range()
    if low - _LOWEST_PORT >= 1000:
        rng = random.SystemRandom()
        for _ in range(100):
            yield rng.randrange(_LOWEST_PORT, low)
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            port: int = s.getsockname()[1]
        yield port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


@dataclass
class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers; safe to call twice."""
        if self.popen is None:
            return
        pgid = self.popen.pid
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                self.popen.wait()
        # Children that outlived their parent still share its process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        self.popen = None


def _insecure_tls() -> ssl.SSLContext:
    # Readiness probes only: each component self-signs a serving certificate on loopback. Clients
    # proper verify the apiserver against its certificate (see kubeconfig_for).
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def wait_http_ok(
    url: str, process: ManagedProcess, timeout: float, token: str | None = None, path_ok: int = 200
) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not process.running:
            raise ControlPlaneError(f"{process.name} exited while starting:\n{process.log_tail()}")
        request = urllib.request.Request(url)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=2, context=_insecure_tls()) as response:
                if response.status == path_ok:
                    return
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.2)
    raise ControlPlaneError(
        f"{process.name} not ready at {url} after {timeout:.0f}s ({last}):\n{process.log_tail()}"
    )


@dataclass
class ControlPlane:
    """etcd + kube-apiserver (+ kube-scheduler on demand) under ``work_dir``."""

    work_dir: Path
    bin_dir: Path = field(default_factory=default_bin_dir)
    extra_tokens: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Additional bearer tokens: token -> (user name, comma-separated groups), for RBAC tests."""
    service_accounts: bool = False
    """Whether kube-controller-manager will run (:meth:`start_controller_manager`): then the
    ServiceAccount admission plugin is on and every pod gets its service account's token."""
    address: str = LOOPBACK
    """Where kube-apiserver listens and what it advertises as the `kubernetes` Service's endpoint.
    Pods cannot reach the host's loopback; the sandbox uses the pod bridge's own address."""

    api_port: int = 0
    etcd_port: int = 0
    processes: list[ManagedProcess] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"https://{self.address}:{self.api_port}"

    @property
    def etcd_url(self) -> str:
        return f"http://{LOOPBACK}:{self.etcd_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.work_dir / "admin.kubeconfig"

    def kubeconfig_for(self, token: str, name: str) -> Path:
        """A kubeconfig authenticating with ``token`` (one of ``extra_tokens`` or the admin's)."""
        path = self.work_dir / f"{name}.kubeconfig"
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: local\n  cluster:\n    server: {self.api_url}\n"
            f"    certificate-authority: {self.work_dir / 'pki' / 'apiserver.crt'}\n"
            f"users:\n- name: {name}\n  user:\n    token: {token}\n"
            f"contexts:\n- name: local\n  context:\n    cluster: local\n    user: {name}\n"
            "current-context: local\n"
        )
        return path

    def start(self, timeout: float = 90.0) -> None:
        find_binaries(self.bin_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_etcd_and_apiserver(timeout)
        except BaseException:
            self.stop()
            raise

    def _start_etcd_and_apiserver(self, timeout: float) -> None:
        certs = self.work_dir / "pki"
        certs.mkdir(exist_ok=True)
        self._service_account_keys(certs)
        tokens = self.work_dir / "tokens.csv"
        rows = [f'{ADMIN_TOKEN},admin,admin,"system:masters"']
        rows += [f'{tok},{user},{user},"{groups}"' for tok, (user, groups) in self.extra_tokens.items()]
        tokens.write_text("\n".join(rows) + "\n")

        self.etcd_port, etcd_peer = free_port(), free_port()
        etcd_port = self.etcd_port
        etcd = ManagedProcess(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls=http://{LOOPBACK}:{etcd_port}",
                f"--advertise-client-urls=http://{LOOPBACK}:{etcd_port}",
                f"--listen-peer-urls=http://{LOOPBACK}:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://{LOOPBACK}:{etcd_peer}",
                f"--initial-cluster=default=http://{LOOPBACK}:{etcd_peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
            self.work_dir / "logs" / "etcd.log",
        )
        self._launch(etcd)
        wait_http_ok(f"http://{LOOPBACK}:{etcd_port}/health", etcd, timeout)

        self.api_port = free_port()
        apiserver = ManagedProcess(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://{LOOPBACK}:{etcd_port}",
                f"--bind-address={self.address}",
                f"--advertise-address={self.address}",
                f"--secure-port={self.api_port}",
                f"--cert-dir={certs}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--service-account-issuer=https://{self.address}:{self.api_port}/",
                f"--service-account-key-file={certs / 'sa.pub'}",
                f"--service-account-signing-key-file={certs / 'sa.key'}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                *self._admission(),
                *self._endpoint_reconciler(),
                # Every sandbox node's kubelet serves on its InternalIP; names of nodes resolve nowhere.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--v=1",
            ],
            self.work_dir / "logs" / "kube-apiserver.log",
        )
        self._launch(apiserver)
        wait_http_ok(f"{self.api_url}/readyz", apiserver, timeout, token=ADMIN_TOKEN)
        self.kubeconfig_for(ADMIN_TOKEN, "admin")

    def _admission(self) -> list[str]:
        # Without kube-controller-manager nothing would create default service accounts. The tests'
        # control planes run no node-lifecycle controller (their fake nodes have no heartbeat), so
        # nothing would lift the not-ready taint from their new nodes; the sandbox's node is waited
        # for until Ready before anything is scheduled, so the taint would add nothing there.
        if self.service_accounts:
            return ["--disable-admission-plugins=TaintNodesByCondition"]
        return ["--disable-admission-plugins=ServiceAccount,TaintNodesByCondition"]

    def _endpoint_reconciler(self) -> list[str]:
        # The `kubernetes` Service's endpoint is the advertised address; 1.37 refuses a loopback one
        # ("may not be in the loopback range"), and no pod could reach it there anyway.
        return ["--endpoint-reconciler-type=none"] if self.address == LOOPBACK else []

    def restart_apiserver(self, timeout: float = 90.0) -> None:
        """Stop kube-apiserver and start it again on the same port, with the same certificates and
        etcd (clients see their connections drop and their watches end, as in an upgrade)."""
        [apiserver] = [p for p in self.processes if p.name == "kube-apiserver"]
        apiserver.stop()
        apiserver.start()
        wait_http_ok(f"{self.api_url}/readyz", apiserver, timeout, token=ADMIN_TOKEN)

    def start_scheduler(
        self, config_yaml: str, name: str = "kube-scheduler", timeout: float = 60.0
    ) -> ManagedProcess:
        """Start kube-scheduler with a KubeSchedulerConfiguration; ``{kubeconfig}`` in it is filled in."""
        find_binaries(self.bin_dir, ("kube-scheduler",))
        config = self.work_dir / f"{name}.yaml"
        config.write_text(config_yaml.replace("{kubeconfig}", str(self.kubeconfig)))
        port = free_port()
        scheduler = ManagedProcess(
            name,
            [
                str(self.bin_dir / "kube-scheduler"),
                f"--config={config}",
                f"--secure-port={port}",
                f"--bind-address={LOOPBACK}",
                "--leader-elect=false",
                "--v=2",
            ],
            self.work_dir / "logs" / f"{name}.log",
        )
        self._launch(scheduler)
        try:
            wait_http_ok(f"https://{LOOPBACK}:{port}/healthz", scheduler, timeout)
        except BaseException:
            self.stop_process(scheduler)
            raise
        return scheduler

    def start_controller_manager(
        self, timeout: float = 60.0, controllers: Sequence[str] = ("*",)
    ) -> ManagedProcess:
        """Start kube-controller-manager with ``controllers`` (by default every controller a cluster
        runs by default, as the sandbox does); returns once its health endpoint answers.

        Not among them: bootstrap-signer and token-cleaner (off by default), node-ipam and the cloud
        provider's (no --allocate-node-cidrs, no cloud), and certificatesigningrequest-signing,
        which needs a CA's key: kube-apiserver's self-signed CA keeps its key to itself, and nothing
        here asks for a certificate (kubelets authenticate with a token)."""
        find_binaries(self.bin_dir, ("kube-controller-manager",))
        certs = self.work_dir / "pki"
        port = free_port()
        manager = ManagedProcess(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                f"--secure-port={port}",
                f"--bind-address={LOOPBACK}",
                f"--cert-dir={certs / 'controller-manager'}",
                "--leader-elect=false",
                f"--controllers={','.join(controllers)}",
                # Tokens signed with the key whose public half kube-apiserver verifies
                # (--service-account-key-file), and the CA pods use to verify kube-apiserver.
                f"--service-account-private-key-file={certs / 'sa.key'}",
                f"--root-ca-file={self._root_ca(certs)}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--use-service-account-credentials=false",
                "--v=1",
            ],
            self.work_dir / "logs" / "kube-controller-manager.log",
        )
        self._launch(manager)
        try:
            wait_http_ok(f"https://{LOOPBACK}:{port}/healthz", manager, timeout)
        except BaseException:
            self.stop_process(manager)
            raise
        return manager

    def stop_process(self, process: ManagedProcess) -> None:
        process.stop()
        if process in self.processes:
            self.processes.remove(process)

    def stop(self) -> None:
        """Stop everything started here, newest first; the rest are still stopped when stopping one
        is cut short (an interrupt: a run stopped with SIGTERM while it tears down)."""
        while self.processes:
            process = self.processes.pop()
            try:
                process.stop()
            except BaseException:
                self.stop()
                raise

    def _launch(self, process: ManagedProcess) -> None:
        self.processes.append(process)
        process.start()

    @staticmethod
    def _root_ca(certs: Path) -> Path:
        """kube-apiserver's self-signed CA alone (``ca.crt``): its ``apiserver.crt`` is the serving
        certificate followed by that CA, and a root CA file must hold CAs only (1.37's
        ClusterTrustBundle publisher refuses it otherwise)."""
        blocks = re.findall(
            r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----\n",
            (certs / "apiserver.crt").read_text(),
            re.S,
        )
        if len(blocks) < 2:
            raise ControlPlaneError(f"{certs / 'apiserver.crt'}: no CA after the serving certificate")
        ca = certs / "ca.crt"
        ca.write_text("".join(blocks[1:]))
        return ca

    @staticmethod
    def _service_account_keys(certs: Path) -> None:
        key, pub = certs / "sa.key", certs / "sa.pub"
        if key.exists() and pub.exists():
            return
        for args in (
            ["openssl", "genrsa", "-out", str(key), "2048"],
            ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(pub)],
        ):
            result = subprocess.run(args, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise ControlPlaneError(f"{' '.join(args)} failed: {result.stderr.strip()}")

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fake_node_body(
    name: str, capacity: dict[str, str], annotations: dict[str, str] | None = None
) -> dict[str, object]:
    """A Node without a kubelet: its status (capacity, allocatable, Ready) is written by the caller.

    Used by tests, benchmarks and ``tessera sandbox add-node`` to make scheduling across many nodes
    visible without running a kubelet for each.
    """
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "tessera.local/fake-node": "true"},
            "annotations": dict(annotations or {}),
        },
        "status": {
            "capacity": dict(capacity),
            "allocatable": dict(capacity),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "FakeNode",
                    "message": "a node object without a kubelet, for scheduling only",
                }
            ],
        },
    }
