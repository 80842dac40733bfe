"""Malformed shapes inside an otherwise valid body get HTTP 400 naming the field, never a 200 whose
Error is an AttributeError, RecursionError or TypeError (the extender's part of the hardening issue)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.extender.helpers import gpu_pod
from tests.extender.test_http import client, state  # noqa: F401  (fixtures)

POD = gpu_pod("p", memory=1024, uid="u1")


def with_spec(spec: object) -> bytes:
    return json.dumps({"Pod": {"metadata": POD["metadata"], "spec": spec}, "NodeNames": ["t4"]}).encode()


def with_container(container: object) -> bytes:
    return with_spec({"containers": [container]})


MALFORMED = [
    (with_spec({"containers": {"name": "x"}}), "Pod: spec.containers: must be a list, got an object"),
    (with_spec({"containers": "main"}), "Pod: spec.containers: must be a list, got a string"),
    (with_spec({"containers": [7]}), "Pod: spec.containers[0]: must be an object, got a number"),
    (with_spec({"initContainers": 1}), "Pod: spec.initContainers: must be a list, got a number"),
    (with_container({"name": 5}), "Pod: spec.containers[0]: name: must be a string, got a number"),
    (
        with_container({"name": "x", "resources": []}),
        "Pod: container 'x': resources: must be an object, got a list",
    ),
    (
        with_container({"name": "x", "resources": {"limits": ["tessera.io/vgpu"]}}),
        "Pod: container 'x': resources.limits: must be an object, got a list",
    ),
    (
        with_container({"name": "x", "resources": {"requests": "1"}}),
        "Pod: container 'x': resources.requests: must be an object, got a string",
    ),
    (
        b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}, "NodeNames": ["a\\ud800b"]}',
        "NodeNames.0: a string holds a lone UTF-16 surrogate",
    ),
    (
        b'{"Pod": {"metadata": {"name": "p\\udc00"}, "spec": {}}, "NodeNames": ["a"]}',
        "Pod.metadata.name: a string holds a lone UTF-16 surrogate",
    ),
    (
        b'{"Pod": {"metadata": {"name": "p"}, "spec": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}}",
        "request body nests JSON too deeply",
    ),
]


@pytest.mark.parametrize(("body", "message"), MALFORMED, ids=[m for _, m in MALFORMED])
@pytest.mark.parametrize("verb", ["/filter", "/prioritize"])
def test_malformed_shapes_get_400_naming_the_field(
    client: TestClient,  # noqa: F811
    verb: str,
    body: bytes,
    message: str,
) -> None:
    response = client.post(verb, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.text.startswith(f"bad {verb[1:]} request: {message}"), response.text
    for leak in ("Traceback", "AttributeError", "RecursionError", "TypeError"):
        assert leak not in response.text


def test_a_wrong_typed_quantity_names_the_resource(client: TestClient) -> None:  # noqa: F811
    container = {
        "name": "x",
        "resources": {"limits": {"tessera.io/vgpu": "1", "tessera.io/vgpu-memory": [1]}},
    }
    response = client.post("/filter", content=with_container(container))
    # A pod the API server could store (a quantity is a string there): no node can take it.
    assert response.status_code == 200
    reasons = response.json()["FailedAndUnresolvableNodes"]
    assert reasons == {"t4": "pod default/p: container 'x': tessera.io/vgpu-memory: [1] is not a quantity"}


def test_made_up_node_names_are_rejected_without_being_answered_one_by_one(
    client: TestClient,  # noqa: F811
) -> None:
    """A list of many names nobody knows (the issue's 4.2 million, here under the body cap): the
    known nodes are answered as ever, the first 100 unknown ones with a reason, the rest rejected
    by being left out of the answer (kube-scheduler keeps only the names answered as passed)."""
    names = ["t4", *(f"made-up-{i}" for i in range(5000)), "a100", "t4"]
    body = json.dumps({"Pod": POD, "NodeNames": names}).encode()
    answer = client.post("/filter", content=body).json()
    assert answer["NodeNames"] == ["t4", "a100"]
    assert len(answer["FailedNodes"] or {}) + len(answer["FailedAndUnresolvableNodes"] or {}) <= 100
    scores = client.post("/prioritize", content=body).json()
    assert [s["Host"] for s in scores][:1] == ["t4"]
    assert len(scores) == 102  # t4, a100 and the first 100 unknown (score 0)
