"""The harness's one way to call a Kubernetes API server that may be down or restarting (the sandbox's
own restarts, the chaos test's kills): every call retried on a lost connection or a 0/429/5xx answer,
with backoff, until a deadline; and creates and deletes idempotent by design, so that a retry whose
first attempt's answer was lost finds its own work done, not an error.

- ``create``: the object carries a fresh ``CREATE_ID`` annotation; an ``AlreadyExists`` (409) answer
  is success when the object there carries this create's id (it is the one this call made), and an
  error otherwise (a stale object of the same name is not ours to adopt).
- ``delete``: ``NotFound`` (404) is success: gone is what was asked.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import urllib3
from kubernetes import client

T = TypeVar("T")

# Answers that say "not now" (0: the client's own, for a connection it lost mid-answer).
RETRIED_STATUS = frozenset({0, 429, 500, 502, 503, 504})
# Long enough for a SIGKILLed etcd and kube-apiserver to come back on a loaded 2-core machine.
DEADLINE_S = 180.0
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.25, 4.0
CREATE_ID = "sandbox.tessera.io/create-id"


class UnavailableError(AssertionError):
    """The API server did not answer within the deadline (an assertion: the tests report it as one)."""


def retried(call: Callable[[], T], deadline_s: float = DEADLINE_S) -> T:
    """``call``'s result, retried while the API server (or etcd behind it) is down or restarting."""
    deadline = time.monotonic() + deadline_s
    pause = FIRST_PAUSE_S
    while True:
        try:
            return call()
        except (urllib3.exceptions.HTTPError, OSError) as e:
            error: Exception = e
        except client.ApiException as e:
            if e.status not in RETRIED_STATUS:
                raise
            error = e
        if time.monotonic() + pause > deadline:
            raise UnavailableError(f"the API server did not answer for {deadline_s:.0f}s: {error}") from error
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE_S)


def create(
    make: Callable[[dict[str, Any]], T],
    read: Callable[[str], T],
    body: dict[str, Any],
    deadline_s: float = DEADLINE_S,
) -> T:
    """``make(body)`` once in effect, retried: ``read(name)`` finds what a lost answer made."""
    stamped = copy.deepcopy(body)
    metadata = stamped.setdefault("metadata", {})
    stamp = uuid.uuid4().hex
    metadata["annotations"] = {**(metadata.get("annotations") or {}), CREATE_ID: stamp}

    def attempt() -> T:
        try:
            return make(stamped)
        except client.ApiException as e:
            if e.status != 409:
                raise
            there = read(metadata["name"])
            if (_annotations(there) or {}).get(CREATE_ID) != stamp:
                raise
            return there

    return retried(attempt, deadline_s)


def delete(remove: Callable[[], object], deadline_s: float = DEADLINE_S) -> None:
    """``remove()``, retried; already gone is done."""

    def attempt() -> None:
        try:
            remove()
        except client.ApiException as e:
            if e.status != 404:
                raise

    retried(attempt, deadline_s)


def _annotations(obj: Any) -> dict[str, str] | None:
    """An object's annotations, whether the client deserialised it (V1Pod) or not (a dict)."""
    if isinstance(obj, dict):
        annotations: dict[str, str] | None = obj.get("metadata", {}).get("annotations")
        return annotations
    return obj.metadata.annotations  # type: ignore[no-any-return]


def create_pod(core: client.CoreV1Api, body: dict[str, Any], namespace: str = "default") -> Any:
    return create(
        lambda b: core.create_namespaced_pod(namespace, b),
        lambda name: core.read_namespaced_pod(name, namespace),
        body,
    )


def delete_pod(core: client.CoreV1Api, name: str, namespace: str = "default") -> None:
    delete(lambda: core.delete_namespaced_pod(name, namespace, grace_period_seconds=0))
