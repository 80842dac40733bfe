"""Fixtures for the sandbox tests: sandboxes always brought down again, and a snapshot of the host to
compare with afterwards.

Only one sandbox runs on a host at a time. A module that needs the shared sandbox's configuration
(the chart's defaults but for best-effort oversubscription, on; with Prometheus) and does not change
it takes ``shared_sandbox``: those modules run one
after another (``pytest_collection_modifyitems``) on one sandbox, and each module's pods in
``default`` are deleted after it. A module's ``SHARED_SANDBOX_TURN`` says where among them it runs
when its place matters: ``FIRST`` for one that reads the cluster's history since `up` (metrics),
``LAST`` for the one that kills components and at its end brings the sandbox down, checking the host
is clean; it is brought down anyway after the last sharing test
(``pytest_runtest_teardown``). A module that tests up, restarts of the whole sandbox or other values
brings up its own (``running_sandbox``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from nodeagent.statedir import StateDir
from sandbox import cluster, host, install, kubeapi, nodelife, record
from sandbox.layout import BRIDGE, CGROUP_ROOT, HOST_NODE_PATHS, Layout
from tessera.contract import KEYS, parse_inventory
from tests.waiting import wait_for


@dataclass(frozen=True)
class HostView:
    """What a clean host looks like, seen without the sandbox's own bookkeeping."""

    dirs: dict[str, bool]
    sysctls: dict[str, str]

    @staticmethod
    def now() -> HostView:
        return HostView(
            dirs={str(p): p.exists() for p in HOST_NODE_PATHS},
            sysctls={
                k: (Path("/proc/sys") / k).read_text().strip()
                for k in host.TRACKED_SYSCTLS
                if (Path("/proc/sys") / k).exists()  # nf_conntrack's appear once the module loads
            },
        )


def kube_iptables_chains() -> list[str]:
    """KUBE-* chains in any table, IPv4 and IPv6, as iptables-save prints them."""
    found = []
    for save in ("iptables-save", "ip6tables-save"):
        out = subprocess.run([save], capture_output=True, text=True, check=True).stdout
        found += [f"{save} {line.split()[0][1:]}" for line in out.splitlines() if line.startswith(":KUBE-")]
    return found


def differences(before: HostView, root: Path) -> list[str]:
    """Everything the sandbox could leave, checked directly from /proc, /sys and `ip`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(root) in cmdline:
                found.append(f"process {entry.name}: {cmdline.replace(chr(0), ' ')[:100]}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith((str(root), "/run/containerd", "/var/lib/kubelet")):
            found.append(f"mount {point}")
    found += [f"cgroup {d}" for d in Path("/sys/fs/cgroup").glob(f"*/{CGROUP_ROOT}")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    found += [
        f"link {line.split(':')[1].strip()}"
        for line in links.splitlines()
        if BRIDGE in line or "veth" in line or "tsnode" in line
    ]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    found += [f"network namespace {line.split()[0]}" for line in namespaces.splitlines() if "tessera" in line]
    routes = subprocess.run(["ip", "route", "show"], capture_output=True, text=True, check=True).stdout
    found += [f"route {line}" for line in routes.splitlines() if line.startswith("10.244.")]
    found += [f"iptables chain {c}" for c in kube_iptables_chains()]
    after = HostView.now()
    found += [f"directory {d}" for d, existed in before.dirs.items() if not existed and after.dirs[d]]
    found += [
        f"sysctl {k}={after.sysctls.get(k)} (was {v})"
        for k, v in before.sysctls.items()
        if after.sysctls.get(k) != v
    ]
    return found


@dataclass
class Sandbox:
    root: Path
    state: record.SandboxState
    api: client.ApiClient

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def wait_pod(self, name: str, phase: str, namespace: str = "default", timeout: float = 90) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            pod = kubeapi.retried(lambda: self.core.read_namespaced_pod(name, namespace))
            if pod.status.phase == phase:
                return pod
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"pod {namespace}/{name} is {pod.status.phase}, not {phase}: {pod.status}"
                )
            time.sleep(0.5)

    def state_dirs(self) -> dict[str, StateDir]:
        """Each node's Tessera state directory, by node name, where the host keeps it."""
        layout = Layout(self.root)
        dirs = {self.state.node: StateDir(install.host_dirs(layout).state)}
        for node in self.state.nodes:
            of_node = layout.of_node(node.name)
            dirs[node.name] = StateDir(of_node.place(install.host_dirs(of_node).state))
        return dirs

    def gpu_capacity(self) -> dict[str, int]:
        """Every node's GPUs' memory in MiB, by UUID, from their inventories."""
        capacity = {}
        for node in kubeapi.retried(lambda: self.core.list_node().items):
            text = (node.metadata.annotations or {}).get(KEYS.node_gpus)
            for g in parse_inventory(text) if text else ():
                capacity[g.uuid] = g.total_memory_mib
        return capacity

    def logs(self, name: str, namespace: str = "default", until: str = "", timeout: float = 30) -> str:
        """The pod's log through the apiserver and the kubelet; waits until ``until`` appears."""
        deadline = time.monotonic() + timeout
        while True:
            text: str = kubeapi.retried(lambda: self.core.read_namespaced_pod_log(name, namespace))
            if until in text or time.monotonic() > deadline:
                return text
            time.sleep(0.5)


