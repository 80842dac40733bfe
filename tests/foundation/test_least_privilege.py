"""Least privilege, checked on the real API server (RBAC authorization, as real clusters run): the
matrix of what each Tessera service account may do, as `kubectl auth can-i --list` prints it. (The
node agent's writes narrowed to its own node by the chart's admission policy, with the token a real
agent pod gets: tests/deviceplugin/test_rbac.py.)"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from sandbox.controlplane import ControlPlane, find_binaries

pytestmark = pytest.mark.k8s

RELEASE = "tessera"
NAMESPACE = "tessera-system"
AGENT_SA = "tessera-device-plugin"
SCHEDULER_SA = "tessera-scheduler"
# Rows every authenticated user has (system:basic-user): asking what it may do.
SELF_REVIEWS = {
    "selfsubjectaccessreviews.authorization.k8s.io",
    "selfsubjectreviews.authentication.k8s.io",
    "selfsubjectrulesreviews.authorization.k8s.io",
}
Matrix = dict[str, set[str]]


def kubectl(control_plane: ControlPlane, *args: str, stdin: str | None = None) -> str:
    binary = find_binaries(names=("kubectl",)) / "kubectl"
    result = subprocess.run(
        [str(binary), f"--kubeconfig={control_plane.kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def can_i_list(control_plane: ControlPlane, user: str, namespace: str) -> Matrix:
    """`kubectl auth can-i --list` for ``user`` in ``namespace``: resource -> verbs (resource names
    are shown as ``resource/name``); non-resource URLs and the self-review rows are left out."""
    out = kubectl(control_plane, "auth", "can-i", "--list", f"--as={user}", "-n", namespace)
    matrix: Matrix = {}
    for line in out.splitlines()[1:]:
        # Resources  Non-Resource URLs  Resource Names  Verbs, the last three in [brackets].
        found = re.match(r"^(\S*)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$", line)
        assert found, f"unexpected can-i line: {line!r}"
        resource, urls, names, verbs = found.groups()
        if not resource or urls or resource in SELF_REVIEWS:
            continue
        for name in names.split() or [""]:
            key = f"{resource}/{name}" if name else resource
            matrix.setdefault(key, set()).update(verbs.split())
    return matrix


@pytest.fixture
def installed(repo_root: Path, control_plane: ControlPlane, kube: client.ApiClient) -> Iterator[str]:
    """The chart's objects as `helm install tessera -n tessera-system` creates them."""
    helm = find_binaries(names=("helm",)) / "helm"
    rendered = subprocess.run(
        [str(helm), "template", RELEASE, str(repo_root / "charts" / "tessera"), "--namespace", NAMESPACE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # The namespace stays: nothing in this control plane (no kube-controller-manager) would finalize
    # its deletion, and other tests install into it as well.
    with contextlib.suppress(client.ApiException):
        client.CoreV1Api(kube).create_namespace({"metadata": {"name": NAMESPACE}})
    try:
        kubectl(control_plane, "apply", "--server-side", "-f", "-", stdin=rendered)
        yield rendered
    finally:
        subprocess.run(
            [
                str(find_binaries(names=("kubectl",)) / "kubectl"),
                f"--kubeconfig={control_plane.kubeconfig}",
                "delete",
                "--ignore-not-found",
                "-f",
                "-",
            ],
            input=rendered,
            capture_output=True,
            text=True,
            check=False,
        )


def test_the_node_agent_may_read_pods_and_write_only_its_node_pod_phases_events_and_evictions(
    installed: str, control_plane: ControlPlane
) -> None:
    matrix = can_i_list(control_plane, f"system:serviceaccount:{NAMESPACE}:{AGENT_SA}", "default")
    print(json.dumps({k: sorted(v) for k, v in sorted(matrix.items())}, indent=1))
    assert matrix == {
        # Its pod cache (list/watch by spec.nodeName), Allocate's lookup (get), the allocation
        # phase (patch, narrowed by the admission policy to pods on its node, one annotation) and
        # evictions (delete, narrowed to best-effort pods on its node that borrow GPU memory:
        # tests/deviceplugin/test_rbac.py).
        "pods": {"get", "list", "watch", "patch", "delete"},
        # The inventory annotation and heartbeat on its Node (narrowed to its own Node).
        "nodes": {"get", "patch"},
        # Warning events on pods it cannot serve (narrowed to pods, from its own node).
        "events": {"create"},
        # Who scrapes its /metrics: the scraper's token and its right to get /metrics
        # (system:auth-delegator, as kube-rbac-proxy holds; metricsAccess).
        "tokenreviews.authentication.k8s.io": {"create"},
        "subjectaccessreviews.authorization.k8s.io": {"create"},
    }


def test_the_scheduler_pods_hold_kube_schedulers_role_and_nothing_more(
    installed: str, control_plane: ControlPlane, kube: client.ApiClient
) -> None:
    """The tessera-scheduler pods (kube-scheduler and the extender beside it) share one service
    account: it holds what the cluster's own kube-scheduler holds (system:kube-scheduler,
    system:volume-scheduler) and its own leader-election Lease; the extender adds one right of its own
    beyond them, listing ResourceQuotas (a live resize is held against its namespace's), and none of
    them reads a Secret."""
    user = f"system:serviceaccount:{NAMESPACE}:{SCHEDULER_SA}"
    rbac = client.RbacAuthorizationV1Api(kube)
    held: Matrix = {}
    for role in ("system:kube-scheduler", "system:volume-scheduler"):
        for rule in rbac.read_cluster_role(role).rules or []:
            for group in rule.api_groups or [""]:
                for resource in rule.resources or []:
                    key = f"{resource}.{group}" if group else resource
                    for name in rule.resource_names or [""]:
                        held.setdefault(f"{key}/{name}" if name else key, set()).update(rule.verbs)

    def beyond_kube_scheduler(namespace: str) -> Matrix:
        matrix = can_i_list(control_plane, user, namespace)
        print(namespace, json.dumps({k: sorted(v) for k, v in sorted(matrix.items())}, indent=1))
        assert not any(r.startswith("secrets") for r in matrix), matrix
        extra = {
            r: verbs - held.get(r, set()) - held.get(r.split("/")[0], set()) for r, verbs in matrix.items()
        }
        return {r: verbs for r, verbs in extra.items() if verbs}

    # Its own leader-election Lease, in its namespace only (the cluster's scheduler holds kube-system's).
    assert beyond_kube_scheduler(NAMESPACE) == {
        "leases.coordination.k8s.io": {"get", "list", "update", "watch"},
        "resourcequotas": {"list"},
    }
    assert beyond_kube_scheduler("default") == {"resourcequotas": {"list"}}
    # What the extender's code does is within it: reading pods and nodes, binding, budgets.
    matrix = can_i_list(control_plane, user, "default")
    assert {"get", "list", "watch"} <= matrix["pods"]
    assert {"list", "watch"} <= matrix["nodes"]
    assert "create" in matrix["pods/binding"]
    assert "list" in matrix["poddisruptionbudgets.policy"]
