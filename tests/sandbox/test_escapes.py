"""docs/security.md's escapes, tried by a tenant from inside real containers on the sandbox's node,
with Tessera installed by the chart: each "prevented" one leaves the quota held, each "detected"
one is reported by the node agent from what the driver (NVML) says.

The tenant's program is tools/sandbox/vgpu_escape.c, in the probe image. Every pod has a 1024 MiB
quota: four 256 MiB blocks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.stream import stream
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.driveruse import OVER_QUOTA_REASON, UNMANAGED_REASON
from extender.resizing import REFUSED_REASON as RESIZE_REFUSED_REASON
from sandbox import install
from sandbox.images import PROBE_IMAGE
from tessera.contract import CONTAINER_LIMITS_FILE, KEYS, MIB, QosClass, parse_allocation
from tessera.placement.qos import QOS_LOWERED_REASON
from tests.sandbox.conftest import Sandbox
from tests.scraping import service_account_token
from tests.waiting import wait_for

pytestmark = pytest.mark.sandbox

QUOTA_BLOCKS = 4  # 1024 MiB in 256 MiB blocks
IDLE = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"
ESCAPE_ENV = {  # the standalone hook's variables: a managed hook reads none of them
    "TESSERA_MEMORY_LIMIT": "100g",
    "TESSERA_LIMITS_FILE": "/tmp/limits",
    "TESSERA_REGION": "/tmp/region",
}


def _pod(name: str, command: list[str], seccomp: str = "RuntimeDefault") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": "tessera-scheduler",
            "terminationGracePeriodSeconds": 1,
            "restartPolicy": "Never",
            "securityContext": {"seccompProfile": {"type": seccomp}},
            "containers": [
                {
                    "name": "tenant",
                    "image": PROBE_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": command,
                    "env": [{"name": k, "value": v} for k, v in ESCAPE_ENV.items()],
                    "resources": {
                        "limits": {KEYS.vgpu: "1", KEYS.vgpu_memory: "1024", KEYS.vgpu_cores: "30"}
                    },
                }
            ],
        },
    }


def _results(text: str) -> dict[str, list[str]]:
    """vgpu-escape's lines: attempt -> [what it found, blocks]."""
    return {line.split()[0]: line.split()[1:] for line in text.splitlines() if len(line.split()) == 3}


@pytest.fixture(scope="module")
def sbx(shared_sandbox: Sandbox) -> Sandbox:
    return shared_sandbox


def _start(sbx: Sandbox, name: str, command: list[str], seccomp: str = "RuntimeDefault") -> None:
    sbx.core.create_namespaced_pod("default", _pod(name, command, seccomp))
    sbx.wait_pod(name, "Running", timeout=120)


def _exec(sbx: Sandbox, pod: str, *command: str, namespace: str = "default") -> str:
    out: str = stream(
        sbx.core.connect_get_namespaced_pod_exec,
        pod,
        namespace,
        command=list(command),
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
    )
    return out


def _delete(sbx: Sandbox, *names: str) -> None:
    for name in names:
        sbx.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    wait_for(
        lambda: not {p.metadata.name for p in sbx.core.list_namespaced_pod("default").items} & set(names),
        timeout=60,
        what=f"pods {names} gone",
    )


def _agent_metrics(sbx: Sandbox) -> dict[tuple[str, str], float]:
    """The node agent's per-pod memory cross-check: (metric, pod) -> value, scraped from its pod."""
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(install.agent_metrics(sbx.api, sbx.state.node)):
        for sample in family.samples:
            if sample.name.startswith("tessera_pod_gpu_memory_"):
                found[sample.name, sample.labels["pod"]] = sample.value
    return found


@pytest.fixture(scope="module")
def tenant(sbx: Sandbox) -> Iterator[str]:
    """An idle pod under RuntimeDefault seccomp, with the standalone variables set to ask for more."""
    _start(sbx, "tenant", ["/bin/sh", "-c", IDLE])
    yield "tenant"
    _delete(sbx, "tenant")


def test_the_environment_and_ld_preload_do_not_change_the_quota(sbx: Sandbox, tenant: str) -> None:
    assert _results(_exec(sbx, tenant, "vgpu-escape", "blocks")) == {"blocks": ["hook", str(QUOTA_BLOCKS)]}
    # /etc/ld.so.preload (mounted read-only) loads the hook whatever LD_PRELOAD says.
    out = _exec(sbx, tenant, "vgpu-escape", "preload")
    assert out.count(f"blocks hook {QUOTA_BLOCKS}") == 2, out


