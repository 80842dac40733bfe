"""The pod cache Allocate reads (deviceplugin/podcache.py) and the phase written after the answer
(deviceplugin/phases.py), against the real API server: the watch follows binds and deletions and
lists again on 410 Gone; a bind the cache has not seen, or a pod it still shows after its deletion,
is answered from the API; a phase write the agent could not make before a restart is made by the
next agent."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from deviceplugin.config import parse_config
from deviceplugin.kube import Kube
from deviceplugin.main import NodeAgent, compose
from deviceplugin.matching import PodView
from deviceplugin.phases import PhaseWriter
from deviceplugin.podcache import PodCache
from nodeagent.kubeapi import load_api
from nodeagent.statedir import StateDir
from sandbox.controlplane import ControlPlane
from sandbox.kubelet_standin import KubeletStandIn
from tessera.contract import KEYS, Allocation, ContainerAllocation, GpuInfo, Phase
from tests.deviceplugin.conftest import HOOK_LIBRARY, FakeGpus, PluginProcess
from tests.deviceplugin.test_plugin import create_pod, limits_of, phase_of
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

MIB = 2**20
GPUS = tuple(
    GpuInfo(
        uuid=f"GPU-0000000{i}-0000-4000-8000-000000000000",
        index=i,
        model="Fake",
        total_memory_mib=16384,
        sm_count=80,
        compute_capability="8.0",
        split=10,
    )
    for i in range(4)
)
G = [g.uuid for g in GPUS]


@pytest.fixture
def api(control_plane: ControlPlane) -> Iterator[client.ApiClient]:
    """The agent's own API client, as ``tessera-device-plugin`` makes it."""
    made = load_api(control_plane.kubeconfig)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def node_kube(api: client.ApiClient, gpu_node: str) -> Kube:
    return Kube(api, gpu_node, KEYS)


@pytest.fixture
def watching() -> Iterator[Callable[..., PodCache]]:
    """Runs a cache's list and watch in a thread; stopped (and joined) after the test."""
    running: list[tuple[PodCache, threading.Event, threading.Thread]] = []

    def start(cache: PodCache, resume_from: str | None = None) -> PodCache:
        stop = threading.Event()
        thread = threading.Thread(target=cache.run, args=(stop, resume_from), name="pods", daemon=True)
        running.append((cache, stop, thread))
        thread.start()
        return cache

    try:
        yield start
    finally:
        for cache, stop, thread in running:
            stop.set()
            cache.interrupt()
            thread.join(timeout=30)
            assert not thread.is_alive(), "the pod cache's thread did not stop"


def make_agent(
    tmp_path: Path,
    kube: Kube,
    cache: Callable[[Callable[[Sequence[PodView]], object]], PodCache] | PodCache | None,
    on_resized: Callable[[int], object] | None = None,
) -> NodeAgent:
    """The agent's parts on ``kube``; ``cache``: the pod cache, or what makes it from the resize
    follower's callback."""
    config = parse_config(
        [f"--node-name={kube.node}", f"--state-dir={tmp_path / 'state'}", f"--hook-library={HOOK_LIBRARY}"],
        environ={},
    )
    state = StateDir(config.state_dir)
    state.prepare()
    return compose(
        config,
        GPUS,
        kube,
        state,
        pod_cache=(lambda _: cache) if isinstance(cache, PodCache) else cache,
        phases=PhaseWriter(kube),
        on_resized=on_resized,
    )


def test_the_watch_follows_binds_changes_and_deletions(
    kube: client.ApiClient, namespace: str, gpu_node: str, node_kube: Kube, watching: Callable[..., PodCache]
) -> None:
    core = client.CoreV1Api(kube)
    cache = watching(PodCache(node_kube))
    assert cache.wait_synced(30)
    uid = create_pod(core, namespace, "p", gpu_node, {"main": [(G[0], 1024, 10)]}).metadata.uid
    # A pod bound elsewhere is not in this node's cache.
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "elsewhere"},
            "spec": {"nodeName": "other", "containers": [{"name": "c", "image": "x"}]},
        },
    )
    wait_for(lambda: cache.pod(uid), what="the bound pod in the cache")
    core.patch_namespaced_pod(
        "p", namespace, {"metadata": {"annotations": {KEYS.allocation_phase: "failed"}}}
    )
    wait_for(
        lambda: (p := cache.pod(uid)) and p.view.annotations.get(KEYS.allocation_phase) == "failed",
        what="the change in the cache",
    )
    core.delete_namespaced_pod("p", namespace, grace_period_seconds=0)
    wait_for(lambda: cache.pod(uid) is None, what="the deleted pod dropped from the cache")
    assert not cache.uids()  # the pod bound to another node was never in it
    assert cache.lists == 1


