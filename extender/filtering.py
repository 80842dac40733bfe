"""Filter and prioritize: which of kube-scheduler's nodes can take a pod now, and how well, answered
in its terms from the cluster state (docs/placement.md, "Filter" and "Scores"); the in-flight rule
checked on the nodes with pods in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import compress
from operator import attrgetter, not_

from extender.catchup import CatchUp
from extender.filtered import Filtered, FilteredPods
from extender.kube import ApiError
from extender.metrics import Metrics
from extender.reserving import Reserver
from extender.shapes import PodShapes, ref_of
from extender.state import ClusterState, require_synced
from tessera.contract import ContractError, ContractKeys, JsonObject, PodShapeError, parse_pod_request
from tessera.placement import NodeFit, NodeRejection, Shortfall, best_fits, score_fits

log = logging.getLogger(__name__)

# Names of nodes the extender does not know answered per request with a reason; more are rejected
# by leaving them out (a filter body can carry millions of made-up names).
UNKNOWN_NAMES_ANSWERED = 100
# A filter that no node passed, the in-flight rule refusing some, reads the pods of at most this many
# of those nodes, within this many seconds (kube-scheduler waits httpTimeout, 5 s by default, for an answer).
RECHECKED_NODES = 4
RECHECK_TIMEOUT = 2.0
_NAME = attrgetter("name")  # a C-level loop over thousands of fits
_NODE = attrgetter("node")
_REASON = attrgetter("reason")
_SHORTFALL = attrgetter("shortfall")
_UNRESOLVABLE = attrgetter("unresolvable")


@dataclass(slots=True)
class FilterAnswer:
    passed: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    # The nodes the in-flight rule refused the pod on, best first.
    inflight_refused: list[str] = field(default_factory=list)
    # Nodes refused, by Shortfall (the metrics' counts).
    shortfalls: Counter[str] = field(default_factory=Counter)
    # A GPU pod whose request parsed: a placement decision (the metrics count those alone).
    placed: bool = True


class Filtering:
    def __init__(
        self,
        state: ClusterState,
        keys: ContractKeys,
        metrics: Metrics,
        shapes: PodShapes,
        *,
        filtered: FilteredPods,
        reserver: Reserver,
        catch_up: CatchUp | None,
        inflight_timeout: timedelta,
        clock: Callable[[], datetime],
        keeps_best: bool,
    ) -> None:
        """``catch_up``: None without the Kubernetes API (nothing to recheck with). ``keeps_best``:
        filter passes only the nodes with the top score (``--filter-keeps=best``)."""
        self.state = state
        self.keys = keys
        self.metrics = metrics
        self.shapes = shapes
        self.filtered = filtered
        self.reserver = reserver
        self.catch_up = catch_up
        self.inflight_timeout = inflight_timeout
        self.clock = clock
        self.keeps_best = keeps_best

    def candidates(self, names: Sequence[str]) -> Sequence[str]:
        """The names worth answering: every known node once, and the first
        ``UNKNOWN_NAMES_ANSWERED`` unknown ones (:meth:`CountedNodes.candidates`)."""
        return self.state.candidates(names, UNKNOWN_NAMES_ANSWERED)

    def filter(self, pod: JsonObject, names: Sequence[str]) -> FilterAnswer:
        answer = self._filter(pod, names)
        self._count(answer)
        return answer

    def _count(self, answer: FilterAnswer) -> None:
        self.metrics.count_rejections(answer.shortfalls)
        if answer.placed:
            self.metrics.pods_filtered.labels("feasible" if answer.passed else "infeasible").inc()

    def _filter(self, pod: JsonObject, names: Sequence[str]) -> FilterAnswer:
        """:meth:`filter` without counting it in the metrics."""
        require_synced(self.state)
        names = self.candidates(names)
        try:
            request = parse_pod_request(pod, self.keys)
        except PodShapeError:
            raise  # no pod the API server stores: a malformed request (HTTP 400)
        except ContractError as e:
            # The pod itself is wrong: no node can take it, and kubectl describe should say why.
            return FilterAnswer(
                passed=[],
                unresolvable=dict.fromkeys(names, f"pod {ref_of(pod)}: {e}"),
                shortfalls=Counter({Shortfall.NODE: len(names)}),
                placed=False,
            )
        if not request.wants_gpu:
            return FilterAnswer(passed=list(names), placed=False)
        shape = self.shapes.shape(pod, request)
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        evaluation = self.state.evaluate(shape, names)
        # Nodes where other pods are in flight: the rule may refuse this pod there.
        inflight = self.state.nodes_with_inflight()
        answer = FilterAnswer(passed=[])
        now = self.clock()

        def vet(fit: NodeFit) -> NodeFit | None:
            """The fit to keep on an in-flight node (the cached one, or one joining the in-flight
            key), or None when the rule refuses the pod there for now (the reason is answered)."""
            kept_fit = self.state.keeping_inflight_rule(
                fit, shape, evaluation.policy, uid=uid, now=now, timeout=self.inflight_timeout
            )
            if isinstance(kept_fit, str):
                answer.failed[fit.name] = kept_fit
                answer.inflight_refused.append(fit.name)
                return None
            return kept_fit

        if self.keeps_best:
            # Only the nodes with the top score: kube-scheduler's own scores break the tie, and one
            # node left means no prioritize call and no scoring at all (one round trip less per
            # pod). Only the candidates for the top are vetted by the in-flight rule.
            kept = best_fits(evaluation.fits, vet, suspects=inflight)
        else:
            kept = evaluation.fits
            names_kept = list(map(_NAME, kept)) if inflight else []
            checked = inflight & set(names_kept)
            if checked:
                # vet(fit) on the in-flight nodes, the others kept as they are, the refused (None)
                # dropped: C-level passes over thousands of fits.
                by_name = dict(zip(names_kept, kept, strict=True))
                adjusted = {name: vet(by_name[name]) for name in sorted(checked)}
                kept = list(filter(None, map(adjusted.get, names_kept, kept)))
        answer.passed = list(map(_NAME, kept))
        if not kept:
            self._explain(answer, evaluation.rejections)
        if uid:
            # kept[i] is the fit of passed[i]: prioritize scores them without looking up names.
            remembered = Filtered(answer.passed, kept, pod, request)
            self.filtered.remember(uid, remembered)
            if len(kept) == 1:  # kube-scheduler binds without calling prioritize
                self.reserver.reserve(pod, remembered, kept[0])
        return answer

    async def filter_rechecked(self, pod: JsonObject, names: Sequence[str]) -> FilterAnswer:
        """:meth:`filter`; when no node passed and the in-flight rule refused some, their pods read
        from the API server, and the pod filtered again if any pod changed meanwhile.

        kube-scheduler retries a pod its extender refused on the next cluster event, and the event
        that frees a node (the device plugin marking the pod in flight there allocated) is often the
        one that brought the retry, ahead of this extender's watch. Refused on the watch's older view,
        the pod would wait for some unrelated event: minutes on a quiet cluster. A list is never
        older than kube-scheduler's informer (kube-apiserver serves it consistently).
        """
        answer = self._filter(pod, names)
        if (
            not answer.passed
            and answer.inflight_refused
            and self.catch_up is not None
            and await self._recheck(self.catch_up, pod, answer.inflight_refused[:RECHECKED_NODES])
        ):
            answer = self._filter(pod, names)
        self._count(answer)
        return answer

    async def _recheck(self, catch_up: CatchUp, pod: JsonObject, nodes: Sequence[str]) -> bool:
        """The pods of ``nodes`` read from the API server into the state; whether any pod's
        allocation or phase changed meanwhile (by this read, or by the watch while it waited)."""
        changes = self.state.changes.count
        try:
            async with asyncio.timeout(RECHECK_TIMEOUT):
                listed = await asyncio.gather(*map(catch_up.node_pods, nodes))
        except (ApiError, TimeoutError) as e:
            log.info("filter of pod %s: cannot read the pods of %s: %s", ref_of(pod), ", ".join(nodes), e)
            self.metrics.filter_rechecks.labels("failed").inc()
            return False
        for node_pods in listed:
            catch_up.apply(node_pods)
        changed = self.state.changes.count != changes
        self.metrics.filter_rechecks.labels("changed" if changed else "unchanged").inc()
        return changed

    def _explain(self, answer: FilterAnswer, rejections: list[NodeRejection]) -> None:
        """Every node's reason, for a pod no node can take now: kube-scheduler puts them in the
        FailedScheduling event (``kubectl describe pod``). When some node passes it drops them, so
        they are not made then (thousands of entries at thousands of nodes: a third of the cost of
        answering a pod that may run on one GPU model only)."""
        kinds = answer.shortfalls
        if answer.failed:
            kinds[Shortfall.INFLIGHT] = len(answer.failed)
        if rejections:
            # C-level passes over thousands of rejections.
            hopeless = list(map(_UNRESOLVABLE, rejections))
            unresolvable = list(compress(rejections, hopeless))
            failed = list(compress(rejections, map(not_, hopeless)))
            answer.unresolvable.update(zip(map(_NODE, unresolvable), map(_REASON, unresolvable), strict=True))
            answer.failed.update(zip(map(_NODE, failed), map(_REASON, failed), strict=True))
            kinds.update(map(_SHORTFALL, rejections))

    def prioritize(self, pod: JsonObject, names: Sequence[str]) -> list[int]:
        """The score of each of ``names``, in their order (see :meth:`candidates` for the names
        worth scoring)."""
        require_synced(self.state)
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        remembered = self.filtered.get(uid)
        if remembered is not None and remembered.passed == names:
            # The usual call: the survivors of this pod's filter, in the same order. The best of
            # them is where kube-scheduler will most likely bind the pod: reserve it there.
            scores = score_fits(remembered.kept)
            if scores:
                self.reserver.reserve(pod, remembered, remembered.kept[scores.index(max(scores))])
            return scores
        try:
            request = parse_pod_request(pod, self.keys)
        except PodShapeError:
            raise
        except ContractError:
            return [0] * len(names)
        if not request.wants_gpu:
            return [0] * len(names)
        fits = self.state.evaluate(self.shapes.shape(pod, request), names).fits
        by_name = dict(zip((f.name for f in fits), score_fits(fits), strict=True))
        return [by_name.get(n, 0) for n in names]
