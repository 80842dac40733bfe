"""The placement core: pure functions over plain data deciding where GPU pods go.

No I/O here. The extender (kube-scheduler adapter) and the simulator call the same functions:

* :mod:`.model`: ``GpuState``, ``NodeState``, ``PodShape``, ``Placement``, ``NodeFit``/``NodeRejection``;
  ``build_node`` (from the inventory annotation and allocations), ``apply``/``release``,
  ``to_allocation``/``placement_of`` (to and from the contract's allocation annotation).
* :mod:`.fit`: ``filter_node`` (fit, GPU choice, reason for a rejection).
* :mod:`.policies`: the policy interface, ``binpack``/``spread``, the registry.
* :mod:`.speed`: speed profiles and a workload's gain per GPU model.
* :mod:`.score`: ``score_nodes`` (0..10), ``best_fits`` and ``choose``.
* :mod:`.engine`: ``PlacementEngine``, the cluster with per-node outcome caches.
* :mod:`.inflight`: placing a pod so that it keeps the in-flight rule (the rule itself, shared with
  the device plugin, is :mod:`tessera.inflight`).
"""

# Imported for its effect: it registers the fragmentation policy (it builds on .policies, so
# .policies cannot import it).
import tessera.placement.fragmentation  # noqa: F401
from tessera.placement.engine import Evaluation, PlacementEngine
from tessera.placement.fit import filter_node, find_placement, make_fit
from tessera.placement.inflight import fit_keeping_inflight_rule, placement_keys
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
from tessera.placement.score import best_fits, choose, score_fits, score_nodes
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
    "best_fits",
    "build_node",
    "choose",
    "filter_node",
    "find_placement",
    "fit_keeping_inflight_rule",
    "get_policy",
    "make_fit",
    "placement_keys",
    "placement_of",
    "policy_names",
    "register_policy",
    "release",
    "score_fits",
    "score_nodes",
    "shape_of",
    "to_allocation",
]
