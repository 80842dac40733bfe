"""Speed profiles, scores 0..10 and the speed-aware choice (the docs/placement.md example)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.contract import ContractError, Policy
from tessera.placement import (
    POLICIES,
    ClusterContext,
    NodeFit,
    SpeedProfiles,
    best_fits,
    choose,
    filter_node,
    score_nodes,
)
from tests.placement.helpers import node, shape

REPO = Path(__file__).resolve().parents[2]


def test_shipped_profiles_parse_and_match_nvml_names() -> None:
    profiles = SpeedProfiles.from_yaml((REPO / "deploy" / "speed-profiles.yaml").read_text())
    assert profiles.speed("Tesla V100-SXM2-16GB") == 1.0
    assert profiles.speed("NVIDIA A100-SXM4-40GB") == 2.0
    assert profiles.speed("NVIDIA A10") == 1.0
    assert profiles.speed("NVIDIA H100 80GB HBM3") == 3.5
    assert profiles.speed("NVIDIA L4") == 0.8
    assert profiles.speed("NVIDIA L40S") == 1.0  # no entry: default_speed
    assert profiles.speed("Tesla T4", "llm-training") == 0.25
    assert profiles.speed("Tesla V100-SXM2-16GB", "llm-training") == 1.0  # falls back to models
    # The key that matched: the DRA driver's model attribute (docs/dra.md).
    assert profiles.model_key("NVIDIA A100-SXM4-40GB") == "A100"
    assert profiles.model_key("NVIDIA A10") == "A10"
    assert profiles.model_key("NVIDIA L40S") is None


def test_gain_is_workload_speed_over_general_speed() -> None:
    profiles = SpeedProfiles.from_yaml((REPO / "deploy" / "speed-profiles.yaml").read_text())
    assert profiles.gain("NVIDIA A100-SXM4-40GB", "llm-training") == pytest.approx(1.3)
    assert profiles.gain("Tesla T4", "inference") == pytest.approx(2.0)
    assert profiles.gain("Tesla T4", None) == 1.0
    assert profiles.gain("Tesla T4", "unknown-class") == 1.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models: {T4: fast}", "speed profiles: models.T4: 'fast' is not a positive number"),
        ("models: {T4: 0}", "speed profiles: models.T4: 0 is not a positive number"),
        ("models: [T4]", "speed profiles: models: expected a mapping of model to speed, got ['T4']"),
        ("workloads: {x: {A100: -1}}", "speed profiles: workloads.x.A100: -1 is not a positive number"),
        ("default_speed: no", "speed profiles: default_speed: False is not a positive number"),
        ("modles: {}", "speed profiles: unknown keys ['modles']"),
        ("[1, 2]", "speed profiles: expected a mapping at the top, got list"),
    ],
)
def test_bad_profiles_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ContractError) as e:
        SpeedProfiles.from_yaml(text)
    assert str(e.value) == message


PROFILES = SpeedProfiles.from_mapping(
    {
        "models": {"T4": 0.4, "V100": 1.0, "A100": 2.0},
        "workloads": {"llm-training": {"T4": 0.25, "A100": 2.6}, "inference": {"T4": 0.8, "A100": 1.3}},
    }
)
CLUSTER = [
    node("t4", model="Tesla T4", memory_mib=15360),
    node("v100", model="Tesla V100-SXM2-16GB"),
    node("a100", model="NVIDIA A100-SXM4-40GB", memory_mib=40960),
]


def fits_for(workload: str | None) -> list[NodeFit]:
    s = shape((1, 4096, 20), workload=workload)
    outcomes = [filter_node(n, s, PROFILES, POLICIES[Policy.BINPACK], ClusterContext()) for n in CLUSTER]
    return [o for o in outcomes if isinstance(o, NodeFit)]


def test_training_goes_to_the_fastest_inference_to_the_slowest() -> None:
    training = fits_for("llm-training")
    # gains 0.625, 1.0, 1.3 -> speed terms 0, 3.9, 7 (of 7), plus 3 x the binpack score.
    assert score_nodes(training) == {"t4": 1, "v100": 4, "a100": 7}
    assert choose(training).name == "a100"  # type: ignore[union-attr]
    inference = fits_for("inference")
    assert choose(inference).name == "t4"  # type: ignore[union-attr]


def test_without_a_workload_class_only_the_policy_scores() -> None:
    plain = fits_for(None)
    # binpack: 4 GiB fills a 15 GiB T4 most, a 40 GiB A100 least.
    assert (
        score_nodes(plain)
        == {f.name: round(10 * f.policy_score) for f in plain}
        == {
            "t4": 2,
            "v100": 2,
            "a100": 1,
        }
    )


def test_choose_breaks_ties_by_policy_score_then_name() -> None:
    assert choose(fits_for(None)).name == "t4"  # type: ignore[union-attr]
    same = [node("b"), node("a")]
    s = shape((1, 1024, None))
    fits = [filter_node(n, s, PROFILES, POLICIES[Policy.BINPACK], ClusterContext()) for n in same]
    assert choose([f for f in fits if isinstance(f, NodeFit)]).name == "a"  # type: ignore[union-attr]
    assert choose([]) is None
    assert score_nodes([]) == {}


def test_best_fits_are_every_fit_with_the_top_score() -> None:
    training = fits_for("llm-training")
    assert [f.name for f in best_fits(training)] == ["a100"]
    assert [f.name for f in best_fits(fits_for(None))] == ["t4", "v100"]  # a tie at 2
    assert best_fits([]) == []


def test_best_fits_vets_only_candidates_for_the_top() -> None:
    training = fits_for("llm-training")  # scores t4 1, v100 4, a100 7
    asked: list[str] = []

    def refuse_a100(fit: NodeFit) -> NodeFit | None:
        asked.append(fit.name)
        return None if fit.name == "a100" else fit

    assert [f.name for f in best_fits(training, refuse_a100)] == ["v100"]
    assert asked == ["a100", "v100"]  # the T4, below both, is never vetted
    assert best_fits(training, lambda fit: None) == []
    asked.clear()
    assert [f.name for f in best_fits(training, refuse_a100, suspects={"a100", "t4"})] == ["v100"]
    assert asked == ["a100"]  # only suspects are vetted
    assert [f.name for f in best_fits(training, refuse_a100, suspects=set())] == ["a100"]


def test_best_fits_scores_a_replacement_on_the_same_scale() -> None:
    training = {f.name: f for f in fits_for("llm-training")}  # scores t4 1, v100 4, a100 7
    # The A100's fit replaced by one with the T4's gain (and policy score): it scores 1, below the
    # V100's 4, so the V100 is the best; replaced by the V100's own fit's twin it ties at 4.
    slower = NodeFit(training["a100"].node, training["a100"].placement, training["t4"].policy_score, 0.625)
    by_name = {"a100": slower}
    assert [f.name for f in best_fits(list(training.values()), lambda f: by_name.get(f.name, f))] == ["v100"]
    twin = NodeFit(training["a100"].node, training["a100"].placement, training["v100"].policy_score, 1.0)
    by_name = {"a100": twin}
    assert [f.name for f in best_fits(list(training.values()), lambda f: by_name.get(f.name, f))] == [
        "v100",
        "a100",
    ]
