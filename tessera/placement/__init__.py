"""The placement core: pure functions over plain data deciding where GPU pods go.

No I/O here. The extender (kube-scheduler adapter) and the simulator call the same functions:

* :mod:`.model`: ``GpuState``, ``NodeState``, ``PodShape``, ``Placement``, ``NodeFit``/``NodeRejection``;
  ``build_node`` (from the inventory annotation and allocations), ``apply``/``release``,
  ``to_allocation``/``placement_of`` (to and from the contract's allocation annotation).
* :mod:`.fit`: ``filter_node`` (fit, GPU choice, reason for a rejection).
* :mod:`.policies`: the policy interface, ``binpack``/``spread``, the registry.
* :mod:`.speed`: speed profiles and a workload's gain per GPU model.
* :mod:`.score`: ``score_nodes`` (0..10) and ``choose``.
* :mod:`.engine`: ``PlacementEngine``, the cluster with per-node outcome caches.
* :mod:`.inflight`: the in-flight rule checked at bind.
"""

from tessera.placement.engine import Evaluation, PlacementEngine
from tessera.placement.fit import filter_node, find_placement
from tessera.placement.inflight import container_key, inflight_conflict
from tessera.placement.model import (
    ContainerShape,
    GpuState,
    Grant,
    NodeFit,
    NodeOutcome,
    NodeRejection,
    NodeState,
    Placement,
    PodShape,
    ShapeMix,
    Shortfall,
    apply,
    build_node,
    placement_of,
    release,
    shape_of,
    to_allocation,
)
from tessera.placement.policies import (
    ClusterContext,
    PlacementPolicy,
    get_policy,
    policy_names,
    register_policy,
)
from tessera.placement.score import choose, score_fits, score_nodes
from tessera.placement.speed import SpeedProfiles

__all__ = [
    "ClusterContext",
    "ContainerShape",
    "Evaluation",
    "GpuState",
    "Grant",
    "NodeFit",
    "NodeOutcome",
    "NodeRejection",
    "NodeState",
    "Placement",
    "PlacementEngine",
    "PlacementPolicy",
    "PodShape",
    "ShapeMix",
    "Shortfall",
    "SpeedProfiles",
    "apply",
    "build_node",
    "choose",
    "container_key",
    "filter_node",
    "find_placement",
    "get_policy",
    "inflight_conflict",
    "placement_of",
    "policy_names",
    "register_policy",
    "release",
    "score_fits",
    "score_nodes",
    "shape_of",
    "to_allocation",
]