def test_what_the_node_agent_mounted_cannot_be_written(sbx: Sandbox, tenant: str) -> None:
    found = _results(_exec(sbx, tenant, "vgpu-escape", "write"))
    assert found == {
        "write-preload": ["EROFS", "-"],
        "write-limits": ["EROFS", "-"],
        "write-limits-dir": ["EROFS", "-"],
        "write-hook": ["EROFS", "-"],
        "write-coordination": ["EROFS", "-"],
    }


def test_no_lookup_route_reaches_the_driver_around_the_hook(sbx: Sandbox, tenant: str) -> None:
    out = _exec(sbx, tenant, "vgpu-escape", "routes")
    found = _results(out)
    assert len(found) == 10, out
    assert {a: r for a, r in found.items() if r != ["hook", str(QUOTA_BLOCKS)]} == {}, out


def test_hiding_the_limits_file_is_refused_by_seccomp_and_fails_closed_without_it(
    sbx: Sandbox, tenant: str
) -> None:
    """RuntimeDefault seccomp refuses the user namespace a tenant needs to mount over the limits file
    (the mitigation docs/security.md names); where it is allowed (Unconfined), the hook, finding no
    limits file, fails closed: no device memory at all."""
    assert _results(_exec(sbx, tenant, "vgpu-escape", "userns")) == {"userns": ["EPERM", "-"]}
    _start(sbx, "unconfined", ["/bin/sh", "-c", IDLE], seccomp="Unconfined")
    try:
        out = _exec(sbx, "unconfined", "vgpu-escape", "userns")
        if int(Path("/proc/sys/user/max_user_namespaces").read_text()) == 0:
            # The node allows no user namespaces (the other mitigation): nothing to hide with.
            assert _results(out) == {"userns": ["ENOSPC", "-"]}, out
        else:
            assert _results(out) == {"userns-tmpfs": ["mounted", "-"], "blocks": ["hook", "0"]}, out
    finally:
        _delete(sbx, "unconfined")


@pytest.mark.parametrize(
    ("escape", "over"),
    [
        # The driver's own cuMemAlloc_v2 from its symbol table: what a static binary or raw ioctls
        # do; the hook never sees it, so it takes everything it asks for (16 blocks).
        ("raw", {"raw": ["driver", "16"]}),
        # Zeroing the accounting region, from a process the hook does not stop writing it: a
        # second quota's worth.
        ("zero", {"zero-before": ["hook", str(QUOTA_BLOCKS)], "zero-after": ["hook", str(QUOTA_BLOCKS)]}),
    ],
)
def test_memory_taken_around_the_hook_is_stopped_by_the_node_agent(
    sbx: Sandbox, escape: str, over: dict[str, list[str]]
) -> None:
    """The escape works in the process (a user-space hook cannot stop it); the node agent, in the
    host's PID namespace, sees the pod's memory by NVML over its quota and, once it stays over for
    the grace period (5 s), stops its processes on that GPU, with a Warning event saying why."""
    name = f"escape-{escape}"
    _start(sbx, name, ["vgpu-escape", escape, "hold"])
    try:
        log = sbx.logs(name, until="holding", timeout=60)
        assert _results(log) == over, log
        held_mib = sum(int(blocks) for _, blocks in over.values()) * 256
        # A Warning event on the pod, as `kubectl describe pod` shows it: the grace period plus one
        # check of the agent's (5 s), with room for a loaded machine.
        (event,) = wait_for(
            lambda: (
                sbx.core.list_namespaced_event(
                    "default", field_selector=f"involvedObject.name={name},reason={OVER_QUOTA_REASON}"
                ).items
            ),
            timeout=60,
            what=f"the over-quota event on {name}",
        )
        assert f"holds {held_mib} MiB on GPU" in event.message, event.message
        assert "its processes on this GPU were stopped" in event.message, event.message

        def killed() -> bool:
            status = sbx.core.read_namespaced_pod(name, "default").status
            states = [
                c.state.terminated or (c.last_state and c.last_state.terminated)
                for c in status.container_statuses or []
            ]
            return any(t is not None and t.exit_code == 137 for t in states)

        wait_for(killed, timeout=30, what=f"{name}'s process stopped (SIGKILL, exit 137)")
    finally:
        _delete(sbx, name)
    # Gone with the pod: no series left for it.
    wait_for(
        lambda: not {key for key in _agent_metrics(sbx) if key[1] == name},
        timeout=60,
        what=f"the node agent forgetting {name}",
    )


