"""The cluster as the placement core sees it, with cached per-node outcomes.

:class:`PlacementEngine` keeps the newest :class:`NodeState` per node name and remembers, per pod
shape and policy, each node's outcome (fit or rejection). Replacing a node's state (a placement, a
release, an inventory or heartbeat change) drops that node's outcomes from every cache, and only
that node's. A request over 5,000 nodes therefore computes the few nodes changed since the last
pod of the same shape and looks the rest up, one dictionary lookup per node.

Used by the extender (nodes from the Kubernetes API) and the simulator (nodes from a trace)::

    engine = PlacementEngine(profiles)
    engine.set_node(node)                       # for every node
    evaluation = engine.evaluate(shape)         # or engine.evaluate(shape, names)
    best = choose(evaluation.fits)              # or score_nodes(evaluation.fits)
    if best is not None:
        engine.commit(shape, best)              # apply + record the shape in the context

Policies whose answers depend on the cluster context (``uses_context``) are cached per context
version, so their outcomes last only until the context changes.

:data:`POLICIES` is the product's policy table, by the contract's ``Policy``: a pod's policy
annotation is looked up there; the engine's default policy is one of them, or any policy object (the
simulator's research baselines).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import compress
from operator import is_
from types import MappingProxyType

from tessera.contract import Policy
from tessera.placement.fit import filter_node
from tessera.placement.fragmentation import Fragmentation
from tessera.placement.model import (
    NodeFit,
    NodeOutcome,
    NodeRejection,
    NodeState,
    PodShape,
    Shortfall,
    apply,
)
from tessera.placement.policies import Binpack, ClusterContext, PlacementPolicy, Spread
from tessera.placement.speed import SpeedProfiles

# Distinct (shape, policy, context version) keys whose outcomes are kept.
CACHED_SHAPES = 256
# A shape's last answer is kept when it named at least this many nodes: small requests (bind's one
# node) are cheap to look up and must not displace kube-scheduler's big one.
KEPT_ANSWER_NAMES = 64

UNKNOWN_NODE = "no GPU inventory from the Tessera device plugin on this node"

# The product's policies, one per value of the contract's Policy (the names a pod's annotation and
# the extender's --policy accept).
POLICIES: Mapping[Policy, PlacementPolicy] = MappingProxyType(
    {Policy.BINPACK: Binpack(), Policy.SPREAD: Spread(), Policy.FRAGMENTATION: Fragmentation()}
)


@dataclass(slots=True)
class Evaluation:
    """The outcome of one pod shape on a set of nodes, under ``policy`` (the pod's or the default)."""

    policy: PlacementPolicy
    fits: list[NodeFit] = field(default_factory=list)
    rejections: list[NodeRejection] = field(default_factory=list)


_CacheKey = tuple[PodShape, str, int]


@dataclass(slots=True)
class _Answer:
    """A shape's last evaluation, kept per name: kube-scheduler asks about the same names pod
    after pod, and only the nodes changed since (``stale``) need their outcome again."""

    names: list[str]
    fits: list[NodeFit | None]  # the fit of names[i], or None
    rejections: list[NodeRejection | None]  # the rejection of names[i], or None
    stale: set[str] = field(default_factory=set)
    positions: dict[str, int] | None = None  # names[i] -> i, made when first patched

    def evaluation(self, policy: PlacementPolicy) -> Evaluation:
        return Evaluation(policy, list(filter(None, self.fits)), list(filter(None, self.rejections)))


@dataclass(slots=True)
class _Outcomes:
    """One shape's cached outcomes by node name, fits and rejections apart, so that a request's
    fits and rejections are picked by C-level lookups (see :meth:`PlacementEngine.evaluate`)."""

    fits: dict[str, NodeFit] = field(default_factory=dict)
    rejections: dict[str, NodeRejection] = field(default_factory=dict)
    last: _Answer | None = None

    def forget(self, name: str) -> None:
        self.fits.pop(name, None)
        self.rejections.pop(name, None)
        if self.last is not None:
            self.last.stale.add(name)


class PlacementEngine:
    def __init__(
        self,
        profiles: SpeedProfiles,
        default_policy: Policy | PlacementPolicy = Policy.BINPACK,
        context: ClusterContext | None = None,
    ) -> None:
        """``default_policy`` places pods that name none: one of :data:`POLICIES`, or a policy
        object of the caller's (the simulator's baselines)."""
        self.profiles = profiles
        if not isinstance(default_policy, PlacementPolicy):
            default_policy = POLICIES[Policy(default_policy)]
        self.default_policy = default_policy
        self.context = context or ClusterContext()
        self.nodes: dict[str, NodeState] = {}
        self._outcomes: OrderedDict[_CacheKey, _Outcomes] = OrderedDict()

    def set_node(self, node: NodeState) -> None:
        """Store ``node`` as the newest state of its name (its cached outcomes are dropped, unless
        it equals the state stored: the extender rebuilds a node on pod events that change nothing
        there, such as a bound pod's allocation arriving through the watch)."""
        if self.nodes.get(node.name) == node:
            return
        self.nodes[node.name] = node
        self._forget(node.name)

    def remove_node(self, name: str) -> None:
        self.nodes.pop(name, None)
        self._forget(name)

    def _forget(self, name: str) -> None:
        for outcomes in self._outcomes.values():
            outcomes.forget(name)

    def policy_for(self, shape: PodShape) -> PlacementPolicy:
        """The pod's own policy (annotation) if it names one, else the engine's default."""
        wanted = shape.preferences.policy
        return self.default_policy if wanted is None else POLICIES[wanted]

    def _cache_for(self, shape: PodShape, policy: PlacementPolicy) -> _Outcomes:
        key = (shape, policy.name, self.context.version if policy.uses_context else -1)
        cache = self._outcomes.get(key)
        if cache is None:
            cache = self._outcomes[key] = _Outcomes()
            if len(self._outcomes) > CACHED_SHAPES:
                self._outcomes.popitem(last=False)
        else:
            self._outcomes.move_to_end(key)
        return cache

    def evaluate(self, shape: PodShape, names: Iterable[str] | None = None) -> Evaluation:
        """Outcomes of ``shape`` on the named nodes (all nodes if None), in the order named; names
        the engine does not know are rejected as having no inventory."""
        policy = self.policy_for(shape)
        cache = self._cache_for(shape, policy)
        wanted = list(self.nodes) if names is None else list(names)
        last = cache.last
        if last is not None and last.names == wanted:
            if last.stale:
                self._refresh(last, cache, shape, policy)
            return last.evaluation(policy)
        # C-level passes over the names (map, compress), no Python loop per name: a fit or None
        # per name, a rejection or None per name, then the names in neither are computed.
        fits: list[NodeFit | None] = list(map(cache.fits.get, wanted))
        rejections: list[NodeRejection | None] = list(map(cache.rejections.get, wanted))
        for i in list(compress(range(len(wanted)), map(is_, fits, rejections))):  # both None
            fits[i], rejections[i] = self._computed(cache, wanted[i], shape, policy)
        answer = _Answer(wanted, fits, rejections)
        # (Names kube-scheduler sends are distinct; an answer naming one twice is not kept, since a
        # change would be patched at one of its places only.)
        if len(wanted) >= KEPT_ANSWER_NAMES and len(set(wanted)) == len(wanted):
            cache.last = answer
        return answer.evaluation(policy)

    def _refresh(self, last: _Answer, cache: _Outcomes, shape: PodShape, policy: PlacementPolicy) -> None:
        """Recompute the outcomes of ``last``'s names that changed since it was made."""
        if last.positions is None:
            last.positions = {name: i for i, name in enumerate(last.names)}
        for name in last.stale:
            i = last.positions.get(name)
            if i is None:
                continue
            last.fits[i], last.rejections[i] = self._computed(cache, name, shape, policy)
        last.stale.clear()

    def _computed(
        self, cache: _Outcomes, name: str, shape: PodShape, policy: PlacementPolicy
    ) -> tuple[NodeFit | None, NodeRejection | None]:
        """Node ``name``'s outcome, computed and cached: (its fit, None) or (None, its rejection)."""
        outcome = self._outcome(name, shape, policy)
        if isinstance(outcome, NodeFit):
            cache.fits[name] = outcome
            return outcome, None
        cache.rejections[name] = outcome
        return None, outcome

    def _outcome(self, name: str, shape: PodShape, policy: PlacementPolicy) -> NodeOutcome:
        node = self.nodes.get(name)
        if node is None:
            return NodeRejection(name, UNKNOWN_NODE, Shortfall.NODE)
        return filter_node(node, shape, self.profiles, policy, self.context)

    def commit(self, shape: PodShape, fit: NodeFit | None = None) -> None:
        """A pod of ``shape`` was placed: the shape joins the context's recent mix and, given the
        ``fit`` it was placed as, the placement is applied to its node's current state (the
        simulator). Without ``fit`` the node's state already counts the pod: the extender builds
        node states from the pods' allocations, and counted this one when it decided the bind."""
        if fit is not None:
            self.set_node(apply(self.nodes[fit.name], fit.placement, shape))
        self.context.placed(shape)
