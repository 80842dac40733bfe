"""KubeApi's own request path: the bearer token is read through the client's refresh hook, at
most once per TOKEN_TTL."""

from __future__ import annotations

import pytest
from kubernetes import client

from extender import kube
from extender.kube import KubeApi


def test_the_token_is_refreshed_through_the_hook_at_most_once_per_ttl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configuration = client.Configuration()
    configuration.host = "https://127.0.0.1:1"
    refreshed: list[int] = []

    def refresh(conf: client.Configuration) -> None:
        refreshed.append(1)
        conf.api_key = {"authorization": f"token-{len(refreshed)}"}
        conf.api_key_prefix = {"authorization": "Bearer"}

    configuration.refresh_api_key_hook = refresh
    api = KubeApi(configuration)
    clock = [1000.0]
    monkeypatch.setattr(kube.time, "monotonic", lambda: clock[0])
    assert api._headers()["Authorization"] == "Bearer token-1"
    clock[0] += kube.TOKEN_TTL / 2
    assert api._headers()["Authorization"] == "Bearer token-1"
    clock[0] += kube.TOKEN_TTL
    assert api._headers()["Authorization"] == "Bearer token-2"
    assert len(refreshed) == 2
