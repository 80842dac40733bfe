"""Allocation matching and confirmation: which in-flight container each of the kubelet's calls is
for (docs/deviceplugin.md "Allocate: how a container is matched to its pod").

GetPreferredAllocation and Allocate are answered from the pod cache when its match is fresh and the
API confirms the pods matched (one get per pod, or the read of the GetPreferredAllocation just
before), else from a fresh list of the node's pods. The decisions are the pure
:mod:`deviceplugin.matching`'s; the containers are served by :class:`ServedContainers`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deviceplugin.config import Config
from deviceplugin.kube import FreshReads, Kube, KubeUnavailableError
from deviceplugin.matching import (
    AllocationError,
    BrokenPod,
    ContainerRef,
    InFlight,
    NodeSnapshot,
    PodView,
    grants_text,
    match_container,
    preferred_devices,
    snapshot,
)
from deviceplugin.podcache import PodCache
from deviceplugin.response import ContainerAnswer
from deviceplugin.served import ServedContainers
from tessera.contract import Phase, now
from tessera.inflight import InflightKey

log = logging.getLogger(__name__)

FAILED_REASON = "TesseraAllocateFailed"
# A kubelet calls Allocate within milliseconds of the GetPreferredAllocation of the same container;
# a confirmation older than this belongs to an admission that never reached its Allocate.
PREFERRED_CONFIRMATION_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class PreferredConfirmation:
    """A GetPreferredAllocation answered from the cache, with the in-flight key of the pod the API
    confirmed for it by a read that started after the call: the kubelet's next call, the Allocate
    of the same container, may take that confirmation instead of reading again
    (:meth:`Allocator.allocate`)."""

    call: int  # its number among the kubelet's calls (Allocator._calls)
    answered_at: float  # monotonic
    devices: frozenset[str]  # the slices it answered
    key: InflightKey  # the key of every container of that GPU count in the confirmed pod


class Allocator:
    def __init__(
        self,
        config: Config,
        node_gpus: frozenset[str],
        kube: Kube,
        served: ServedContainers,
        *,
        cache: PodCache | None = None,
        on_served: Callable[[], object] = lambda: None,
    ) -> None:
        """``node_gpus``: the UUIDs of the node's GPUs. ``cache``: the pods on the node, read before
        the API (None: the API only). ``on_served``: told after each Allocate that served
        containers (the kubelet's confirmation and the usage check are due)."""
        self._config = config
        self._node_gpus = node_gpus
        self._kube = kube
        self._served = served
        self._cache = cache
        self._on_served = on_served
        self._reads = FreshReads(kube)
        # Guards the kubelet's calls, numbered as they arrive, and the last preferred answer
        # confirmed with the API, for the Allocate that follows it.
        self._calls_lock = threading.Lock()
        self._calls = 0
        self._preferred: PreferredConfirmation | None = None
        # Allocate calls answered from the cache and from a fresh list; why the cache could not;
        # cache answers confirmed by their GetPreferredAllocation's read instead of a read of their own.
        self.cache_answers = 0
        self.preferred_confirmations = 0
        self.api_answers = 0
        self.api_reasons: Counter[str] = Counter()

    def preferred(self, available: Sequence[str], must_include: Sequence[str], gpu_count: int) -> list[str]:
        """The slices to steer the kubelet to; without the API, distinct GPUs (an error here would
        fail the pod's admission, while Allocate can still decide once the API is back).

        From the pod cache when its first in-flight container of that GPU count is fresh and the
        API confirms its pod (as Allocate does; that confirmation is kept for the Allocate that
        follows); otherwise from a fresh list of the node's pods."""
        call = self._next_call()
        pods = self._cache.pending_pods() if self._cache is not None else None
        if pods is not None:
            state = self._snapshot(pods, self._served.taken())
            first = next((c for c in state.in_flight if c.key.gpu_count == gpu_count), None)
            try:
                if first is not None and not first.stale and self._confirmed([first.pod]):
                    answer = preferred_devices(available, must_include, gpu_count, state)
                    own = self._snapshot([first.pod], set()).in_flight
                    if {c.key for c in own if c.key.gpu_count == gpu_count} == {first.key}:
                        kept = PreferredConfirmation(call, time.monotonic(), frozenset(answer), first.key)
                        with self._calls_lock:
                            self._preferred = kept
                    return answer
            except KubeUnavailableError as e:
                log.warning("GetPreferredAllocation without the pods: %s", e)
                return preferred_devices(available, must_include, gpu_count, self._snapshot([], set()))
        try:
            pods = self._kube.pending_pods()
        except KubeUnavailableError as e:
            log.warning("GetPreferredAllocation without the pods: %s", e)
            pods = []
        state = self._snapshot(pods, self._served.taken())
        return preferred_devices(available, must_include, gpu_count, state)

    def allocate(self, requests: Sequence[Sequence[str]]) -> list[ContainerAnswer]:
        """Answers for the containers of one Allocate call, in order; raises :class:`AllocationError`.

        From the pod cache when it has a fresh match whose pods the API confirms (one get per pod),
        else from a fresh list of the node's pods (docs/deviceplugin.md "Allocate from the pod
        cache"). Matching and serving happen under the served containers' lock, and a container
        matched from the cache is reserved while its pod is confirmed, so two concurrent calls never
        pick the same container. The ``allocated`` phase of a pod served in full is written after
        the answer, once the kubelet names the pod it admitted
        (:meth:`deviceplugin.admissions.Admissions.confirm`).
        """
        served = self._allocate_from_cache(requests, self._next_call())
        if served is None:
            served = self._allocate_from_api(requests)
        chosen, answers = served
        self._on_served()
        for c in chosen:
            log.info(
                "Allocate: pod %s container %s gets %s",
                c.pod.ref,
                c.container,
                grants_text(c.grants),
            )
        return answers

    def _next_call(self) -> int:
        with self._calls_lock:
            self._calls += 1
            return self._calls

    def _allocate_from_cache(
        self, requests: Sequence[Sequence[str]], call: int
    ) -> tuple[list[InFlight], list[ContainerAnswer]] | None:
        """The answers from the pod cache, or None when it cannot answer for sure: not synced, no
        match, a stale match (a fresh pod it has not seen yet would come first), or a matched pod
        the API no longer shows as the cache does. ``call``: this call's number."""
        pods = self._cache.pending_pods() if self._cache is not None else None
        if pods is None:
            return None
        served = self._served
        with served.lock:
            if served.fallback_waiting():  # no new reservations while a fallback waits for them to end
                self.api_reasons["a fallback waiting"] += 1
                return None
            try:
                chosen = self._match(self._snapshot(pods, served.taken()), requests)
            except AllocationError:
                self.api_reasons["no match in the cache"] += 1
                log.info("Allocate: no fresh match in the pod cache for %s; asking the API", list(requests))
                return None
            if any(c.stale for c in chosen):
                self.api_reasons["stale match"] += 1
                return None
            refs = {c.ref for c in chosen}
            served.reserve(refs)
            with self._calls_lock:
                preferred, self._preferred = self._preferred, None
        try:
            try:
                confirmed = self._confirmed_by(preferred, call, chosen, requests) or self._confirmed(
                    [c.pod for c in chosen]
                )
            except KubeUnavailableError as e:
                log.warning("Allocate: %s", e)
                confirmed = False
            if not confirmed:
                self.api_reasons["not confirmed"] += 1
                return None
            answers = served.serve(chosen, requests)
            self.cache_answers += 1
            return chosen, answers
        finally:
            served.release(refs)

    def _allocate_from_api(
        self, requests: Sequence[Sequence[str]]
    ) -> tuple[list[InFlight], list[ContainerAnswer]]:
        """The answers from a fresh list of the node's pods, as before the cache; a refusal is
        reported on the pods concerned. The list may be read before the lock because records, not
        phases, say what is served; matching waits for the cache path's reservations to settle, so
        a container being confirmed is neither taken twice nor refused for."""
        pods = self._kube.pending_pods()
        served = self._served
        try:
            with served.lock:
                served.wait_for_reservations()
                chosen = self._match(self._snapshot(pods, served.served()), requests)
                answers = served.serve(chosen, requests)
        except AllocationError as e:
            log.warning("Allocate refused: %s", e.message)
            self._report_failure(e.concerned, e.message)
            raise
        self.api_answers += 1
        return chosen, answers

    def _snapshot(self, pods: Sequence[PodView], served: set[ContainerRef]) -> NodeSnapshot:
        return snapshot(
            pods,
            keys=self._config.keys,
            node=self._config.node_name,
            node_gpus=self._node_gpus,
            served=served,
            now=now(),
            inflight_timeout=self._config.inflight_timeout,
        )

    def _match(self, state: NodeSnapshot, requests: Sequence[Sequence[str]]) -> list[InFlight]:
        chosen: list[InFlight] = []
        for device_ids in requests:
            chosen.append(
                match_container(
                    device_ids,
                    state,
                    node=self._config.node_name,
                    node_gpus=self._node_gpus,
                    taken={c.ref for c in chosen},
                )
            )
        return chosen

    def _confirmed(self, pods: Sequence[PodView]) -> bool:
        """Whether the API shows each pod as the cache does: still there, pending, not being
        deleted, with the same UID, allocation, phase, bind time and GPU containers. Then the pod is
        in flight for the extender too, and by the rule every in-flight container of another pod
        with the same GPU count has the matched container's key (however far the cache lags): the
        read started after the kubelet had the pod it admits, so either pod was bound while the
        other was in flight."""
        keys = self._config.keys
        fields = (keys.allocation, keys.allocation_phase, keys.bind_time)
        unique = {p.uid: p for p in pods}.values()
        read = self._reads.read_pods([(p.namespace, p.name) for p in unique])
        for pod in unique:
            fresh = read[(pod.namespace, pod.name)]
            if (
                fresh is None
                or not fresh.pending
                or fresh.view.uid != pod.uid
                or fresh.view.gpu_containers != pod.gpu_containers
                or fresh.view.request_error != pod.request_error
                or any(fresh.view.annotations.get(k) != pod.annotations.get(k) for k in fields)
            ):
                log.info("Allocate: pod %s changed since the pod cache saw it; asking the API", pod.ref)
                return False
        return True

    def _confirmed_by(
        self,
        preferred: PreferredConfirmation | None,
        call: int,
        chosen: Sequence[InFlight],
        requests: Sequence[Sequence[str]],
    ) -> bool:
        """Whether the GetPreferredAllocation just before this Allocate confirmed its match: the
        kubelet's previous call, for the slices this call asks for, within a second, and the match
        has the key it confirmed. A kubelet admits one container at a time and calls
        GetPreferredAllocation, then Allocate, for its slices (the device manager's
        devicesToAllocate), and that call's read started after the kubelet had the pod it admits.
        The pod the read confirmed was then in flight, so by :meth:`_confirmed`'s argument the
        container admitted has that pod's key for its GPU count (one key: checked when it was
        kept), whichever pod it is; so has the match, even when it is another pod of that key.
        Anything else, such as calls interleaved by another client, reads again."""
        if (
            preferred is None
            or preferred.call != call - 1
            or time.monotonic() - preferred.answered_at > PREFERRED_CONFIRMATION_SECONDS
            or len(requests) != 1
            or frozenset(requests[0]) != preferred.devices
            or any(c.key != preferred.key for c in chosen)
        ):
            return False
        self.preferred_confirmations += 1
        return True

    def _report_failure(self, concerned: Sequence[BrokenPod], message: str) -> None:
        for broken in concerned:
            try:
                self._kube.set_phase(broken.pod, Phase.FAILED)
            except Exception as e:  # the API being unreachable must not fail the kubelet's call
                log.warning("pod %s: cannot set phase %s: %s", broken.pod.ref, Phase.FAILED.value, e)
            try:
                self._kube.warn(broken.pod, FAILED_REASON, f"{broken.reason} ({message})")
            except Exception as e:
                log.warning("pod %s: cannot record event: %s", broken.pod.ref, e)
