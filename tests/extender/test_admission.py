"""deploy/extender.yaml's RBAC and admission policy, applied to the real API server: only Tessera's
service accounts may set or change a pod's placement annotations (a tenant editing its bound pod's
allocation from 40960 to 1024 MiB is refused), only users granted tessera-resizer may ask a pod for
a live resize (a tenant who may edit its pods may not), and the extender may do exactly what its
code does."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from sandbox.controlplane import ControlPlane
from tessera.contract import KEYS
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "extender.yaml"
EXTENDER_SA = "system:serviceaccount:kube-system:tessera-extender"
TENANT = "tenant"
RESIZER = "resizer"  # a user the namespace binds the chart's tessera-resizer to
KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
         "ValidatingAdmissionPolicyBinding")  # fmt: skip


def allocation(memory_mib: int) -> str:
    grant = {"uuid": "GPU-n-0", "memory_mib": memory_mib, "cores": 100}
    return json.dumps({"node": "n", "containers": [{"name": "main", "gpus": [grant]}]})


def _apply(api: client.ApiClient, doc: dict[str, Any]) -> None:
    rbac, admission = client.RbacAuthorizationV1Api(api), client.AdmissionregistrationV1Api(api)
    {
        "ServiceAccount": lambda: client.CoreV1Api(api).create_namespaced_service_account("kube-system", doc),
        "ClusterRole": lambda: rbac.create_cluster_role(doc),
        "ClusterRoleBinding": lambda: rbac.create_cluster_role_binding(doc),
        "ValidatingAdmissionPolicy": lambda: admission.create_validating_admission_policy(doc),
        "ValidatingAdmissionPolicyBinding": lambda: admission.create_validating_admission_policy_binding(doc),
    }[doc["kind"]]()


def _delete(api: client.ApiClient, doc: dict[str, Any]) -> None:
    rbac, admission = client.RbacAuthorizationV1Api(api), client.AdmissionregistrationV1Api(api)
    name = doc["metadata"]["name"]
    calls: dict[str, Callable[[], object]] = {
        "ServiceAccount": lambda: client.CoreV1Api(api).delete_namespaced_service_account(
            name, "kube-system"
        ),
        "ClusterRole": lambda: rbac.delete_cluster_role(name),
        "ClusterRoleBinding": lambda: rbac.delete_cluster_role_binding(name),
        "ValidatingAdmissionPolicy": lambda: admission.delete_validating_admission_policy(name),
        "ValidatingAdmissionPolicyBinding": lambda: admission.delete_validating_admission_policy_binding(
            name
        ),
    }
    try:
        calls[doc["kind"]]()
    except client.ApiException as e:
        if e.status != 404:
            raise


@pytest.fixture
def deployed(kube: client.ApiClient, namespace: str) -> Iterator[None]:
    docs = [d for d in yaml.safe_load_all(DEPLOY.read_text()) if d and d["kind"] in KINDS]
    assert {d["kind"] for d in docs} == set(KINDS)
    # The tenant may do anything with pods in its namespace, Bindings included (RBAC alone would let
    # it write the annotations).
    rbac = client.RbacAuthorizationV1Api(kube)
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "tenant"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods", "pods/status", "pods/binding", "bindings"],
                    "verbs": ["*"],
                }
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "tenant"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}
                for user in (TENANT, RESIZER)
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "resizer"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "tessera-resizer",
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": RESIZER}],
        },
    )
    try:
        for doc in docs:
            _apply(kube, doc)
        core = client.CoreV1Api(kube)

        def effective() -> bool:
            """The API server loads a policy in the background: a dry run shows when it refuses."""
            try:
                core.create_namespaced_pod(namespace, pod("probe", {KEYS.allocation: "{}"}), dry_run="All")
            except client.ApiException as e:
                return e.status == 403
            return False

        wait_for(effective, timeout=30, what="the admission policy to take effect")
        yield
    finally:
        for doc in reversed(docs):
            _delete(kube, doc)


@pytest.fixture
def as_user(control_plane: ControlPlane) -> Iterator[Callable[[str], client.CoreV1Api]]:
    """A client acting as ``user`` (the admin impersonating it: RBAC and admission see ``user``)."""
    apis: list[client.ApiClient] = []

    def make(user: str) -> client.CoreV1Api:
        api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
        api.set_default_header("Impersonate-User", user)
        apis.append(api)
        return client.CoreV1Api(api)

    try:
        yield make
    finally:
        for api in apis:
            api.close()


def pod(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {"schedulerName": "tessera-scheduler", "containers": [{"name": "main", "image": "x"}]},
    }


def binding(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": annotations},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n"},
    }


def refused(call: Callable[[], object]) -> tuple[int, str]:
    with pytest.raises(client.ApiException) as error:
        call()
    return error.value.status, json.loads(error.value.body)["message"]


def test_only_tessera_sets_or_changes_the_placement_annotations(
    deployed: None,
    namespace: str,
    as_user: Callable[[str], client.CoreV1Api],
    create_fake_node: Callable[..., str],
) -> None:
    create_fake_node("n", {"cpu": "4", "memory": "8Gi", "pods": "10"})
    tenant, extender = as_user(TENANT), as_user(EXTENDER_SA)
    tenant.create_namespaced_pod(namespace, pod("p"))
    placement = {
        KEYS.allocation: allocation(40960),
        KEYS.allocation_phase: "allocating",
        KEYS.bind_time: "2026-01-01T12:00:00Z",
    }
    message = "only Tessera may set, change or remove the annotations tessera.io/allocation"

    # A tenant may neither bind its pod with an allocation nor create one carrying it.
    for call in (
        lambda: tenant.create_namespaced_pod_binding("p", namespace, binding("p", placement)),
        lambda: tenant.create_namespaced_binding(namespace, binding("p", placement)),
    ):
        status, text = refused(call)
        assert status == 403 and message in text, text
    status, text = refused(lambda: tenant.create_namespaced_pod(namespace, pod("q", placement)))
    assert status == 403 and message in text, text

    # The extender binds the pod with its allocation (a Binding, its only write).
    extender.create_namespaced_pod_binding("p", namespace, binding("p", placement), _preload_content=False)
    bound = extender.read_namespaced_pod("p", namespace)
    assert bound.spec.node_name == "n"
    assert bound.metadata.annotations[KEYS.allocation] == allocation(40960)

    # The issue's edit: 40960 -> 1024 MiB on the tenant's own bound pod. Refused, and so is removing it.
    for change in ({KEYS.allocation: allocation(1024)}, {KEYS.allocation: None}, {KEYS.bind_time: None}):
        status, text = refused(
            lambda change=change: tenant.patch_namespaced_pod(
                "p", namespace, {"metadata": {"annotations": change}}
            )
        )
        assert status == 403 and message in text, text
    # The answer to a live resize is Tessera's too, by either path; the request is the tenant's.
    for patch in (tenant.patch_namespaced_pod, tenant.patch_namespaced_pod_status):
        for change in ({KEYS.resize_status: "{}"}, {KEYS.allocation: allocation(1024)}):
            status, text = refused(
                lambda patch=patch, change=change: patch(
                    "p", namespace, {"metadata": {"annotations": change}}
                )
            )
            assert status == 403 and f"{KEYS.bind_time}, {KEYS.resize_status} of pod" in text, text
    # Asking for a live resize needs a right of its own: a tenant who may edit its pods may not (a
    # resize grows what the pod gets); a user the namespace binds tessera-resizer to may.
    ask = {"metadata": {"annotations": {KEYS.resize: "cores=50"}}}
    status, text = refused(lambda: tenant.patch_namespaced_pod("p", namespace, ask))
    assert status == 403 and f"{TENANT} may not ask pod {namespace}/p for a live resize" in text, text
    assert "update on pods/resize in the API group tessera.io" in text, text
    status, text = refused(
        lambda: tenant.create_namespaced_pod(namespace, pod("r", {KEYS.resize: "cores=50"}))
    )
    assert status == 403 and "for a live resize" in text, text
    as_user(RESIZER).patch_namespaced_pod("p", namespace, ask)
    # The extender answers it through the pod's status subresource (kube-scheduler's right).
    answer = {KEYS.allocation: allocation(2048), KEYS.resize_status: "{}", KEYS.resize: None}
    extender.patch_namespaced_pod_status("p", namespace, {"metadata": {"annotations": answer}})
    answered = extender.read_namespaced_pod("p", namespace).metadata.annotations
    assert answered[KEYS.allocation] == allocation(2048) and KEYS.resize not in answered
    # Other annotations stay the tenant's.
    tenant.patch_namespaced_pod("p", namespace, {"metadata": {"annotations": {"team": "a"}}})
    assert tenant.read_namespaced_pod("p", namespace).metadata.annotations[KEYS.allocation] == allocation(
        2048
    )


def test_the_extender_may_do_what_its_code_does_and_no_more(
    deployed: None,
    namespace: str,
    kube: client.ApiClient,
    as_user: Callable[[str], client.CoreV1Api],
    create_fake_node: Callable[..., str],
) -> None:
    create_fake_node("n", {"cpu": "4", "memory": "8Gi", "pods": "10"})
    client.CoreV1Api(kube).create_namespaced_pod(namespace, pod("p"))
    extender = as_user(EXTENDER_SA)
    # What extender/kube.py does: list and watch nodes and pods, get a pod, create a Binding, patch a
    # pod's status (a live resize's answer), create an event, and list a namespace's ResourceQuotas
    # (a live resize is held against them).
    assert [n.metadata.name for n in extender.list_node().items] == ["n"]
    assert [
        p.metadata.name for p in extender.list_pod_for_all_namespaces(field_selector="spec.nodeName=").items
    ]
    assert extender.read_namespaced_pod("p", namespace).metadata.name == "p"
    assert extender.list_namespaced_resource_quota(namespace).items == []
    extender.patch_namespaced_pod_status("p", namespace, {"metadata": {"annotations": {"x": "y"}}})
    extender.create_namespaced_event(
        namespace,
        {
            "metadata": {"generateName": "p."},
            "involvedObject": {"kind": "Pod", "name": "p", "namespace": namespace},
        },
    )
    # And nothing else: no pod patch (the Binding carries the annotations), no node read or write.
    for call in (
        lambda: extender.patch_namespaced_pod("p", namespace, {"metadata": {"labels": {"x": "y"}}}),
        lambda: extender.delete_namespaced_pod("p", namespace),
        lambda: extender.read_node("n"),
        lambda: extender.patch_node("n", {"metadata": {"labels": {"x": "y"}}}),
        lambda: extender.create_namespaced_pod(namespace, pod("other")),
        lambda: extender.create_namespaced_resource_quota(namespace, {"metadata": {"name": "q"}, "spec": {}}),
    ):
        status, text = refused(call)
        assert status == 403 and "forbidden" in text, text
