"""Chaos on three real nodes (the fleet, tests/sandbox/conftest.py): GPU pods created and deleted in
waves, placed across the nodes, while at random moments a driver kills one component at a time
(SIGKILL, no chance to clean up): the extender and a node agent (their containers, restarted by the
kubelet as their Deployment's and DaemonSet's pods), a node's kubelet or containerd (any node's), and
kube-apiserver and etcd (restarted by the sandbox, their supervisor).

Invariants, checked every couple of seconds throughout and once more when each wave has settled:
no GPU holds more memory or cores than it has, by the pods' allocations and by what the hooks'
accounting regions say the containers hold; a pod's allocation, once written, never changes and
never vanishes; once a wave settles, every pod is Running with a limits file that says exactly its
allocation, Pending with the scheduler's reason, or Failed with a reason (its event, or its
container's terminated state when the event was lost).

`TESSERA_CHAOS_SEED` picks the kill schedule and the pods' shapes (CI runs the fixed default);
`TESSERA_CHAOS_WAVES` runs more waves on demand."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest
import urllib3
from kubernetes import client, config
from kubernetes.stream import stream

from draplugin.claims import OVERCOMMITTED
from hook.region import RegionError, read_region
from nodeagent.statedir import StateDir
from sandbox import cluster, host, install, kubeapi
from sandbox.layout import HOST_KUBELET_DIR, Layout
from tessera.contract import CONTAINER_LIMITS_FILE, KEYS, MIB, parse_allocation
from tests.sandbox.conftest import LAST, HostView, Sandbox, differences, kube_iptables_chains
from tests.sandbox.test_chart_lifecycle import probe_pod

pytestmark = pytest.mark.sandbox

SEED = int(os.environ.get("TESSERA_CHAOS_SEED", "20261125"))
WAVES = int(os.environ.get("TESSERA_CHAOS_WAVES", "6"))
PODS_PER_WAVE = 50
# How long each settled wave runs before it is deleted, kills landing on its running containers.
HOLD_SECONDS = 6.0
# What kills run between: seconds, drawn uniformly.
KILL_GAP = (4.0, 12.0)
COMPONENTS = ("extender", "device-plugin", "kubelet", "containerd", "kube-apiserver", "etcd")
SHAPES_MIB = (256, 512, 1024, 2048, 3072)
SHAPES_CORES = (5, 10, 20, 30)
# A wave's pod fills its quota in 256 MiB blocks and holds it: the regions then show real use.
HOLDING = ["/bin/sh", "-c", "trap 'exit 0' TERM; vgpu-probe 256 100000"]


def processes_named(name: str) -> list[int]:
    """PIDs of the sandbox's pods' processes whose command line runs ``name`` (a console script's path
    ends in it); a program of that name outside the sandbox (a benchmark's node agent) is not ours."""
    found = []
    ours = host.cgroup_pids()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) not in ours:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(os.path.basename(a.decode(errors="replace")) == name for a in argv[:2]):
            found.append(int(entry.name))
    return found


@dataclass
class Chaos:
    """The kill driver: one component at a time, in a seeded order that covers each."""

    root: Path
    rng: random.Random
    nodes: list[str]
    """Every node; the first is the host's (its components restart by their own name)."""
    components: tuple[str, ...] = COMPONENTS
    """What it kills: any node's kubelet or containerd, kube-apiserver, etcd, or else Tessera's
    program ``tessera-COMPONENT`` (a pod's container on any node, restarted by its kubelet)."""
    stop: threading.Event = field(default_factory=threading.Event)
    kills: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: list[str] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    """Each kill as it began ("HH:MM:SS component[@node]"), for a failure's message."""

    def schedule(self) -> Iterator[str]:
        while True:
            order = list(self.components)
            self.rng.shuffle(order)
            yield from order

    def run(self) -> None:
        try:
            for component in self.schedule():
                if self.stop.wait(self.rng.uniform(*KILL_GAP)):
                    return
                self.kill(component)
        except Exception as e:  # surfaced by the test, which joins this thread and polls this list
            self.errors.append(f"{time.strftime('%H:%M:%S')} {self.history[-1:]}: {type(e).__name__}: {e}")

    def _began(self, what: str) -> None:
        self.history.append(f"{time.strftime('%H:%M:%S')} {what}")

    def kill(self, component: str) -> None:
        if component in ("kubelet", "containerd"):
            node = self.rng.choice(self.nodes)
            where = component if node == self.nodes[0] else f"{node}/{component}"
            self._began(f"{component}@{node}")
            cluster.restart(self.root, where, timeout=180, crash=True)
        elif component in ("kube-apiserver", "etcd"):
            self._began(component)
            cluster.restart(self.root, component, timeout=180, crash=True)
        else:
            pids = processes_named(f"tessera-{component}")
            if not pids:  # its container is between restarts: nothing to kill this time
                return
            self._began(component)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.rng.choice(sorted(pids)), signal.SIGKILL)
        self.kills[component] += 1