@pytest.fixture
def host_before() -> HostView:
    return HostView.now()


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    # Short and outside pytest's deep temporary tree: containerd's socket path must fit sockaddr_un.
    root = Path(f"/tmp/tessera-sbx-{os.getpid()}")
    try:
        yield root
    finally:
        cluster.down(root, report=lambda _: None)
        shutil.rmtree(root, ignore_errors=True)


# Where a sandbox's logs are kept when a test failed while it ran: the sandbox goes, and CI's log
# shows only the assertion.
KEPT_LOGS = Path(__file__).resolve().parents[2] / "build" / "test-logs" / "sandboxes"


def keep_logs(root: Path, into: Path) -> None:
    """The sandbox's process logs, and every node's pod logs and Tessera state directory (the served
    records and limits files), copied into ``into``; what cannot be copied (a socket) is left."""
    layout = Layout(root)
    places = {
        "logs": layout.logs,
        "node/pod-logs": layout.pod_logs,
        "node/state": install.host_dirs(layout).state,
    }
    homes = layout.node_homes
    for home in sorted(homes.iterdir()) if homes.is_dir() else ():
        of_node = layout.of_node(home.name)
        places[f"{home.name}/pod-logs"] = of_node.place(of_node.pod_logs)
        places[f"{home.name}/state"] = of_node.place(install.host_dirs(of_node).state)
    for where, path in places.items():
        if path.is_dir():
            with contextlib.suppress(shutil.Error):
                shutil.copytree(path, into / where, symlinks=True, dirs_exist_ok=True)


def _sandboxes_of(item: pytest.Item) -> list[Sandbox]:
    """The sandboxes among a test's fixture values, alone or in a (Sandbox, HostView) pair, that are
    still there (a test may have taken one down)."""
    values = getattr(item, "funcargs", {}).values()
    found = [sbx for value in values for sbx in (value if isinstance(value, tuple) else (value,))]
    # One sandbox is often several of the test's fixtures (``fleet``, ``sbx``, a pair): once each.
    by_root = {sbx.root: sbx for sbx in found if isinstance(sbx, Sandbox) and sbx.root.is_dir()}
    return list(by_root.values())


def keep_logs_of_failed(item: pytest.Item) -> str:
    """The logs of each sandbox a failed test used, kept at once: a module's last test may bring the
    sandbox down (the fleet's, the shared one's) before its fixture's teardown would keep them.
    Returns their last errors (:func:`last_errors`), for the failure's report: a CI machine and what
    it kept are gone once its run ends."""
    digests = []
    for sbx in _sandboxes_of(item):
        keep_logs(sbx.root, KEPT_LOGS / sbx.root.name)
        digests.append(last_errors(Layout(sbx.root).logs))
    return "\n".join(filter(None, digests))


