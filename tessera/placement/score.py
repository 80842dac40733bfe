"""Scores 0..10 for the nodes a pod fits on, and the choice among them.

score = round(10 * (SPEED_WEIGHT * speed + (1 - SPEED_WEIGHT) * policy)) where ``policy`` is the
policy's 0..1 score of the node's placement and ``speed`` ranks the pod's gain on the GPUs chosen
there (see :mod:`.speed`) between the lowest (0) and highest (1) gain among the nodes scored
together. When every node offers the same gain (no workload profile, or one GPU model everywhere),
the score is the policy's alone. The speed term dominates, so a pod that profits from fast GPUs more
than the average workload goes to them first, and one that profits less stays on slower GPUs while
they fit (heterogeneity-aware placement in the manner of Gavel, OSDI '20).

A best-effort pod is placed against measured use only where it fits by requests nowhere
(:mod:`.usage`): when some of the fits scored together are by requests, those score as above but at
least 1, on the scale of the fits by requests alone, and the fits against measured use score 0, so
neither :func:`best_fits` nor :func:`choose` ever prefers one. Fits against measured use scored among
themselves score by the headroom they leave (:func:`tessera.placement.fit.use_score`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from itertools import compress, repeat
from operator import add, attrgetter, itemgetter, sub

from tessera.placement.model import MAX_SCORE, NodeFit

SPEED_WEIGHT = 0.7
# Gains closer than this count as equal (float noise from dividing speeds).
_GAIN_EPSILON = 1e-9
_GAIN = attrgetter("gain")
_POLICY_SHARE = attrgetter("policy_share")
_POLICY_POINTS = attrgetter("policy_points")
_OVERSUBSCRIBED = attrgetter("oversubscribed")

# (lowest gain, points per unit of gain, points per unit of policy share), or None: see _scale.
_Scale = tuple[float, float, float] | None


def _scale(fits: Sequence[NodeFit]) -> _Scale:
    """(lowest gain, points per unit of gain, points per unit of policy share) of fits scored
    together; None when every fit offers the same gain (the score is then the policy's alone)."""
    gains = list(map(_GAIN, fits))  # attrgetter and map: C-level loops over thousands of fits
    low = min(gains)
    spread = max(gains) - low
    if spread < _GAIN_EPSILON:
        return None
    return low, MAX_SCORE * SPEED_WEIGHT / spread, MAX_SCORE * (1 - SPEED_WEIGHT)


def score_fits(fits: Sequence[NodeFit]) -> list[int]:
    """kube-scheduler scores (0..10) of the fits of one pod, scored together, in their order."""
    return _scored(fits)[1] if fits else []


def _scored(fits: Sequence[NodeFit]) -> tuple[_Scale, list[int], bool]:
    """The scale, the scores of ``fits`` (not empty) and whether they mix fits by requests and
    against measured use (see the module's notes)."""
    over = list(map(_OVERSUBSCRIBED, fits))
    if not any(over) or all(over):
        scale = _scale(fits)
        return scale, _scores(fits, scale), False
    by_requests = [fit for fit, o in zip(fits, over, strict=True) if not o]
    scale = _scale(by_requests)
    points = iter(_scores(by_requests, scale))
    return scale, [0 if o else max(1, next(points)) for o in over], True


def _scores(fits: Sequence[NodeFit], scale: _Scale) -> list[int]:
    if scale is None:
        return list(map(_POLICY_POINTS, fits))
    low, speed, policy = scale
    # round(speed * (gain - low) + policy * share) per fit, as C-level passes (map over builtin
    # methods: no Python frame per fit, about 3x faster over thousands of fits).
    lifts = map(speed.__mul__, map(sub, map(_GAIN, fits), repeat(low)))
    return list(map(round, map(add, lifts, map(policy.__mul__, map(_POLICY_SHARE, fits)))))


def best_fits(
    fits: Sequence[NodeFit],
    vet: Callable[[NodeFit], NodeFit | None] | None = None,
    suspects: AbstractSet[str] | None = None,
) -> list[NodeFit]:
    """The fits with the top score of :func:`score_fits`: all that kube-scheduler could prefer on
    the extender's score alone, for its own scores to choose among.

    ``vet`` (the in-flight rule) may drop a fit (None) or put another fit on the same node in its
    place; it is called only on fits that could still reach the top, from the highest score down,
    and only on those of nodes in ``suspects`` when given (the nodes with pods in flight), so a
    request over thousands of nodes vets a handful. A replacement is scored on the same scale as
    the others.
    """
    if not fits:
        return []
    scale, scores, mixed = _scored(fits)
    if vet is None or (suspects is not None and not suspects):
        top = max(scores)
        return list(compress(fits, map(top.__eq__, scores)))
    vetted: dict[int, list[tuple[int, NodeFit]]] = {}  # by score: (position in fits, fit kept)
    for level in sorted(set(scores), reverse=True):
        for i in compress(range(len(fits)), map(level.__eq__, scores)):
            fit = fits[i]
            kept = fit if suspects is not None and fit.name not in suspects else vet(fit)
            if kept is not None:
                score = level if kept is fit else _score_one(kept, scale, mixed)
                vetted.setdefault(score, []).append((i, kept))
        # Every fit scoring above ``level`` is vetted: the best vetted score at or above it is final.
        best = max(vetted, default=-1)
        if best >= level:
            return [fit for _, fit in sorted(vetted[best], key=itemgetter(0))]
    return []


def _score_one(fit: NodeFit, scale: _Scale, mixed: bool) -> int:
    """``fit``'s score on another set's scale, kept within 0..MAX_SCORE (its gain may lie outside
    that set's range); ``mixed``: that set mixes fits by requests and against measured use."""
    if mixed and fit.oversubscribed:
        return 0
    return min(MAX_SCORE, max(1 if mixed else 0, _scores([fit], scale)[0]))


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