def test_an_expired_watch_version_lists_again(  # noqa: PLR0917 (fixtures are injected by name)
    kube: client.ApiClient,
    control_plane: ControlPlane,
    namespace: str,
    gpu_node: str,
    node_kube: Kube,
    watching: Callable[..., PodCache],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The API server restarted while the cache was away (its watch cache starts at the current
    version): a watch from the cache's version gets 410 Gone, and the cache lists again at once,
    holding what was bound meanwhile."""
    core = client.CoreV1Api(kube)
    cache = PodCache(node_kube)
    version = cache.relist()
    uid = create_pod(core, namespace, "meanwhile", gpu_node, {"main": [(G[1], 1024, 10)]}).metadata.uid
    control_plane.restart_apiserver()
    assert cache.pod(uid) is None
    caplog.set_level(logging.INFO, logger="deviceplugin.podcache")
    watching(cache, resume_from=version)
    wait_for(lambda: cache.pod(uid), what="the pod bound meanwhile")
    assert cache.lists == 2
    assert "watch expired (too old resource version" in caplog.text, caplog.text
    assert "watch failed" not in caplog.text


def test_a_bind_the_cache_has_not_seen_is_served_from_the_api(
    tmp_path: Path, kube: client.ApiClient, namespace: str, gpu_node: str, node_kube: Kube
) -> None:
    """The watch lags behind a bind that just happened (here: the cache is listed once and not
    watched): GetPreferredAllocation and Allocate ask the API and serve the pod."""
    core = client.CoreV1Api(kube)
    cache = PodCache(node_kube)
    cache.relist()
    agent = make_agent(tmp_path, node_kube, cache)
    pod = create_pod(core, namespace, "just-bound", gpu_node, {"main": [(G[2], 4096, 30)]})
    assert cache.pending_pods() == []

    assert agent.allocator.preferred([f"{g}::0" for g in G], [], 1) == [f"{G[2]}::0"]
    (answer,) = agent.allocator.allocate([[f"{G[2]}::3"]])
    assert answer.record.pod_uid == pod.metadata.uid
    assert [(g.uuid, g.memory_quota_mib, g.cores) for g in answer.record.gpus] == [(G[2], 4096, 30)]
    assert (agent.allocator.cache_answers, agent.allocator.api_answers) == (0, 1)
    assert agent.allocator.api_reasons["no match in the cache"] == 1
    agent.admissions.confirm()  # no pod-resources socket here: the pod matched is taken as admitted
    agent.admissions.phases.drain()
    assert phase_of(core, namespace, "just-bound") == Phase.ALLOCATED

    # Once the cache holds the next pod, it answers (the pod confirmed by one get).
    create_pod(core, namespace, "seen", gpu_node, {"main": [(G[2], 4096, 30)]})
    cache.relist()
    (answer,) = agent.allocator.allocate([[f"{G[2]}::4"]])
    assert answer.record.pod == "seen"
    assert (agent.allocator.cache_answers, agent.allocator.api_answers) == (1, 1)
    # Served: neither the cache nor the API offers either container again.
    cache.relist()
    with pytest.raises(Exception, match="no in-flight container"):
        agent.allocator.allocate([[f"{G[2]}::5"]])


@pytest.mark.parametrize("preferred_first", [False, True], ids=["allocate", "preferred-then-allocate"])
def test_a_pod_the_cache_shows_after_its_deletion_is_not_picked(  # noqa: PLR0917 (fixtures are injected by name)
    tmp_path: Path,
    kube: client.ApiClient,
    namespace: str,
    gpu_node: str,
    node_kube: Kube,
    preferred_first: bool,
) -> None:
    """The cache still shows a deleted pod; the extender, which saw the deletion, bound another pod
    to the same GPU with other quotas (the rule allows it: the first is gone). The cache's match is
    refused by the API's answer, and the new pod gets its own quotas. With the kubelet's two calls,
    the preferred call's read does not confirm the deleted pod either, so it keeps no confirmation
    for the Allocate, which reads again."""
    core = client.CoreV1Api(kube)
    cache = PodCache(node_kube)
    create_pod(core, namespace, "gone", gpu_node, {"main": [(G[3], 1024, 10)]})
    cache.relist()
    core.delete_namespaced_pod("gone", namespace, grace_period_seconds=0)
    wait_for(
        lambda: not core.list_namespaced_pod(namespace, field_selector="metadata.name=gone").items,
        what="the pod deleted",
    )
    new = create_pod(core, namespace, "new", gpu_node, {"main": [(G[3], 8192, 60)]})
    agent = make_agent(tmp_path, node_kube, cache)
    assert [p.name for p in cache.pending_pods() or []] == ["gone"]

    if preferred_first:  # from the fresh list: the new pod's GPU
        assert agent.allocator.preferred([f"{g}::{i}" for g in G for i in range(10)], [], 1) == [f"{G[3]}::0"]
    (answer,) = agent.allocator.allocate([[f"{G[3]}::0"]])
    assert answer.record.pod_uid == new.metadata.uid
    assert [(g.uuid, g.memory_quota_mib, g.cores) for g in answer.record.gpus] == [(G[3], 8192, 60)]
    assert (
        agent.allocator.cache_answers,
        agent.allocator.api_answers,
        agent.allocator.preferred_confirmations,
    ) == (0, 1, 0)
    assert agent.allocator.api_reasons["not confirmed"] == 1


def test_the_allocate_right_after_its_preferred_call_takes_that_calls_confirmation(
    tmp_path: Path, kube: client.ApiClient, namespace: str, gpu_node: str, node_kube: Kube
) -> None:
    """As a kubelet admits a container: GetPreferredAllocation, then Allocate of the slices it
    answered. The pod is confirmed by one read, the preferred call's; anything else reads again."""
    core = client.CoreV1Api(kube)
    cache = PodCache(node_kube)
    for name in ("a", "b", "c"):
        create_pod(core, namespace, name, gpu_node, {"main": [(G[1], 2048, 20)]})
    cache.relist()
    agent = make_agent(tmp_path, node_kube, cache)
    reads = agent.allocator._reads  # the reads the agent made
    free = [f"{g}::{i}" for g in G for i in range(10)]

    chosen = agent.allocator.preferred(free, [], 1)
    (answer,) = agent.allocator.allocate([chosen])
    served = [answer.record.pod]
    assert (
        reads.reads + reads.lists,
        agent.allocator.preferred_confirmations,
        agent.allocator.cache_answers,
    ) == (1, 1, 1)

    # Allocate of other slices than the preferred call answered: the kubelet did not take its
    # answer, so that call may not be this admission's; the pod is read again.
    chosen = agent.allocator.preferred([s for s in free if s != answer.record.device_ids[0]], [], 1)
    (answer,) = agent.allocator.allocate([[f"{G[1]}::9"]])
    assert chosen != [f"{G[1]}::9"]
    served.append(answer.record.pod)
    assert (
        reads.reads + reads.lists,
        agent.allocator.preferred_confirmations,
        agent.allocator.cache_answers,
    ) == (3, 1, 2)

    # Another call between them: the confirmation is not the previous call's; read again.
    chosen = agent.allocator.preferred([f"{G[1]}::{i}" for i in range(3, 9)], [], 1)
    agent.allocator.preferred(free, [], 2)  # no pod asks for 2 GPUs: answered without the cache
    (answer,) = agent.allocator.allocate([chosen])
    served.append(answer.record.pod)
    assert sorted(served) == ["a", "b", "c"]
    assert (
        agent.allocator.preferred_confirmations,
        agent.allocator.cache_answers,
        agent.allocator.api_answers,
    ) == (1, 3, 0)


def test_a_preferred_calls_confirmation_covers_another_pod_of_the_same_key(
    tmp_path: Path, kube: client.ApiClient, namespace: str, gpu_node: str, node_kube: Kube
) -> None:
    """The preferred call confirmed one pod; by the Allocate the cache shows it gone and matches
    another pod of the same key: the container admitted has that key either way, so no read. A
    pod of another key (another GPU) is not covered: read again."""
    core = client.CoreV1Api(kube)
    cache = PodCache(node_kube)
    for name in ("a", "b"):
        create_pod(core, namespace, name, gpu_node, {"main": [(G[0], 1024, 10)]})
    cache.relist()
    agent = make_agent(tmp_path, node_kube, cache)
    reads = agent.allocator._reads
    free = [f"{g}::{i}" for g in G for i in range(10)]

    chosen = agent.allocator.preferred(free, [], 1)
    assert chosen == [f"{G[0]}::0"]
    confirmed = (
        agent.allocator._snapshot(cache.pending_pods() or [], set()).in_flight[0].pod.name
    )  # as preferred
    core.delete_namespaced_pod(confirmed, namespace, grace_period_seconds=0)
    cache.relist()
    (answer,) = agent.allocator.allocate([chosen])
    assert answer.record.pod == {"a": "b", "b": "a"}[confirmed]
    assert [(g.uuid, g.memory_quota_mib, g.cores) for g in answer.record.gpus] == [(G[0], 1024, 10)]
    assert (reads.reads + reads.lists, agent.allocator.preferred_confirmations) == (1, 1)

    create_pod(core, namespace, "c", gpu_node, {"main": [(G[2], 4096, 40)]})
    cache.relist()
    chosen = agent.allocator.preferred(free, [], 1)
    assert chosen == [f"{G[2]}::0"]
    # Between the two calls, the cache comes to show another pod first for those slices' GPU: say
    # c deleted and d bound with other quotas; its key was not confirmed.
    core.delete_namespaced_pod("c", namespace, grace_period_seconds=0)
    d = create_pod(core, namespace, "d", gpu_node, {"main": [(G[2], 2048, 20)]})
    cache.relist()
    (answer,) = agent.allocator.allocate([chosen])
    assert answer.record.pod_uid == d.metadata.uid
    assert [(g.uuid, g.memory_quota_mib, g.cores) for g in answer.record.gpus] == [(G[2], 2048, 20)]
    assert (reads.reads + reads.lists, agent.allocator.preferred_confirmations) == (3, 1)


def _phase_policy(namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """An admission policy refusing the phase ``allocated`` on pods of ``namespace`` whose name
    starts with ``held-``: the API server refuses the agent's phase writes while it is in force."""
    name = f"hold-phase-{namespace}"
    annotation = f"object.metadata.annotations['{KEYS.allocation_phase}']"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["UPDATE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "matchConditions": [
                {
                    "name": "held",
                    "expression": f"object.metadata.namespace == '{namespace}' && object.metadata.name.startsWith('held-')",
                }
            ],
            "validations": [
                {
                    "expression": f"!has(object.metadata.annotations) || !('{KEYS.allocation_phase}' in object.metadata.annotations) || {annotation} != 'allocated'",
                    "message": "phase held by the test",
                }
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }
    return policy, binding


def test_a_phase_write_refused_before_a_restart_is_made_by_the_next_agent(  # noqa: PLR0917 (fixtures are injected by name)
    kube: client.ApiClient,
    namespace: str,
    gpu_node: str,
    fake_gpus: FakeGpus,
    kubelet: KubeletStandIn,
    start_plugin: Callable[..., PluginProcess],
) -> None:
    """Allocate answers while the phase write is refused (an admission policy denies it: refused for
    good, so this agent tells the pod and does not try again); the agent stops with the write not
    made; the next agent on the same state dir writes it once the API server takes it."""
    core = client.CoreV1Api(kube)
    admission = client.AdmissionregistrationV1Api(kube)
    policy, binding = _phase_policy(namespace)
    admission.create_validating_admission_policy(policy)
    admission.create_validating_admission_policy_binding(binding)
    try:
        create_pod(core, namespace, "held-probe", gpu_node, {"main": [(fake_gpus.uuids[0], 1024, 10)]})

        def refused() -> bool:
            try:
                core.patch_namespaced_pod(
                    "held-probe",
                    namespace,
                    {"metadata": {"annotations": {KEYS.allocation_phase: "allocated"}}},
                )
            except client.ApiException as e:
                return "phase held by the test" in str(e.body)
            return False

        wait_for(refused, timeout=30, what="the admission policy in force")
        core.delete_namespaced_pod("held-probe", namespace, grace_period_seconds=0)

        flags = (f"--hook-library={HOOK_LIBRARY}",)
        first = start_plugin(gpu_node, fake_gpus.env(), *flags)
        kubelet.wait_for(lambda k: bool(k.registrations and len(k.devices()) == 40))
        create_pod(core, namespace, "held-pod", gpu_node, {"main": [(fake_gpus.uuids[1], 2048, 20)]})
        _, answer = kubelet.admit_container(1)
        assert limits_of(answer.container_responses[0]) == {fake_gpus.uuids[1]: (2048 * MIB, 20)}
        refused_write = f"pod {namespace}/held-pod: the API server refuses phase allocated; not trying again"
        try:
            wait_for(lambda: refused_write in first.log(), what="the refused write")
        except AssertionError as e:
            raise AssertionError(f"{e}:\n{first.process.log_tail()}") from None
        first.process.stop()
        assert phase_of(core, namespace, "held-pod") == Phase.ALLOCATING
    finally:
        admission.delete_validating_admission_policy_binding(binding["metadata"]["name"])
        admission.delete_validating_admission_policy(policy["metadata"]["name"])

    kubelet.wait_for(lambda k: k.current.stream_ended)
    start_plugin(gpu_node, fake_gpus.env(), *flags, state_dir=first.state_dir)
    wait_for(lambda: phase_of(core, namespace, "held-pod") == Phase.ALLOCATED, what="the phase written")


def test_a_phase_write_for_a_pod_replaced_under_the_same_name_is_dropped(
    kube: client.ApiClient, namespace: str, gpu_node: str, node_kube: Kube
) -> None:
    """The patch carries the pod's UID: a pod of the same name created since keeps its phase."""
    core = client.CoreV1Api(kube)
    create_pod(core, namespace, "same", gpu_node, {"main": [(G[0], 1024, 10)]})
    served = node_kube.read_pod(namespace, "same")
    assert served is not None
    core.delete_namespaced_pod("same", namespace, grace_period_seconds=0)
    wait_for(lambda: node_kube.read_pod(namespace, "same") is None, what="the pod deleted")
    create_pod(core, namespace, "same", gpu_node, {"main": [(G[0], 1024, 10)]})

    writer = PhaseWriter(node_kube)
    assert writer.submit(served.view, Phase.ALLOCATED)
    assert not writer.submit(served.view, Phase.ALLOCATED)  # one write per pod at a time
    stop = threading.Event()
    thread = threading.Thread(target=writer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert writer.wait_idle(30)
    finally:
        stop.set()
        writer.wake()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert writer.written == 0
    assert phase_of(core, namespace, "same") == Phase.ALLOCATING


def test_a_resize_written_on_the_pod_reaches_the_limits_file_through_the_watch(  # noqa: PLR0917 (fixtures are injected by name)
    tmp_path: Path,
    kube: client.ApiClient,
    namespace: str,
    gpu_node: str,
    node_kube: Kube,
    watching: Callable[..., PodCache],
) -> None:
    """Live resize on the node: the extender writes the pod's new allocation; the watch shows it and
    the agent rewrites the served container's limits file."""
    core = client.CoreV1Api(kube)
    followed: list[int] = []
    agent = make_agent(
        tmp_path,
        node_kube,
        lambda on_pods: watching(PodCache(node_kube, on_pods=on_pods)),
        on_resized=followed.append,
    )
    cache = agent.cache
    assert cache is not None and cache.wait_synced(30)
    pod = create_pod(core, namespace, "grows", gpu_node, {"main": [(G[1], 1024, 30)]})
    wait_for(lambda: cache.pod(pod.metadata.uid), what="the bound pod in the cache")
    (answer,) = agent.allocator.allocate([[f"{G[1]}::0"]])
    allocation = answer.record.gpus
    grown = allocation[0].model_copy(update={"memory_quota_mib": 2048, "cores": 60})
    text = Allocation(
        node=gpu_node, containers=(ContainerAllocation(name="main", gpus=(grown,)),)
    ).model_dump_json()
    core.patch_namespaced_pod("grows", namespace, {"metadata": {"annotations": {KEYS.allocation: text}}})
    wait_for(lambda: followed == [1], what="the resize followed")
    assert f"device {G[1]} memory {2048 * MIB} cores 60\n" in answer.where.limits.read_text()