# The logs whose errors say why a node stopped serving, and how an error line begins in each: klog's
# level and date ("E1207 04:22:31.123456"), containerd's logrus field. Left out: a container's status
# asked for after it was removed (NotFound), which both log at every pod's deletion.
NODE_LOGS = ("kubelet.log", "containerd.log")
ERROR_LINE = re.compile(r"^E\d{4} |level=error")
ROUTINE_ERROR = re.compile(r"code = NotFound")


def last_errors(logs: Path, per_log: int = 6, width: int = 240) -> str:
    """The last ``per_log`` error lines (cut to ``width``) of each node's kubelet and containerd log,
    routine ones left out."""
    digest = []
    for log in sorted(logs.glob("*.log")) if logs.is_dir() else ():
        if not log.name.endswith(NODE_LOGS):
            continue
        with log.open(errors="replace") as lines:
            errors = [
                line.rstrip()[:width]
                for line in lines
                if ERROR_LINE.search(line) and not ROUTINE_ERROR.search(line)
            ]
        if errors:
            digest.append(f"{logs.parent.name}/{log.name}:")
            digest.extend(f"  {line}" for line in errors[-per_log:])
    return "\n".join(digest)


@contextlib.contextmanager
def running_sandbox(
    name: str,
    session: pytest.Session,
    values: tuple[str, ...] = (),
    *,
    monitoring: bool = False,
    mode: record.Mode = "deviceplugin",
    nodes: int = 1,
) -> Iterator[tuple[Sandbox, HostView]]:
    """A sandbox for a whole test module (Tessera installed with these extra chart ``values``, and
    Prometheus with ``monitoring``; the chart's ``mode`` (cluster.in_mode); ``nodes`` real nodes),
    always brought down, with the host as it was before; its logs kept under ``KEPT_LOGS`` when a
    test of the ``session`` failed while it ran."""
    before = HostView.now()
    failed_before = session.testsfailed
    root = Path(f"/tmp/tessera-{name}-{os.getpid()}")
    try:
        options = cluster.Options(root=root, values=values, monitoring=monitoring, nodes=nodes)
        options = cluster.in_mode(options, mode)
        state = cluster.up(options, report=lambda _: None)
        api = config.new_client_from_config(config_file=state.kubeconfig)
        try:
            yield Sandbox(root, state, api), before
        finally:
            api.close()
    finally:
        if session.testsfailed > failed_before:
            keep_logs(root, KEPT_LOGS / root.name)
        cluster.down(root, report=lambda _: None)
        shutil.rmtree(root, ignore_errors=True)


_shared = contextlib.ExitStack()

SHARED_VALUES = ("extender.bestEffortOversubscription.enabled=true",)
# Turns among the modules sharing the sandbox (a module's SHARED_SANDBOX_TURN; 0 when it has none).
FIRST, LAST = -1, 1


@pytest.fixture(scope="session")
def _shared_running(request: pytest.FixtureRequest) -> Iterator[tuple[Sandbox, HostView]]:
    # Oversubscription changes only where best-effort pods go, and only test_borrowed_memory.py has
    # best-effort pods that could borrow.
    running = _shared.enter_context(
        running_sandbox("shared", request.session, SHARED_VALUES, monitoring=True)
    )
    try:
        yield running
    finally:
        _shared.close()


@pytest.fixture(scope="module")
def shared_sandbox(_shared_running: tuple[Sandbox, HostView]) -> Iterator[Sandbox]:
    """The default sandbox, shared; the pods the module made in ``default`` are gone after it."""
    sbx = _shared_running[0]
    core = sbx.core
    before = {p.metadata.name for p in kubeapi.retried(lambda: core.list_namespaced_pod("default").items)}
    yield sbx
    if cluster.load_state(Layout(sbx.root)) is None:
        return  # the LAST module brought it down
    made = {
        p.metadata.name for p in kubeapi.retried(lambda: core.list_namespaced_pod("default").items)
    } - before
    for name in made:
        kubeapi.delete_pod(core, name)
    wait_for(
        lambda: not made & {p.metadata.name for p in core.list_namespaced_pod("default").items},
        timeout=120,
        what=f"the module's pods gone: {sorted(made)}",
    )