def test_a_pod_within_its_quota_is_not_reported(sbx: Sandbox) -> None:
    _start(sbx, "honest", ["vgpu-escape", "blocks", "hold"])
    try:
        assert _results(sbx.logs("honest", until="holding", timeout=60)) == {
            "blocks": ["hook", str(QUOTA_BLOCKS)]
        }
        wait_for(
            lambda: ("tessera_pod_gpu_memory_driver_bytes", "honest") in _agent_metrics(sbx),
            timeout=60,
            what="the node agent attributing the honest pod's memory",
        )
        metrics = _agent_metrics(sbx)
        assert metrics["tessera_pod_gpu_memory_driver_bytes", "honest"] == QUOTA_BLOCKS * 256 * 2**20
        assert metrics["tessera_pod_gpu_memory_over_quota", "honest"] == 0.0
    finally:
        _delete(sbx, "honest")


def test_a_region_made_a_fifo_does_not_hang_the_node_agents_metrics(sbx: Sandbox, tenant: str) -> None:
    assert _results(_exec(sbx, tenant, "vgpu-escape", "fifo")) == {"fifo": ["made", "-"]}
    started = time.monotonic()
    metrics = _agent_metrics(sbx)  # answers (10 s timeout) instead of blocking on the FIFO
    assert time.monotonic() - started < 10
    assert ("tessera_pod_gpu_memory_over_quota", "tenant") in metrics


def test_another_pod_reaches_the_extenders_health_port_but_not_its_verbs(sbx: Sandbox, tenant: str) -> None:
    """The chart's extender serves filter, prioritize, preempt and bind on its pod's loopback only
    (its kube-scheduler's); from a tenant's pod the health port answers, the verbs' port does not."""
    pods = install.extender_pods(sbx.api)
    assert pods
    for pod in pods:
        address = pod.status.pod_ip
        health = _exec(sbx, tenant, "vgpu-escape", "connect", address, "8889")
        assert _results(health) == {"connect": ["answered", "-"]}, health
        verbs = _exec(sbx, tenant, "vgpu-escape", "connect", address, "8888")
        assert _results(verbs) == {"connect": ["ECONNREFUSED", "-"]}, verbs


def test_a_tenant_pod_reads_neither_the_agents_nor_the_extenders_metrics(sbx: Sandbox, tenant: str) -> None:
    """The ports are reachable from any pod (the sandbox's network enforces no NetworkPolicy, as many
    do not); the series name every namespace's pods and their use, so each scrape is reviewed: with
    no token, or with the tenant's own service account token, nothing is read. Prometheus's (here
    the sandbox's scraper, bound by metricsAccess.readers) reads."""
    urls = [install.agent_metrics_url(sbx.api, sbx.state.node)]
    urls += [f"{url}/metrics" for url in install.extender_health_urls(sbx.api)]
    assert len(urls) == 3  # the agent and both scheduler replicas' extenders
    own_token = '"Authorization: Bearer $(cat /var/run/secrets/kubernetes.io/serviceaccount/token)"'
    for url in urls:
        anonymous = _exec(sbx, tenant, "/bin/sh", "-c", f"wget -q -O - {url} 2>&1")
        assert " 401 " in anonymous and "tessera_" not in anonymous, anonymous
        own = _exec(sbx, tenant, "/bin/sh", "-c", f"wget -q -O - --header {own_token} {url} 2>&1")
        assert " 403 " in own and "tessera_" not in own, own
        token = install.scraper_token(sbx.api, seconds=600)
        assert "tessera_" in install.scrape(url, token)


# ------------------------------------------------------------------------------------------------
# A tenant with the built-in edit role in its own namespace only, under a ResourceQuota on Tessera's
# GPU memory: what it writes (annotations, priorities, its own pods) never raises what it gets.

TENANT_NAMESPACE = "tenant-a"
QUOTA_MIB = 4096


