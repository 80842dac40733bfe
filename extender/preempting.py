"""Preempt: kube-scheduler's victims per candidate node answered with the victims that make the pod
fit on the node's GPUs (docs/placement.md, "Preemption")."""

from __future__ import annotations

import logging

from extender.budgets import Budget, parse_budgets
from extender.kube import KubeApi
from extender.metrics import Metrics
from extender.shapes import PodShapes, ref_of
from extender.state import ClusterState, require_synced
from extender.wire import Victims
from tessera.contract import (
    ContractError,
    ContractKeys,
    JsonObject,
    PodShapeError,
    parse_pod_request,
    pod_priority,
)

log = logging.getLogger(__name__)

# Sets of victims a preempt call weighs, all its candidate nodes together, and at least per node:
# well within kube-scheduler's httpTimeout (docs/benchmarks.md, "Preemption: one call").
PREEMPT_SETS = 20_000
MIN_PREEMPT_SETS = 100
# Where preempt reads the PodDisruptionBudgets of every namespace.
DISRUPTION_BUDGETS = "/apis/policy/v1/poddisruptionbudgets"


class Preemptor:
    def __init__(
        self,
        state: ClusterState,
        kube: KubeApi | None,
        keys: ContractKeys,
        metrics: Metrics,
        shapes: PodShapes,
    ) -> None:
        self.state = state
        self.kube = kube
        self.keys = keys
        self.metrics = metrics
        self.shapes = shapes

    async def preempt(self, pod: JsonObject, proposed: dict[str, Victims]) -> dict[str, Victims]:
        """kube-scheduler's victims per candidate node (``proposed``, chosen by its own view: CPU,
        memory, the slice count) answered with the victims that make the pod fit on the node's GPUs.
        A node where no eviction of lower-priority pods makes room is left out; one where the pod
        fits on a GPU already keeps kube-scheduler's victims.

        The answer's victims on a node are the GPU pods :meth:`ClusterState.choose_victims` picks,
        then kube-scheduler's victims that hold no GPU share there (it chose them for CPU, memory
        or pod count, which only it judges)."""
        require_synced(self.state)
        try:
            request = parse_pod_request(pod, self.keys)
        except PodShapeError:
            raise
        except ContractError as e:
            log.info("preempt: pod %s: %s", ref_of(pod), e)
            self.metrics.preemption_nodes.labels("removed").inc(len(proposed))
            return {}
        if not request.wants_gpu:
            return proposed
        priority = pod_priority(pod)
        shape = self.shapes.shape(pod, request)
        budgets = await self._disruption_budgets()
        answer: dict[str, Victims] = {}
        # The call's sets shared among its nodes: kube-scheduler waits for the answer (httpTimeout).
        sets = max(MIN_PREEMPT_SETS, PREEMPT_SETS // max(1, len(proposed)))
        for name, theirs in proposed.items():
            decided = self.state.choose_victims(name, shape, priority, budgets, sets)
            if isinstance(decided, str):
                log.debug("preempt: pod %s: node %s left out: %s", ref_of(pod), name, decided)
                self.metrics.preemption_nodes.labels("removed").inc()
                continue
            if not decided.victims:
                if theirs.uids:  # the pod fits on a GPU already: kube-scheduler's victims stand
                    answer[name] = theirs
                    self.metrics.preemption_nodes.labels("kept").inc()
                else:
                    self.metrics.preemption_nodes.labels("removed").inc()
                continue
            on_gpus = {p.uid for p in self.state.pods_on(name)}
            others = tuple(uid for uid in theirs.uids if uid not in on_gpus)
            answer[name] = Victims(
                tuple(v.uid for v in decided.victims) + others,
                # kube-scheduler's count covers its own victims: at most all of the others break one.
                decided.budget_violations + min(theirs.budget_violations, len(others)),
            )
            self.metrics.preemption_nodes.labels("victims").inc()
            self.metrics.preemption_victims.inc(len(decided.victims))
        log.info(
            "preempt: pod %s: %d of %d candidate nodes answered (the others: no eviction makes room)",
            ref_of(pod),
            len(answer),
            len(proposed),
        )
        return answer

    async def _disruption_budgets(self) -> list[Budget]:
        """The cluster's PodDisruptionBudgets, read afresh: preemption is rare, and a budget's
        disruptions allowed change with every pod its controller sees."""
        if self.kube is None:
            return []
        items, _ = await self.kube.list(DISRUPTION_BUDGETS)
        return parse_budgets(items)