@pytest.fixture(scope="session")
def shared_host_before(_shared_running: tuple[Sandbox, HostView]) -> HostView:
    """The host as it was before the shared sandbox came up."""
    return _shared_running[1]


_fleet = contextlib.ExitStack()
FLEET_NODES = 3


@pytest.fixture(scope="session")
def _fleet_running(request: pytest.FixtureRequest) -> Iterator[tuple[Sandbox, HostView]]:
    running = _fleet.enter_context(running_sandbox("fleet", request.session, nodes=FLEET_NODES))
    try:
        yield running
    finally:
        _fleet.close()


@pytest.fixture
def fleet(_fleet_running: tuple[Sandbox, HostView]) -> Iterator[Sandbox]:
    """Three real nodes (`up --nodes 3`, sandbox.nodes), shared by the modules that take it as the
    default sandbox is by its own. After each test every node runs and is joined again (a failed
    test leaves none stopped or cut off), and the test's Deployments and pods in ``default`` are
    gone."""
    sbx = _fleet_running[0]
    yield sbx
    if cluster.load_state(Layout(sbx.root)) is not None:  # else the LAST module brought it down
        restore(sbx)


def restore(sbx: Sandbox) -> None:
    """A sandbox of several nodes as a test found it: every node running and joined again, every
    node's agent registered, the Deployments and pods in ``default`` gone."""
    state = cluster.load_state(Layout(sbx.root))
    assert state is not None
    for name in list(state.partitioned):
        nodelife.heal_node(sbx.root, name)
    for name in list(state.stopped):
        nodelife.start_node(sbx.root, name)

    # Every node's agent registered again with its kubelet: the next test's GPU pods fit anywhere.
    def offers(node: str) -> bool:
        if state.mode == "dra":
            return cluster.node_slice_devices(sbx.api, node) > 0
        return cluster.node_has_gpus(sbx.api, node)

    for name in [state.node, *(n.name for n in state.nodes)]:
        wait_for(
            lambda n=name: install.agent_ready(sbx.api, n) and offers(n),
            timeout=180,
            what=f"node {name}: its agent ready and its GPUs offered",
        )
    apps = client.AppsV1Api(sbx.api)
    for deployment in kubeapi.retried(lambda: apps.list_namespaced_deployment("default").items):
        kubeapi.delete(lambda d=deployment: apps.delete_namespaced_deployment(d.metadata.name, "default"))
    for pod in kubeapi.retried(lambda: sbx.core.list_namespaced_pod("default").items):
        kubeapi.delete_pod(sbx.core, pod.metadata.name)
    wait_for(
        lambda: not sbx.core.list_namespaced_pod("default").items, timeout=180, what="the test's pods gone"
    )


@pytest.fixture(scope="session")
def fleet_host_before(_fleet_running: tuple[Sandbox, HostView]) -> HostView:
    """The host as it was before the fleet came up."""
    return _fleet_running[1]


# The sandboxes modules share: the fixture that brings one up, the module attribute that orders the
# modules sharing it (FIRST, LAST; 0 when it has none), and what brings it down.
SHARED = (
    ("_shared_running", "SHARED_SANDBOX_TURN", _shared),
    ("_fleet_running", "FLEET_TURN", _fleet),
)


def _shares(item: pytest.Item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def _turn(item: pytest.Item, attribute: str) -> int:
    module = getattr(item, "module", None)
    return int(getattr(module, attribute, 0))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Each shared sandbox's tests moved together, where the first of them was: one sandbox at a time.
    for fixture, attribute, _ in SHARED:
        sharing = [item for item in items if _shares(item, fixture)]
        if sharing:
            first = items.index(sharing[0])
            rest = [item for item in items if not _shares(item, fixture)]
            items[:] = rest[:first] + sorted(sharing, key=lambda i: _turn(i, attribute)) + rest[first:]


@pytest.hookimpl(trylast=True)  # after the modules' own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # Down after the last sharing test, before the next module brings up its own sandbox.
    for fixture, _, stack in SHARED:
        if _shares(item, fixture) and (nextitem is None or not _shares(nextitem, fixture)):
            stack.close()
