"""The placement core: pure functions over plain data deciding where GPU pods go.

No I/O here. The extender (kube-scheduler adapter) and the simulator call the same functions:

* :mod:`.model`: ``GpuState``, ``NodeState``, ``PodShape``, ``Placement``, ``NodeFit``/``NodeRejection``;
  ``build_node`` (from the inventory annotation and allocations), ``apply``/``release``,
  ``to_allocation``/``placement_of`` (to and from the contract's allocation annotation).
* :mod:`.fit`: ``filter_node`` (fit, GPU choice, reason for a rejection).
* :mod:`.policies`: the policy interface, ``binpack``/``spread``; :mod:`.fragmentation`: FGD.
* :mod:`.speed`: speed profiles and a workload's gain per GPU model.
* :mod:`.score`: ``score_nodes`` (0..10), ``best_fits`` and ``choose``.
* :mod:`.engine`: ``PlacementEngine``, the cluster with per-node outcome caches; ``POLICIES``, the
  policy table by the contract's ``Policy``.
* :mod:`.inflight`: placing a pod so that it keeps the in-flight rule (the rule itself, shared with
  the device plugin, is :mod:`tessera.inflight`).
* :mod:`.qos`: a pod's QoS class (``qos_class``: granted by its priority or namespace, lowered by
  its annotation; ``qos_lowered``: why it did not get the class it asked for).
* :mod:`.preemption`: ``choose_victims``, the lower-priority pods to evict on a node so a pod fits.
* :mod:`.resize`: ``resize``, a placed pod's new quotas on the GPUs it has (live resize).
* :mod:`.quota`: a namespace's ResourceQuota held against a live resize (``quota_refusal``).
* :mod:`.usage`: ``UsageRule`` (the safety margin and staleness of measured use) and
  ``placed_since``, for placing best-effort pods against measured use.
"""

from tessera.placement.engine import POLICIES, Evaluation, PlacementEngine
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
from tessera.placement.policies import ClusterContext, PlacementPolicy
from tessera.placement.preemption import Preemption, Victim, budget_violations, choose_victims
from tessera.placement.qos import QosThresholds, qos_class, qos_lowered
from tessera.placement.quota import QuotaLimit, beyond_spec, quota_refusal, quota_resources
from tessera.placement.resize import ResizeRefusal, resize
from tessera.placement.score import best_fits, choose, score_fits, score_nodes
from tessera.placement.speed import SpeedProfiles
from tessera.placement.usage import UsageRule, placed_since

__all__ = [
    "POLICIES",
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
    "Preemption",
    "QosThresholds",
    "QuotaLimit",
    "ResizeRefusal",
    "ShapeMix",
    "Shortfall",
    "SpeedProfiles",
    "UsageRule",
    "Victim",
    "apply",
    "best_fits",
    "beyond_spec",
    "budget_violations",
    "build_node",
    "choose",
    "choose_victims",
    "filter_node",
    "find_placement",
    "fit_keeping_inflight_rule",
    "make_fit",
    "placed_since",
    "placement_keys",
    "placement_of",
    "qos_class",
    "qos_lowered",
    "quota_refusal",
    "quota_resources",
    "release",
    "resize",
    "score_fits",
    "score_nodes",
    "shape_of",
    "to_allocation",
]
