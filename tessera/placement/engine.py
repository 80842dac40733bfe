"""The cluster as the placement core sees it, with cached per-node outcomes.

:class:`PlacementEngine` keeps the newest :class:`NodeState` per node name and remembers, per pod
shape and policy, each node's outcome together with the state it was computed from. States are
immutable, so ``cached_state is current_state`` proves the outcome still holds; a placement or an
inventory change replaces one node's state and invalidates only that node. A request over 5,000
nodes therefore recomputes the few nodes changed since the last pod of the same shape and looks
the rest up.

Used by the extender (nodes from the Kubernetes API) and the simulator (nodes from a trace)::

    engine = PlacementEngine(profiles)
    engine.set_node(node)                       # for every node
    evaluation = engine.evaluate(shape)         # or engine.evaluate(shape, names)
    best = choose(evaluation.fits)              # or score_nodes(evaluation.fits)
    if best is not None:
        engine.commit(best, shape)              # apply + record the shape in the context
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tessera.placement.fit import filter_node
from tessera.placement.model import (
    NodeFit,
    NodeOutcome,
    NodeRejection,
    NodeState,
    PodShape,
    Shortfall,
    apply,
)
from tessera.placement.policies import ClusterContext, PlacementPolicy, get_policy
from tessera.placement.speed import SpeedProfiles

# Distinct (shape, policy, context version) keys whose outcomes are kept.
CACHED_SHAPES = 256

UNKNOWN_NODE = "no GPU inventory from the Tessera device plugin on this node"


@dataclass(slots=True)
class Evaluation:
    """The outcome of one pod shape on a set of nodes."""

    shape: PodShape
    policy: PlacementPolicy
    fits: list[NodeFit] = field(default_factory=list)
    rejections: list[NodeRejection] = field(default_factory=list)

    def fit_on(self, name: str) -> NodeFit | None:
        return next((f for f in self.fits if f.name == name), None)


_CacheKey = tuple[PodShape, str, int]


class PlacementEngine:
    def __init__(
        self,
        profiles: SpeedProfiles,
        default_policy: str = "binpack",
        context: ClusterContext | None = None,
    ) -> None:
        self.profiles = profiles
        self.default_policy = get_policy(default_policy)
        self.context = context or ClusterContext()
        self.nodes: dict[str, NodeState] = {}
        self._outcomes: OrderedDict[_CacheKey, dict[str, tuple[NodeState, NodeOutcome]]] = OrderedDict()

    def set_node(self, node: NodeState) -> None:
        self.nodes[node.name] = node

    def remove_node(self, name: str) -> None:
        self.nodes.pop(name, None)

    def policy_for(self, shape: PodShape) -> PlacementPolicy:
        """The pod's own policy (annotation) if it names one, else the engine's default."""
        wanted = shape.preferences.policy
        return self.default_policy if wanted is None else get_policy(wanted.value)

    def _cache_for(
        self, shape: PodShape, policy: PlacementPolicy
    ) -> dict[str, tuple[NodeState, NodeOutcome]]:
        key = (shape, policy.name, self.context.version if policy.uses_context else -1)
        cache = self._outcomes.get(key)
        if cache is None:
            cache = self._outcomes[key] = {}
            if len(self._outcomes) > CACHED_SHAPES:
                self._outcomes.popitem(last=False)
        else:
            self._outcomes.move_to_end(key)
        return cache

    def evaluate(self, shape: PodShape, names: Iterable[str] | None = None) -> Evaluation:
        """Outcomes of ``shape`` on the named nodes (all nodes if None); names the engine does not
        know are rejected as having no inventory."""
        policy = self.policy_for(shape)
        cache = self._cache_for(shape, policy)
        evaluation = Evaluation(shape, policy)
        fits = evaluation.fits
        rejections = evaluation.rejections
        nodes = self.nodes
        profiles = self.profiles
        context = self.context
        for name in self.nodes if names is None else names:
            node = nodes.get(name)
            if node is None:
                rejections.append(NodeRejection(name, UNKNOWN_NODE, Shortfall.NODE))
                continue
            cached = cache.get(name)
            if cached is not None and cached[0] is node:
                outcome = cached[1]
            else:
                outcome = filter_node(node, shape, profiles, policy, context)
                cache[name] = (node, outcome)
            if type(outcome) is NodeFit:
                fits.append(outcome)
            else:
                rejections.append(outcome)  # type: ignore[arg-type]
        return evaluation

    def commit(self, fit: NodeFit, shape: PodShape) -> NodeState:
        """Make ``fit``'s placement: the node's new state is stored and returned, and the shape joins
        the context's recent mix."""
        node = apply(self.nodes[fit.name], fit.placement, shape)
        self.nodes[node.name] = node
        self.context.shape_mix.record(shape)
        return node