class Watcher(Protocol):
    """What checks invariants from a thread of its own (:class:`Invariants`), on its own client."""

    violations: list[str]
    checks: int
    api: client.ApiClient

    def watch(self, stop: threading.Event) -> None: ...


@dataclass
class Invariants:
    """What must hold at every moment; violations are collected, not raised, from the checker thread."""

    sbx: Sandbox
    state_dirs: Mapping[str, StateDir]
    """Each node's Tessera state directory (the hooks' accounting regions), by node name."""
    capacity: dict[str, int]
    seen: dict[str, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    checks: int = 0
    api: client.ApiClient = field(init=False)

    def __post_init__(self) -> None:
        self.api = config.new_client_from_config(config_file=self.sbx.state.kubeconfig)

    def check(self) -> None:
        pods = kubeapi.retried(lambda: client.CoreV1Api(self.api).list_namespaced_pod("default").items)
        memory: dict[str, int] = defaultdict(int)
        cores: dict[str, int] = defaultdict(int)
        held: dict[str, int] = defaultdict(int)
        for pod in pods:
            uid = pod.metadata.uid
            text = (pod.metadata.annotations or {}).get(KEYS.allocation)
            if uid in self.seen and text != self.seen[uid]:
                self.violations.append(f"pod {pod.metadata.name}: allocation {self.seen[uid]} became {text}")
            if text is None:
                continue
            self.seen.setdefault(uid, text)
            if pod.status.phase in ("Succeeded", "Failed"):
                continue
            for container in parse_allocation(text).containers:
                for g in container.gpus:
                    memory[g.uuid] += g.memory_quota_mib
                    cores[g.uuid] += g.cores
                state_dir = self.state_dirs.get(pod.spec.node_name or "")
                if state_dir is None:
                    continue
                region = state_dir.container(uid, container.name).state / "region"
                with contextlib.suppress(RegionError):  # not served yet, or already torn down
                    usage = read_region(region)
                    for g in container.gpus:
                        device = usage.device(g.uuid)
                        if device is None:
                            continue
                        if device.memory_used_bytes > g.memory_quota_mib * MIB:
                            self.violations.append(
                                f"pod {pod.metadata.name}: holds {device.memory_used_bytes} bytes "
                                f"on {g.uuid} over its {g.memory_quota_mib} MiB"
                            )
                        held[g.uuid] += device.memory_used_bytes
        for uuid, total in self.capacity.items():
            if memory[uuid] > total or cores[uuid] > 100:
                self.violations.append(
                    f"{uuid}: allocations {memory[uuid]}/{total} MiB, {cores[uuid]}% cores"
                )
            if held[uuid] > total * MIB:
                self.violations.append(f"{uuid}: containers hold {held[uuid]} bytes of {total} MiB")
        self.checks += 1

    def watch(self, stop: threading.Event) -> None:
        while not stop.wait(2.0):
            try:
                self.check()
            except AssertionError as e:  # the API down past kubeapi.retried()'s patience
                self.violations.append(str(e))


def mounted_limits(core: client.CoreV1Api, pod: str, container: str) -> str:
    """The limits file as the container sees it (the one the node agent's Allocate answer mounted),
    read through kubectl exec; retried while a killed kubelet, containerd or API server comes back
    (an exec answered by a kubelet still syncing says nothing)."""
    deadline = time.monotonic() + 180
    while True:
        try:
            text: str = stream(
                core.connect_get_namespaced_pod_exec,
                pod,
                "default",
                container=container,
                command=["cat", CONTAINER_LIMITS_FILE],
                stderr=True,
                stdin=False,
                stdout=True,
                tty=False,
            )
            if "device " in text:
                return text
        except (client.ApiException, urllib3.exceptions.HTTPError, OSError, ValueError):
            pass
        assert time.monotonic() < deadline, f"no limits file readable in {pod}/{container} for 180 s"
        time.sleep(1)


def limits_lines(text: str) -> set[str]:
    return {line for line in text.splitlines() if line.startswith("device ")}


def terminations(pod: Any) -> list[str]:
    """Why the pod's containers ended, as the kubelet wrote it in their status: a failed pod's reason
    when its Warning event was lost (events are best effort: the kubelet drops them while the API
    server is down, and a killed kubelet loses the ones it had queued)."""
    return [
        f"{s.name}: {s.state.terminated.reason} {s.state.terminated.message or ''}".strip()
        for s in pod.status.container_statuses or []
        if s.state and s.state.terminated and s.state.terminated.reason
    ]


def settled(pod: Any, events: dict[str, list[str]]) -> tuple[str, str] | None:
    """What the pod has come to and why, or None while it is still on its way."""
    phase = pod.status.phase
    if pod.metadata.deletion_timestamp:
        return None
    if phase == "Running":
        return "running", ""
    if phase == "Failed":
        found = events.get(pod.metadata.name) or terminations(pod)
        return ("failed", found[-1]) if found else None
    if phase == "Pending" and pod.spec.node_name:
        # On the DRA path, a claim allocated past its GPU's capacity waits on its node (docs/dra.md).
        held = [m for m in events.get(pod.metadata.name, []) if OVERCOMMITTED in m]
        if held:
            return "held", held[-1]
    if phase == "Pending" and not pod.spec.node_name:
        scheduled = [c for c in pod.status.conditions or [] if c.type == "PodScheduled"]
        if scheduled and scheduled[0].status == "False" and scheduled[0].message:
            return "pending", scheduled[0].message
    return None


def nodes_now(core: client.CoreV1Api) -> str:
    """Each node's Ready condition (since when, why) and taints, for a failure message."""
    lines = []
    for node in kubeapi.retried(lambda: core.list_node().items):
        ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
        since = (
            ready.last_transition_time.strftime("%H:%M:%S") if ready and ready.last_transition_time else "?"
        )
        state = (
            f"Ready={ready.status} since {since} ({ready.reason}: {(ready.message or '')[:160]})"
            if ready
            else "no Ready condition"
        )
        taints = ",".join(f"{t.key}:{t.effect}" for t in node.spec.taints or [])
        lines.append(f"{node.metadata.name} {state} taints [{taints}]")
    return "; ".join(lines)


def describe(pod: Any) -> str:
    """Where a pod stands, for a failure message: phase, node, conditions, containers' states."""
    conditions = ",".join(f"{c.type}={c.status}({c.reason or ''})" for c in pod.status.conditions or [])
    containers = ",".join(
        f"{s.name}:{next((f'{k} {v}' for k, v in s.state.to_dict().items() if v), '?')}"
        for s in pod.status.container_statuses or []
    )
    return (
        f"{pod.metadata.name} {pod.status.phase} node={pod.spec.node_name} deleting="
        f"{bool(pod.metadata.deletion_timestamp)} [{conditions}] [{containers}] {pod.status.reason or ''} "
        f"{pod.status.message or ''}"
    )


# Last on the shared sandbox: its last test kills the kubelet under a running pod and brings
# the sandbox down.
SHARED_SANDBOX_TURN = LAST


@pytest.fixture(scope="module")
def chaos_sandbox(shared_sandbox: Sandbox) -> Sandbox:
    return shared_sandbox


def test_down_where_no_sandbox_began_leaves_the_running_one_alone(
    chaos_sandbox: Sandbox, tmp_path: Path
) -> None:
    """`down` in another directory (an `up` there refused because this one runs) must not sweep the
    host: this sandbox's containers, bridge and chains stay."""
    sbx = chaos_sandbox
    sbx.core.create_namespaced_pod("default", probe_pod("bystander", 256, 5, idle=True))
    sbx.wait_pod("bystander", "Running")
    with pytest.raises(cluster.StartError, match="already running"):
        cluster.up(cluster.Options(root=tmp_path / "other"), report=lambda _: None)
    assert cluster.down(tmp_path / "other", report=lambda _: None) == []
    time.sleep(2)
    assert sbx.core.read_namespaced_pod("bystander", "default").status.phase == "Running"
    assert install.agent_ready(sbx.api, sbx.state.node) and install.extenders_ready(sbx.api)
    sbx.core.delete_namespaced_pod("bystander", "default", grace_period_seconds=0)


def any_failure(pod: Any) -> bool:
    """Every failure that has a reason (``settled``'s) is one the kills may explain."""
    return True


@dataclass
class Waves:
    """Creates a wave of pods, waits until each has settled, checks it, holds it, deletes it."""

    core: client.CoreV1Api
    check: Callable[[], None]
    """The invariants, checked once more when a wave has settled."""
    pod: Callable[[str], dict[str, Any]]
    """A wave's pod of this name, of a shape drawn from the test's seeded generator."""
    limits: Callable[[Any], dict[str, set[str]]]
    """The device lines of its limits file each container of a Running pod sees, by container."""
    explained: Callable[[Any], bool] = any_failure
    """Whether the kills explain why a Failed pod failed."""
    freed: Callable[[], bool] = lambda: True
    """Whether what a deleted wave's pods held is free again for the next wave (their claims gone)."""
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def pods(self) -> list[Any]:
        return list(kubeapi.retried(lambda: self.core.list_namespaced_pod("default").items))

    def states(self, names: list[str]) -> dict[str, tuple[str, str] | None]:
        pods = {p.metadata.name: p for p in self.pods() if p.metadata.name in names}
        events: dict[str, list[str]] = defaultdict(list)
        for e in kubeapi.retried(lambda: self.core.list_namespaced_event("default").items):
            if e.type == "Warning" and e.involved_object.kind == "Pod":
                events[e.involved_object.name].append(e.message or "")
        return {name: settled(pods[name], events) if name in pods else None for name in names}

    def run(self, label: str, hold: float, broken: Callable[[], list[str]] = list) -> dict[str, int]:
        """``broken``: why the cluster can no longer settle the wave (a kill whose component never
        came back), which ends the wave at once instead of at its deadline."""
        names = [f"{label}-{i:02d}" for i in range(PODS_PER_WAVE)]
        for name in names:
            kubeapi.create_pod(self.core, self.pod(name))
        deadline = time.monotonic() + 420
        while None in (now := self.states(names)).values():
            waiting = [n for n, s in now.items() if s is None]
            assert not (why := broken()), f"{label}: {len(waiting)} pods waiting, and {why}"
            assert time.monotonic() < deadline, (
                f"{label}: {len(waiting)} pods never settled: "
                + "; ".join(describe(p) for p in self.pods() if p.metadata.name in waiting[:10])
                + f"; nodes: {nodes_now(self.core)}"
            )
            time.sleep(2)
        self.check()
        for pod in self.pods():
            outcome = (now.get(pod.metadata.name) or ("", ""))[0]
            # The Running ones: the node's agent served exactly their share.
            if outcome == "running":
                for container, lines in self.limits(pod).items():
                    limits = mounted_limits(self.core, pod.metadata.name, container)
                    assert limits_lines(limits) == lines, f"pod {pod.metadata.name}: {limits} against {lines}"
            assert outcome != "failed" or self.explained(pod), f"no kill explains: {describe(pod)}"
        wave: dict[str, int] = defaultdict(int)
        for outcome, reason in filter(None, now.values()):
            wave[outcome] += 1
            self.outcomes[outcome] += 1
            if reason:
                self.reasons[f"{outcome}: {reason[:90]}"] += 1
        time.sleep(hold)  # kills land on running containers too
        for name in names:
            kubeapi.delete_pod(self.core, name)
        deadline = time.monotonic() + 180
        while any(p.metadata.name in names for p in self.pods()) or not self.freed():
            assert not (why := broken()), f"{label}: pods or what they held not gone, and {why}"
            assert time.monotonic() < deadline, (
                f"{label}: pods or what they held not gone after 180 s; nodes: {nodes_now(self.core)}"
            )
            time.sleep(1)
        return dict(wave)


def holding_gpu_pods(rng: random.Random) -> Callable[[str], dict[str, Any]]:
    """Pods of shapes drawn from ``rng``, each filling its quota and holding it."""

    def pod(name: str) -> dict[str, Any]:
        body = probe_pod(name, rng.choice(SHAPES_MIB), rng.choice(SHAPES_CORES))
        body["spec"]["containers"][0]["command"] = HOLDING
        return body

    return pod


def allocated_limits(pod: Any) -> dict[str, set[str]]:
    """The device lines the node agent writes for each container of the pod: its allocation."""
    allocation = parse_allocation(pod.metadata.annotations[KEYS.allocation])
    return {
        c.name: {f"device {g.uuid} memory {g.memory_quota_mib * MIB} cores {g.cores}" for g in c.gpus}
        for c in allocation.containers
    }


def waves_under_kills(chaos: Chaos, invariants: Watcher, waves: Waves, back: Callable[[], None]) -> None:
    """WAVES waves of pods while ``chaos`` kills and ``invariants`` checks, each from a thread of its
    own; the summary printed; then, once ``back()`` has waited for every component to serve again, a
    calm wave must place pods that run."""
    stop = threading.Event()
    threads = [
        threading.Thread(target=chaos.run, name="chaos", daemon=True),
        threading.Thread(target=invariants.watch, args=(stop,), name="invariants", daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        for n in range(WAVES):
            try:
                wave = waves.run(f"chaos-{n}", hold=HOLD_SECONDS, broken=lambda: chaos.errors)
            except AssertionError as e:
                raise AssertionError(f"{e}\nthe last kills: {chaos.history[-8:]}") from e
            print(f"wave {n}: {wave}; kills so far {dict(chaos.kills)}", flush=True)
            assert not chaos.errors, chaos.errors
    finally:
        chaos.stop.set()
        stop.set()
        for thread in threads:
            thread.join(timeout=240)
    assert not chaos.errors, chaos.errors
    kills = sum(chaos.kills.values())
    print(
        f"chaos seed {SEED}: {WAVES * PODS_PER_WAVE} pods, {kills} kills survived {dict(chaos.kills)}, "
        f"{invariants.checks} invariant checks, outcomes {dict(waves.outcomes)}"
    )
    for reason, count in sorted(waves.reasons.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {count:4d}  {reason}")
    assert invariants.violations == [], invariants.violations[:20]
    assert set(chaos.kills) == set(chaos.components), dict(chaos.kills)
    # Afterwards the cluster serves as before: every component back, and a calm wave places pods.
    back()
    waves.reasons.clear()
    calm = waves.run("calm", hold=0.0)
    print(f"calm wave: {calm}")
    assert calm.get("running", 0) >= 5 and "failed" not in calm, (calm, dict(waves.reasons))
    assert invariants.violations == [], invariants.violations[:20]
    invariants.api.close()


def test_waves_of_gpu_pods_survive_components_killed_at_random_across_nodes(fleet: Sandbox) -> None:
    sbx = fleet
    nodes = [sbx.state.node, *(n.name for n in sbx.state.nodes)]
    invariants = Invariants(sbx, sbx.state_dirs(), sbx.gpu_capacity())
    chaos = Chaos(sbx.root, random.Random(SEED + 1), nodes)
    waves = Waves(
        client.CoreV1Api(invariants.api),
        invariants.check,
        holding_gpu_pods(random.Random(SEED)),
        allocated_limits,
    )

    def back() -> None:
        """Both extenders synced, and every node agent registered again with its kubelet, which
        offers its slices (a Ready agent pod alone is not enough: it registers after it starts)."""
        deadline = time.monotonic() + 240
        while not (
            install.extenders_ready(invariants.api)
            and all(install.agent_ready(invariants.api, n) for n in nodes)
            and all(cluster.node_has_gpus(invariants.api, n) for n in nodes)
        ):
            assert time.monotonic() < deadline, install.describe_pods(invariants.api)
            time.sleep(1)

    waves_under_kills(chaos, invariants, waves, back)


def test_down_after_a_dead_kubelet_leaves_nothing_behind(
    shared_sandbox: Sandbox, shared_host_before: HostView
) -> None:
    """Last on the shared sandbox, after the kills: the kubelet dies with a GPU pod running, and
    `down` still leaves nothing behind (no KUBE-* iptables chain, no Prometheus either)."""
    sandbox, host_before = shared_sandbox, shared_host_before
    sandbox.core.create_namespaced_pod("default", probe_pod("orphan", 256, 5, idle=True))
    sandbox.wait_pod("orphan", "Running")
    # The kubelet as it runs now: the kills above restarted it under a new PID.
    state = cluster.load_state(Layout(sandbox.root))
    assert state is not None
    os.killpg(state.process("kubelet").pid, signal.SIGKILL)
    # The container, its shim, its network namespace and its cgroups outlive the kubelet.
    assert differences(host_before, sandbox.root) != []

    # down: no process, mount, cgroup, network device or KUBE-* chain left.
    assert cluster.down(sandbox.root, report=lambda _: None) == []
    assert kube_iptables_chains() == []
    assert differences(host_before, sandbox.root) == []
    assert not (HOST_KUBELET_DIR / "device-plugins").exists() or host_before.dirs[str(HOST_KUBELET_DIR)]
