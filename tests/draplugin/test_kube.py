"""The DRA driver's API adapter reads what the API server sends, whatever a claim's owner wrote in it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from draplugin.kube import ResourceApi
from tessera.contract import ContractError


class Objects:
    """The client's generic object calls, answering with fixed bytes (the adapter parses them)."""

    def __init__(self, data: str) -> None:
        self.data = data

    def get_namespaced_custom_object(self, *_: Any, **__: Any) -> SimpleNamespace:
        return SimpleNamespace(data=self.data)


def api_answering(data: str) -> ResourceApi:
    api = ResourceApi.__new__(ResourceApi)
    api._objects = Objects(data)  # type: ignore[assignment]
    return api


def test_a_claim_nested_5000_deep_is_a_clear_error_not_a_recursion_error() -> None:
    # A claim's opaque parameters are its owner's to write, and the API server keeps them as given.
    parameters = "[" * 5000 + "]" * 5000
    claim = f'{{"metadata": {{"name": "deep"}}, "spec": {{"config": [{{"opaque": {{"parameters": {parameters}}}}}]}}}}'
    with pytest.raises(ContractError, match=r"^resource claim team-a/deep: nested deeper than \d+ levels"):
        api_answering(claim).read_claim("team-a", "deep")


def test_an_ordinary_claim_is_read() -> None:
    claim = {"metadata": {"name": "c", "namespace": "team-a"}, "spec": {}}
    assert api_answering(json.dumps(claim)).read_claim("team-a", "c") == claim
