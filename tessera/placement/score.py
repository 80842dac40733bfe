"""Scores 0..10 for the nodes a pod fits on, and the choice among them.

score = round(10 * (SPEED_WEIGHT * speed + (1 - SPEED_WEIGHT) * policy)) where ``policy`` is the
policy's 0..1 score of the node's placement and ``speed`` ranks the pod's gain on the GPUs chosen
there (see :mod:`.speed`) between the lowest (0) and highest (1) gain among the nodes scored
together. When every node offers the same gain (no workload profile, or one GPU model everywhere),
the score is the policy's alone. The speed term dominates, so a pod that profits from fast GPUs more
than the average workload goes to them first, and one that profits less stays on slower GPUs while
they fit (heterogeneity-aware placement in the manner of Gavel, OSDI '20).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from tessera.placement.model import MAX_SCORE, NodeFit

SPEED_WEIGHT = 0.7
# Gains closer than this count as equal (float noise from dividing speeds).
_GAIN_EPSILON = 1e-9
_GAIN = attrgetter("gain")
_POLICY_SHARE = attrgetter("policy_share")
_POLICY_POINTS = attrgetter("policy_points")


def score_fits(fits: Sequence[NodeFit]) -> list[int]:
    """kube-scheduler scores (0..10) of the fits of one pod, scored together, in their order."""
    if not fits:
        return []
    # attrgetter and map: C-level loops, for the thousands of fits of one extender request.
    gains = list(map(_GAIN, fits))
    low = min(gains)
    spread = max(gains) - low
    if spread < _GAIN_EPSILON:
        return list(map(_POLICY_POINTS, fits))
    speed = MAX_SCORE * SPEED_WEIGHT / spread
    policy = MAX_SCORE * (1 - SPEED_WEIGHT)
    return [
        round(speed * (gain - low) + policy * share)
        for gain, share in zip(gains, map(_POLICY_SHARE, fits), strict=True)
    ]


def score_nodes(fits: Sequence[NodeFit]) -> dict[str, int]:
    """:func:`score_fits` by node name."""
    return dict(zip((f.name for f in fits), score_fits(fits), strict=True))


def choose(fits: Sequence[NodeFit], scores: dict[str, int] | None = None) -> NodeFit | None:
    """The fit with the highest score; ties go to the higher gain, then policy score, then the
    alphabetically first name (so that simulations repeat exactly)."""
    if not fits:
        return None
    scores = score_nodes(fits) if scores is None else scores
    top = max(scores.values())
    return min(
        (f for f in fits if scores[f.name] == top),
        key=lambda f: (-f.gain, -f.policy_score, f.name),
    )
