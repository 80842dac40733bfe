"""The usage experiment: usage-aware placement of best-effort pods against placement by requests,
with the node agent's evictions and the guaranteed promise checked over time."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from simulator.model import Cluster, SimNode, SimPod, Workload
from simulator.usage import UsageOptions, UseRatio, run_usage
from tessera.cli import main


def cluster(nodes: int = 4) -> Cluster:
    return Cluster(tuple(SimNode(f"n{i}", "T4", 2, 15360, 64000, 262144) for i in range(nodes)))


def workload(count: int = 200, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return Workload(
        tuple(
            SimPod(f"p{i:03d}", 1000, 2048, 1, rng.choice([100, 200, 250, 400, 500, 1000]))
            for i in range(count)
        )
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gamma:1,2", "'gamma' is not beta, uniform or fixed"),
        ("beta:1", "beta takes 2 number(s)"),
        ("beta:0,1", "must be above 0"),
        ("uniform:0.5,0.2", "low end is above the high end"),
        ("fixed:1.5", "within 0..1"),
        ("fixed:x", "'x' are not numbers"),
    ],
)
def test_a_bad_use_ratio_names_the_value(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"use ratio {text!r}") as error:
        UseRatio.parse(text)
    assert message in str(error.value)


@pytest.mark.parametrize("text", ["beta:2,3", "uniform:0.1,0.9", "fixed:0.3"])
def test_use_ratios_stay_within_the_request(text: str) -> None:
    ratio = UseRatio.parse(text)
    rng = random.Random(1)
    assert all(0 <= ratio.draw(rng) <= 1 for _ in range(1000))
    assert str(ratio) == text


@pytest.mark.parametrize(
    ("seed", "ratio", "burst"),
    [
        (seed, ratio, burst)
        for seed in (1, 2, 3)
        for ratio in ("beta:2,3", "uniform:0.2,1", "beta:5,2")
        for burst in (0.0, 0.2)
    ],
)
def test_guaranteed_pods_never_lack_their_memory_and_the_counts_add_up(
    seed: int, ratio: str, burst: float
) -> None:
    options = UsageOptions(
        seed=seed, inflation=2.0, best_effort_share=0.5, use_ratio=UseRatio.parse(ratio), burst=burst,
        arrivals_per_measurement=5, settle_measurements=30,
    )  # fmt: skip
    by_requests, usage_aware = run_usage(cluster(), workload(seed=seed), options)
    for result in (by_requests, usage_aware):
        assert result.guaranteed_failures == 0
        assert result.running == result.placed - result.evicted
        assert result.running_best_effort == result.placed_best_effort - result.evicted
        assert result.running_guaranteed + result.running_best_effort <= result.running
    assert (by_requests.placed_against_use, by_requests.evicted) == (0, 0)
    assert usage_aware.evicted <= usage_aware.placed_against_use


def test_usage_aware_placement_runs_more_pods_when_pods_use_little() -> None:
    options = UsageOptions(
        seed=5, inflation=2.0, best_effort_share=0.5, use_ratio=UseRatio.parse("fixed:0.2"), burst=0.0,
        arrivals_per_measurement=5, settle_measurements=10,
    )  # fmt: skip
    by_requests, usage_aware = run_usage(cluster(), workload(seed=5), options)
    assert usage_aware.placed_against_use > 0
    assert usage_aware.evicted == 0  # nobody's use grows
    assert usage_aware.running > by_requests.running


def test_guaranteed_growth_evicts_borrowers_and_nothing_else() -> None:
    """Guaranteed pods measured at a fifth of their request while borrowers arrive, then each at its
    whole request now and then: the node agent evicts borrowers, never a guaranteed pod."""
    options = UsageOptions(
        seed=9, inflation=2.0, best_effort_share=0.5, use_ratio=UseRatio.parse("fixed:0.2"), burst=0.3,
        arrivals_per_measurement=5, settle_measurements=50,
    )  # fmt: skip
    _, usage_aware = run_usage(cluster(), workload(seed=9), options)
    assert usage_aware.evicted > 0
    assert usage_aware.guaranteed_failures == 0
    assert usage_aware.running == usage_aware.placed - usage_aware.evicted


def test_the_command_runs_the_usage_experiment_and_writes_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},64000,262144,2,T4\n" for i in range(4))
    )
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        + "".join(f"p{i},1000,2048,1,{(i % 4 + 1) * 200}\n" for i in range(80))
    )
    out = tmp_path / "out"
    code = main(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--experiment", "usage",
                 "--use-ratio", "fixed:0.2", "--burst", "0", "--best-effort-share", "0.5",
                 "--inflation", "2", "--settle-measurements", "3", "--out", str(out)])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "usage-aware placement runs +" in text
    assert "guaranteed failures: 0 by requests, 0 usage-aware" in text
    report = json.loads((out / "usage.json").read_text())
    assert report["options"]["use_ratio"] == "fixed:0.2"
    by_requests, usage_aware = report["placements"]
    assert (by_requests["placement"], usage_aware["placement"]) == ("by requests", "usage-aware")
    assert usage_aware["running"] > by_requests["running"]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--use-ratio", "beta:2", "use ratio 'beta:2': beta takes 2 number(s)"),
        ("--best-effort-share", "1.5", "'1.5' must be within 0..1"),
        ("--burst", "often", "'often' is not a number"),
    ],
)
def test_bad_usage_options_are_refused_naming_the_value(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--experiment", "usage", flag, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_margin_is_refused_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--experiment", "usage", "--margin-mib", "-1"]) == 2
    assert "margin_mib: -1 is negative" in capsys.readouterr().err
