"""The extender's verbs over the cluster state: filter, prioritize, preempt, bind.

Decisions come from :mod:`tessera.placement`; the verbs' parts add what only the extender does
(answering in kube-scheduler's terms, the in-flight rule, the bind's writes to the API server).
:class:`Extender` composes them and hands each verb to its part:

* :class:`Filtering` (``filtering.py``): filter (with the recheck of in-flight nodes) and prioritize.
* :class:`Reserver` (``reserving.py``): a reservation where a pod was filtered or scored best, its
  pod checked in the background.
* :class:`Preemptor` (``preempting.py``): preempt.
* :class:`Binder` (``binding.py``): bind, with :class:`Decider` (``deciding.py``), its in-memory half.
* :class:`Leadership` (``leader.py``), :class:`CatchUp` (``catchup.py``), :class:`PodShapes`
  (``shapes.py``), :class:`FilteredPods` (``filtered.py``): what several verbs share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime, timedelta

from extender.binding import DEFAULT_SCHEDULER_NAME, Binder
from extender.catchup import CatchUp
from extender.deciding import Decider, Refusal
from extender.filtered import FilteredPods
from extender.filtering import FilterAnswer, Filtering
from extender.kube import KubeApi
from extender.leader import LeaderLease, Leadership
from extender.metrics import Metrics
from extender.preempting import Preemptor
from extender.reserving import Reserver
from extender.shapes import PodShapes
from extender.state import ClusterState
from extender.wire import Victims
from tessera.contract import Allocation, ContractKeys, JsonObject, PodRequest
from tessera.placement import QosThresholds


class Extender:
    def __init__(
        self,
        state: ClusterState,
        kube: KubeApi | None,
        keys: ContractKeys,
        metrics: Metrics,
        *,
        inflight_timeout: timedelta,
        clock: Callable[[], datetime],
        inflight_wait: timedelta = timedelta(seconds=2),
        filter_keeps_best: bool = True,
        scheduler_names: AbstractSet[str] = frozenset({DEFAULT_SCHEDULER_NAME}),
        qos_thresholds: QosThresholds | None = None,
        leader: LeaderLease | None = None,
    ) -> None:
        """``kube``: None without the Kubernetes API (tests, benchmarks: nothing is read or bound).
        ``leader``: beside a kube-scheduler that elects a leader, bind only while it leads."""
        self.state = state
        self.kube = kube
        self.metrics = metrics
        shapes = PodShapes(state.usage_rule is not None, qos_thresholds or QosThresholds())
        filtered = FilteredPods()
        catch_up = None if kube is None else CatchUp(state, kube)
        self.leadership = Leadership(kube, leader)
        self.reserver = Reserver(
            state, kube, keys, shapes, filtered, clock=clock, scheduler_names=scheduler_names
        )
        self.filtering = Filtering(
            state,
            keys,
            metrics,
            shapes,
            filtered=filtered,
            reserver=self.reserver,
            catch_up=catch_up,
            inflight_timeout=inflight_timeout,
            clock=clock,
            keeps_best=filter_keeps_best,
        )
        self.preemptor = Preemptor(state, kube, keys, metrics, shapes)
        self.decider = Decider(state, shapes, inflight_timeout=inflight_timeout, inflight_wait=inflight_wait)
        self.binder = Binder(
            state,
            kube,
            keys,
            metrics,
            shapes,
            filtered=filtered,
            reserver=self.reserver,
            decider=self.decider,
            catch_up=catch_up,
            leadership=self.leadership,
            clock=clock,
            scheduler_names=scheduler_names,
        )

    def candidates(self, names: Sequence[str]) -> Sequence[str]:
        return self.filtering.candidates(names)

    def filter(self, pod: JsonObject, names: Sequence[str]) -> FilterAnswer:
        return self.filtering.filter(pod, names)

    async def filter_rechecked(self, pod: JsonObject, names: Sequence[str]) -> FilterAnswer:
        return await self.filtering.filter_rechecked(pod, names)

    def prioritize(self, pod: JsonObject, names: Sequence[str]) -> list[int]:
        return self.filtering.prioritize(pod, names)

    async def preempt(self, pod: JsonObject, proposed: dict[str, Victims]) -> dict[str, Victims]:
        return await self.preemptor.preempt(pod, proposed)

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        return await self.binder.bind(namespace, name, uid, node)

    def decide(self, pod: JsonObject, request: PodRequest, node: str, now: datetime) -> Allocation | Refusal:
        return self.decider.decide(pod, request, node, now)

    async def leads(self) -> str:
        return await self.leadership.leads()