def _tenant_client(sbx: Sandbox, name: str, cluster_roles: tuple[str, ...]) -> client.CoreV1Api:
    """The API as service account ``name`` of the tenant's namespace, bound (in that namespace only)
    to ``cluster_roles``: a tenant's kubeconfig."""
    rbac = client.RbacAuthorizationV1Api(sbx.api)
    token = service_account_token(sbx.api, name, reader=False, namespace=TENANT_NAMESPACE)
    for role in cluster_roles:
        with contextlib.suppress(client.ApiException):  # bound already
            rbac.create_namespaced_role_binding(
                TENANT_NAMESPACE,
                {
                    "metadata": {"name": f"{name}-{role}"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": TENANT_NAMESPACE}],
                },
            )
    admin = sbx.api.configuration
    configuration = client.Configuration()
    configuration.host = admin.host
    configuration.ssl_ca_cert = admin.ssl_ca_cert
    configuration.api_key = {"authorization": token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return client.CoreV1Api(client.ApiClient(configuration))


@pytest.fixture(scope="module")
def tenant_namespace(sbx: Sandbox) -> Iterator[str]:
    """The tenant's namespace, with a ResourceQuota of QUOTA_MIB MiB of GPU memory (its used counted by
    the quota controller) and the scavenger PriorityClass (-10) an admin made for batch leftovers."""
    sbx.core.create_namespace({"metadata": {"name": TENANT_NAMESPACE}})
    sbx.core.create_namespaced_resource_quota(
        TENANT_NAMESPACE,
        {"metadata": {"name": "gpu"}, "spec": {"hard": {f"requests.{KEYS.vgpu_memory}": str(QUOTA_MIB)}}},
    )
    scheduling = client.SchedulingV1Api(sbx.api)
    scheduling.create_priority_class({"metadata": {"name": "scavenger"}, "value": -10})
    wait_for(
        lambda: (
            sbx.core.list_namespaced_service_account(
                TENANT_NAMESPACE, field_selector="metadata.name=default"
            ).items
        ),
        timeout=60,
        what="the tenant namespace's default service account",
    )
    # Counted by kube-controller-manager's resourcequota controller, nobody else: until it has,
    # kube-apiserver refuses the namespace's pods (the quota's status is unknown).
    wait_for(
        lambda: (
            (sbx.core.read_namespaced_resource_quota("gpu", TENANT_NAMESPACE).status.used or {}).get(
                f"requests.{KEYS.vgpu_memory}"
            )
            == "0"
        ),
        timeout=60,
        what="the tenant quota counted by the resourcequota controller",
    )
    try:
        yield TENANT_NAMESPACE
    finally:
        scheduling.delete_priority_class("scavenger")
        sbx.core.delete_namespace(TENANT_NAMESPACE)
        wait_for(
            lambda: TENANT_NAMESPACE not in {n.metadata.name for n in sbx.core.list_namespace().items},
            timeout=120,
            what="the tenant namespace gone",
        )


def _tenant_pod(name: str, memory_mib: int, **spec: Any) -> dict[str, Any]:
    pod = _pod(name, ["/bin/sh", "-c", IDLE])
    pod["spec"]["containers"][0]["env"] = []
    pod["spec"]["containers"][0]["resources"]["limits"][KEYS.vgpu_memory] = str(memory_mib)
    pod["spec"].update(spec)
    return pod


def _events(sbx: Sandbox, namespace: str, pod: str, reason: str) -> list[Any]:
    found: list[Any] = sbx.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={pod},reason={reason}"
    ).items
    return found


def test_a_tenant_resizes_only_with_the_right_and_never_past_its_namespace_quota(
    sbx: Sandbox, tenant: str, tenant_namespace: str
) -> None:
    """Asking for a resize needs tessera-resizer besides edit; granted, a resize past the namespace's
    ResourceQuota (30000 MiB under 4096) is refused naming the quota, and the container keeps its
    quota. The neighbour in the default namespace is untouched."""
    alice = _tenant_client(sbx, "alice", ("edit", "tessera-resizer"))
    bob = _tenant_client(sbx, "bob", ("edit",))
    own = _tenant_pod("own", 1024)
    # On the A100: 30000 MiB fit the GPU, so that only the quota stands in the way.
    own["metadata"]["annotations"] = {KEYS.gpu_models: "A100"}
    alice.create_namespaced_pod(tenant_namespace, own)
    sbx.wait_pod("own", "Running", namespace=tenant_namespace, timeout=120)
    request = {"metadata": {"annotations": {KEYS.resize: "memory=30000,cores=50"}}}
    with pytest.raises(client.ApiException) as refused:
        bob.patch_namespaced_pod("own", tenant_namespace, request)
    assert refused.value.status == 403 and "pods/resize" in str(refused.value.body), refused.value.body
    alice.patch_namespaced_pod("own", tenant_namespace, request)
    (event,) = wait_for(
        lambda: _events(sbx, tenant_namespace, "own", RESIZE_REFUSED_REASON),
        timeout=60,
        what="the resize's refusal",
    )
    assert f"ResourceQuota gpu allows requests.{KEYS.vgpu_memory} {QUOTA_MIB}" in event.message, event.message
    limits = _exec(sbx, "own", "cat", CONTAINER_LIMITS_FILE, namespace=tenant_namespace)
    assert f" memory {1024 * MIB} " in limits, limits
    assert sbx.core.read_namespaced_pod(tenant, "default").status.phase == "Running"


def test_a_scavenger_pod_asking_for_latency_critical_runs_best_effort_with_an_event(
    sbx: Sandbox, tenant: str, tenant_namespace: str
) -> None:
    """The class is granted by the pod's priority: a negative one is best-effort whatever the pod's
    annotation asks; the pod is told with a Warning event, and its limits file says best-effort."""
    alice = _tenant_client(sbx, "alice", ("edit", "tessera-resizer"))
    pod = _tenant_pod("scavenger", 1024, priorityClassName="scavenger")
    pod["metadata"]["annotations"] = {KEYS.qos: QosClass.LATENCY_CRITICAL.value}
    alice.create_namespaced_pod(tenant_namespace, pod)
    sbx.wait_pod("scavenger", "Running", namespace=tenant_namespace, timeout=120)
    annotations = sbx.core.read_namespaced_pod("scavenger", tenant_namespace).metadata.annotations
    assert parse_allocation(annotations[KEYS.allocation]).qos is QosClass.BEST_EFFORT
    (event,) = wait_for(
        lambda: _events(sbx, tenant_namespace, "scavenger", QOS_LOWERED_REASON), timeout=60, what="the event"
    )
    assert "latency-critical" in event.message and "best-effort" in event.message, event.message
    limits = _exec(sbx, "scavenger", "cat", CONTAINER_LIMITS_FILE, namespace=tenant_namespace)
    assert "qos best-effort" in limits, limits
    assert sbx.core.read_namespaced_pod(tenant, "default").status.phase == "Running"


def test_a_pod_with_annotations_near_the_apis_limit_holds_up_no_other_pod(sbx: Sandbox, tenant: str) -> None:
    """Its annotations leave the Binding and the phase write a few hundred bytes: whatever becomes of
    it (refused at bind, or its phase write refused and flagged), the next pod, of another shape, is
    placed and runs."""
    blob = "example.com/blob"
    bloated = _pod("bloated", ["/bin/sh", "-c", IDLE])
    bloated["metadata"]["annotations"] = {blob: "x" * (256 * 1024 - len(blob) - 400)}
    sbx.core.create_namespaced_pod("default", bloated)
    after = _pod("after-bloated", ["/bin/sh", "-c", IDLE])
    after["spec"]["containers"][0]["resources"]["limits"][KEYS.vgpu_memory] = "512"
    try:
        time.sleep(3)  # the bloated pod first, where kube-scheduler takes it
        sbx.core.create_namespaced_pod("default", after)
        sbx.wait_pod("after-bloated", "Running", timeout=120)
        assert sbx.core.read_namespaced_pod(tenant, "default").status.phase == "Running"
    finally:
        _delete(sbx, "bloated", "after-bloated")


def test_a_pod_using_a_gpu_around_tessera_is_reported(sbx: Sandbox, tenant: str) -> None:
    """No Tessera resource, the GPUs the runtime gives every container (NVIDIA_VISIBLE_DEVICES unset
    or all, honoured for unprivileged pods unless the toolkit is told not to: docs/install.md): the
    node agent reports the memory NVML shows it holding, per GPU and with a Warning event on it."""
    outsider = _pod("outsider", ["vgpu-probe", "1024", "600"])
    outsider["spec"].pop("schedulerName")
    outsider["spec"]["containers"][0]["env"] = []
    del outsider["spec"]["containers"][0]["resources"]
    sbx.core.create_namespaced_pod("default", outsider)
    sbx.wait_pod("outsider", "Running", timeout=120)
    try:
        sbx.logs("outsider", until="allocations_ok=", timeout=60)
        (event,) = wait_for(
            lambda: _events(sbx, "default", "outsider", UNMANAGED_REASON), timeout=60, what="the event"
        )
        assert "without a Tessera allocation there" in event.message, event.message

        def unmanaged() -> float:
            return sum(
                sample.value
                for family in text_string_to_metric_families(install.agent_metrics(sbx.api, sbx.state.node))
                for sample in family.samples
                if sample.name == "tessera_gpu_memory_unmanaged_bytes"
            )

        assert wait_for(lambda: unmanaged() >= 1024 * MIB, timeout=60, what="unmanaged memory in the metrics")
        assert sbx.core.read_namespaced_pod(tenant, "default").status.phase == "Running"
    finally:
        _delete(sbx, "outsider")
