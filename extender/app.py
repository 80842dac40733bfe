"""The HTTP face of the extender: kube-scheduler's verbs, health, readiness and metrics.

POST /filter, /prioritize, /preempt, /bind take and answer the extender v1 JSON (:mod:`extender.wire`).
A malformed request gets HTTP 400 with a message naming the field and the value; an unexpected
failure inside gets the error in the result's ``Error`` field (kube-scheduler reports it) and a
logged traceback, never a traceback in the answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Header
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from extender import wire
from extender.kube import ApiError
from extender.metrics import Metrics, VerbName
from extender.server import Limits
from extender.service import Extender
from extender.state import NotSyncedError
from extender.watch import Watcher
from tessera.contract import PodShapeError
from tessera.scrapeauth import AccessCache, drive_async, review_scrape

log = logging.getLogger(__name__)

# The longest message a refusal answers or logs: enough for the field and a cut value, never the
# megabytes of a body that carried them.
MESSAGE_LIMIT = 1000


def create_app(
    extender: Extender,
    watcher: Watcher | None = None,
    limits: Limits | None = None,
    scrapes: AccessCache | None = None,
) -> ExtenderApp:
    """``scrapes``: scrapes of /metrics are reviewed by the API server (tessera.scrapeauth), with
    these answers kept; None: /metrics is open to whoever reaches the health port."""
    metrics = extender.metrics
    priorities = wire.HostPriorityWriter()
    metrics.nodes.set_function(extender.state.node_count)
    metrics.oversubscribed_gpus.set_function(extender.state.oversubscribed_gpus)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if watcher is not None:
            watcher.start()
        try:
            yield
        finally:
            if watcher is not None:
                await watcher.stop()
            if extender.kube is not None:
                await extender.kube.close()

    app = FastAPI(title="Tessera scheduler extender", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def guarded(
        verb: VerbName,
        work: Callable[[], Awaitable[bytes]],
        on_error: Callable[[str], bytes],
        error_status: int = 200,
    ) -> tuple[bytes, int]:
        started = time.perf_counter()
        try:
            content, status = await work(), 200
        except (wire.BadRequestError, PodShapeError) as e:
            where = "Pod: " if isinstance(e, PodShapeError) else ""
            message = wire.cut(f"{where}{e}", MESSAGE_LIMIT)
            log.info("%s: bad request: %s", verb, message)
            content, status = f"bad {verb} request: {message}\n".encode(), 400
        except NotSyncedError as e:
            log.info("%s refused: %s", verb, e)
            content, status = on_error(str(e)), error_status
        except Exception as e:
            log.exception("%s failed", verb)
            failure = wire.cut(f"tessera extender: {verb} failed: {type(e).__name__}: {e}", MESSAGE_LIMIT)
            content, status = on_error(failure), error_status
        metrics.latency.labels(verb).observe(time.perf_counter() - started)
        metrics.requests.labels(verb, str(status)).inc()
        return content, status

    async def filter_(body: bytes) -> tuple[bytes, int]:
        async def work() -> bytes:
            pod, names, nodes = wire.parse_extender_args(body)
            result = await extender.filter_rechecked(pod, names)
            return wire.filter_result(result.passed, result.failed, result.unresolvable, nodes)

        return await guarded("filter", work, lambda e: wire.filter_result([], {}, {}, None, error=e))

    async def prioritize(body: bytes) -> tuple[bytes, int]:
        async def work() -> bytes:
            pod, names, _ = wire.parse_extender_args(body)
            # Names past the unknown ones answered are left out: a host not listed scores 0.
            hosts = extender.candidates(names)
            return priorities.write(hosts, extender.prioritize(pod, hosts))

        # A failed prioritize is ignored by kube-scheduler; an empty list says "no opinion".
        return await guarded("prioritize", work, lambda e: b"[]")

    async def preempt(body: bytes) -> tuple[bytes, int]:
        async def work() -> bytes:
            pod, proposed = wire.parse_preemption_args(body)
            return wire.preemption_result(await extender.preempt(pod, proposed))

        # ExtenderPreemptionResult has no error field: a failure is an HTTP error, which fails this
        # preemption attempt (kube-scheduler tries again with the pod's next attempt).
        return await guarded("preempt", work, lambda e: f"{e}\n".encode(), error_status=503)

    async def bind(body: bytes) -> tuple[bytes, int]:
        async def work() -> bytes:
            args = wire.parse_binding_args(body)
            error = await extender.bind(args.PodNamespace, args.PodName, args.PodUID, args.Node)
            return wire.binding_result(error)

        return await guarded("bind", work, wire.binding_result)

    @app.get("/healthz")
    async def healthz() -> Response:
        return PlainTextResponse("ok\n")

    @app.get("/readyz")
    async def readyz() -> Response:
        missing = extender.state.unsynced()
        if not missing:
            return PlainTextResponse("ok\n")
        return PlainTextResponse(f"caches not synced: {', '.join(missing)}\n", status_code=503)

    @app.get("/metrics")
    async def metrics_(authorization: Annotated[str | None, Header()] = None) -> Response:
        if scrapes is not None:
            assert extender.kube is not None, "reviewing scrapes needs the Kubernetes API"
            try:
                access = await drive_async(review_scrape(authorization, scrapes), extender.kube.post_review)
            except ApiError as e:
                log.warning("cannot review a scrape: %s", e)
                return PlainTextResponse("cannot review the scrape's token now\n", status_code=503)
            if not access.allowed:
                return PlainTextResponse(f"{access.reason}\n", status_code=access.status)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return ExtenderApp(
        app,
        {"/filter": filter_, "/prioritize": prioritize, "/preempt": preempt, "/bind": bind},
        limits or Limits(),
        metrics,
    )


# A verb: the request body in, (the answer, HTTP status) out.
Verb = Callable[[bytes], Awaitable[tuple[bytes, int]]]


class ExtenderApp:
    """The ASGI application uvicorn serves: kube-scheduler's POST verbs are answered straight from
    the ASGI messages, everything else (health, readiness, metrics, lifespan) by the FastAPI app.

    The verbs run for every pod scheduled and use nothing that routing, middleware, request and
    response objects or dependency injection add; without them the extender spends about a tenth
    less CPU per pod (docs/benchmarks.md). A verb catches its own errors (see ``guarded``).
    """

    def __init__(
        self, api: FastAPI, verbs: Mapping[str, Verb], limits: Limits, metrics: Metrics | None = None
    ) -> None:
        self.api = api
        self.verbs = dict(verbs)
        self.limits = limits
        self.metrics = metrics
        # Bytes of request bodies held now, all requests together (``limits.max_buffered_bytes``).
        self.buffered = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        verb = self.verbs.get(scope["path"]) if scope["type"] == "http" else None
        if verb is None:
            await self.api(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _send(send, 405, b"only POST\n", [(b"allow", b"POST")])
            return
        limit = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(send, scope, 413, f"request body of {declared} bytes is over {limit}\n")
            return
        chunks = []
        size = 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # kube-scheduler gave up on this request (its timeout): nobody to answer
                chunk = message.get("body", b"")
                size += len(chunk)
                self.buffered += len(chunk)
                if size > limit:
                    await self._refuse(send, scope, 413, f"request body is over {limit} bytes\n")
                    return
                if self.buffered > self.limits.max_buffered_bytes:
                    # Many large bodies at once: this one waits for a retry rather than the memory.
                    await self._refuse(send, scope, 503, "too many request bytes in flight; retry\n")
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            chunks.clear()
            content, status = await verb(body)
        finally:
            self.buffered -= size
        await _send(send, status, content)

    async def _refuse(self, send: Send, scope: Scope, status: int, message: str) -> None:
        verb = str(scope["path"]).lstrip("/")
        log.info("%s refused: %s", verb, message.strip())
        if self.metrics is not None:
            self.metrics.requests.labels(verb, str(status)).inc()
        await _send(send, status, message.encode(), [(b"connection", b"close")])


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _send(
    send: Send, status: int, content: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    kind = b"application/json" if status == 200 else b"text/plain; charset=utf-8"
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", kind),
                (b"content-length", str(len(content)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": content})
