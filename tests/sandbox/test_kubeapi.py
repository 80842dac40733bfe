"""The harness's retrying API calls (tools/sandbox/kubeapi.py) against a stand-in API server that loses
answers, refuses connections and answers 409/404 as the real one does after a kill: no root needed."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from sandbox import kubeapi


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kubeapi, "FIRST_PAUSE_S", 0.001)
    monkeypatch.setattr(kubeapi, "LONGEST_PAUSE_S", 0.002)


class Store:
    """Objects by name, as an API server keeps them; ``lose`` answers are lost after the write."""

    def __init__(self, lose: int = 0, down: int = 0) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.lose, self.down, self.writes = lose, down, 0

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            self.down -= 1
            raise ConnectionRefusedError("connection refused")
        name = body["metadata"]["name"]
        if name in self.objects:
            raise client.ApiException(status=409, reason="AlreadyExists")
        self.objects[name] = body
        self.writes += 1
        if self.lose:
            self.lose -= 1
            raise ConnectionResetError("the API server was killed before it answered")
        return body

    def read(self, name: str) -> dict[str, Any]:
        return self.objects[name]

    def delete(self, name: str) -> None:
        if self.down:
            self.down -= 1
            raise client.ApiException(status=503, reason="Service UnavailableError")
        if self.objects.pop(name, None) is None:
            raise client.ApiException(status=404, reason="NotFound")
        if self.lose:
            self.lose -= 1
            raise ConnectionResetError("the API server was killed before it answered")


def test_a_create_whose_answer_was_lost_finds_its_own_object() -> None:
    store = Store(lose=1, down=2)
    made = kubeapi.create(store.create, store.read, {"metadata": {"name": "p", "annotations": {"a": "b"}}})
    assert store.writes == 1
    assert made is store.objects["p"]
    assert made["metadata"]["annotations"]["a"] == "b"


def test_a_create_that_finds_another_object_of_its_name_fails() -> None:
    store = Store()
    store.objects["p"] = {"metadata": {"name": "p"}}
    with pytest.raises(client.ApiException) as refused:
        kubeapi.create(store.create, store.read, {"metadata": {"name": "p"}})
    assert refused.value.status == 409


def test_each_create_is_its_own() -> None:
    store = Store()
    kubeapi.create(store.create, store.read, {"metadata": {"name": "p"}})
    with pytest.raises(client.ApiException):
        kubeapi.create(store.create, store.read, {"metadata": {"name": "p"}})


def test_a_delete_is_done_when_the_object_is_gone() -> None:
    store = Store(lose=1, down=1)
    store.objects["p"] = {"metadata": {"name": "p"}}
    kubeapi.delete(lambda: store.delete("p"))
    assert store.objects == {}
    kubeapi.delete(lambda: store.delete("never-there"))


def test_a_refusal_is_not_retried_and_an_unavailable_server_ends_at_the_deadline() -> None:
    calls = []

    def forbidden() -> None:
        calls.append(1)
        raise client.ApiException(status=403, reason="Forbidden")

    with pytest.raises(client.ApiException):
        kubeapi.retried(forbidden)
    assert len(calls) == 1

    def down() -> None:
        raise client.ApiException(status=504, reason="Gateway Timeout")

    with pytest.raises(kubeapi.UnavailableError, match="did not answer for 0s"):
        kubeapi.retried(down, deadline_s=0.05)
