"""Who may read Tessera's metrics: the rule the node agent's and the extender's /metrics share.

Their series name other namespaces' pods and what those use, so a scrape must come from someone the
cluster allows ``get`` on the non-resource URL ``/metrics``, as kube-rbac-proxy and the kubelet ask:
the bearer token is checked with a TokenReview, its user with a SubjectAccessReview. The chart binds
the ClusterRole ``tessera-metrics-reader`` to Prometheus's service account (docs/observability.md).

No I/O here: :func:`review_scrape` yields the two reviews to post and takes their answers, so the agent
(threads, the Kubernetes client) and the extender (asyncio, aiohttp) drive one rule. Answers are kept
for a short while per token (a scrape every 15 s must not cost two API calls each).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator
from typing import NamedTuple

from tessera.contract import JsonObject

METRICS_PATH = "/metrics"
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
# How long an answer holds for a token: an allowed one, and a refused one (a revoked binding or a
# deleted service account is seen within a minute).
ALLOWED_FOR = 60.0
REFUSED_FOR = 10.0
REMEMBERED_TOKENS = 1024


class Access(NamedTuple):
    """The answer to a scrape: an HTTP status (200, 401, 403) and, when refused, why."""

    status: int
    reason: str = ""

    @property
    def allowed(self) -> bool:
        return self.status == 200


ALLOWED = Access(200)


class Review(NamedTuple):
    """A review to post to the API server (path, body); its answer is sent back into the rule."""

    path: str
    body: JsonObject


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, None without one."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class AccessCache:
    """Answers by token (hashed: no token is kept), each until it expires; bounded, oldest out first.
    Safe to share between threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._answers: OrderedDict[str, tuple[Access, float]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def get(self, token: str) -> Access | None:
        key = self._key(token)
        with self._lock:
            known = self._answers.get(key)
            if known is None:
                return None
            if self.clock() >= known[1]:
                del self._answers[key]
                return None
            return known[0]

    def put(self, token: str, access: Access) -> None:
        key = self._key(token)
        hold = ALLOWED_FOR if access.allowed else REFUSED_FOR
        with self._lock:
            self._answers[key] = (access, self.clock() + hold)
            self._answers.move_to_end(key)
            while len(self._answers) > REMEMBERED_TOKENS:
                self._answers.popitem(last=False)


def review_scrape(
    authorization: str | None, cache: AccessCache, path: str = METRICS_PATH
) -> Generator[Review, JsonObject, Access]:
    """Whether a request with header ``authorization`` may read ``path``.

    Yields the TokenReview, then the SubjectAccessReview, to post (send back each answer, the API
    server's JSON); returns the access. A failed post is the driver's to answer (503, not kept).
    """
    token = bearer_token(authorization)
    if token is None:
        return Access(401, f"{path} needs a bearer token (a service account's, allowed get on {path})")
    known = cache.get(token)
    if known is not None:
        return known
    answer = yield Review(
        TOKEN_REVIEWS,
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}},
    )
    status = answer.get("status") or {}
    if not status.get("authenticated"):
        access = Access(401, f"the bearer token is not valid: {status.get('error') or 'not authenticated'}")
        cache.put(token, access)
        return access
    user = status.get("user") or {}
    name = str(user.get("username") or "")
    spec: JsonObject = {
        "user": name,
        "groups": list(user.get("groups") or []),
        "nonResourceAttributes": {"path": path, "verb": "get"},
    }
    if user.get("uid"):
        spec["uid"] = str(user["uid"])
    if user.get("extra"):
        spec["extra"] = user["extra"]
    answer = yield Review(
        ACCESS_REVIEWS,
        {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec},
    )
    allowed = bool((answer.get("status") or {}).get("allowed"))
    access = ALLOWED if allowed else Access(403, f"{name} may not get {path}")
    cache.put(token, access)
    return access


def drive(rule: Generator[Review, JsonObject, Access], post: Callable[[Review], JsonObject]) -> Access:
    """Run ``rule`` posting its reviews with ``post`` (blocking)."""
    try:
        review = next(rule)
        while True:
            review = rule.send(post(review))
    except StopIteration as done:
        access: Access = done.value
        return access


async def drive_async(
    rule: Generator[Review, JsonObject, Access], post: Callable[[Review], Awaitable[JsonObject]]
) -> Access:
    """Run ``rule`` posting its reviews with ``post`` (a coroutine)."""
    try:
        review = next(rule)
        while True:
            review = rule.send(await post(review))
    except StopIteration as done:
        access: Access = done.value
        return access
