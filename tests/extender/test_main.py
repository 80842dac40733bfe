"""tessera-extender's command line refuses bad input with a message, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from extender.main import build_parser, main
from tessera.contract import Policy


def test_bad_speed_profiles_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text("models: {T4: fast}\n")
    assert main(["--speed-profiles", str(profiles)]) == 2
    assert (
        capsys.readouterr().err
        == "tessera-extender: speed profiles: models.T4: 'fast' is not a positive number\n"
    )


def test_unreadable_kubeconfig(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "kubeconfig"
    empty.write_text("")
    assert main(["--kubeconfig", str(empty)]) == 2
    assert capsys.readouterr().err.startswith(
        "tessera-extender: cannot load the Kubernetes client configuration:"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "8888"], "argument --listen: '8888' is not HOST:PORT"),
        (["--heartbeat-timeout", "0"], "argument --heartbeat-timeout: '0' must be more than 0 seconds"),
        (["--policy", "random"], "argument --policy: invalid choice: 'random'"),
        (["--max-body-bytes", "0"], "argument --max-body-bytes: '0' must be at least 1"),
        (["--max-connections", "-1"], "argument --max-connections: '-1' must be at least 1"),
        (["--max-header-bytes", "lots"], "argument --max-header-bytes: 'lots' is not an integer"),
        (
            ["--qos-best-effort-priority", "high"],
            "argument --qos-best-effort-priority: invalid int value: 'high'",
        ),
        (
            ["--qos-latency-critical-priority", "0"],
            "the best-effort priority (0) must be below the latency-critical priority (0), or no priority "
            "is standard",
        ),
    ],
)
def test_bad_flags(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_policy_flag_takes_exactly_the_contracts_policies(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert [parser.parse_args(["--policy", p.value]).policy for p in Policy] == [p.value for p in Policy]
    # A research baseline of the simulator is not a product policy.
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--policy", "fgd-paper"])
    assert exit_.value.code == 2
    assert (
        "argument --policy: invalid choice: 'fgd-paper' (choose from 'binpack', 'spread', 'fragmentation')"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("lease", ["tessera-scheduler", "tessera-system/", "/tessera-scheduler"])
def test_a_leader_lease_needs_a_namespace_a_name_and_the_pod(
    lease: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_NAME", "tessera-scheduler-0")
    assert main(["--leader-lease", lease]) == 2
    assert capsys.readouterr().err == (
        f"tessera-extender: --leader-lease {lease!r} must be NAMESPACE/NAME, and --pod-name (or env "
        "POD_NAME) must be set with it\n"
    )


def test_a_leader_lease_without_the_pod_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    assert main(["--leader-lease", "tessera-system/tessera-scheduler"]) == 2
    assert "--pod-name (or env POD_NAME) must be set with it" in capsys.readouterr().err
