"""`tessera simulate` end to end: the default run, its files, and clear errors for bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tessera.cli import main

POLICIES = ("exclusive", "gpushare", "hami", "binpack", "spread", "fragmentation", "speed-aware")


def test_no_arguments_runs_the_embedded_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["simulate"]) == 0
    out = capsys.readouterr().out
    assert "Input: embedded default" in out
    assert "Packing (FGD paper)" in out and "Time:" in out
    for policy in POLICIES:
        rows = [line for line in out.splitlines() if re.match(rf"{re.escape(policy)}\s{{2,}}\S", line)]
        assert len(rows) == 2  # one row in each table
    assert "fragmentation leaves" in out and "speed-aware cuts mean JCT" in out
    folder = tmp_path / "tessera-simulate-report"
    report = json.loads((folder / "report.json").read_text())
    assert [p["policy"] for p in report["policies"]] == list(POLICIES)
    assert all(p["time"]["finished"] == report["pods"] for p in report["policies"])
    for png in ("packing.png", "time.png"):
        assert (folder / png).read_bytes().startswith(b"\x89PNG")


def test_packing_only_on_trace_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},32000,131072,4,T4\n" for i in range(4))
    )
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        + "".join(f"p{i},2000,4096,1,{(i % 4 + 1) * 250}\n" for i in range(40))
    )
    out_dir = tmp_path / "out"
    code = main(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policies", "binpack,fragmentation",
                 "--out", str(out_dir), "--jobs", "1"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "the pods have no durations; running the packing experiment only" in out
    assert "Time:" not in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["packing.png", "report.json"]


def test_bad_input_is_reported_with_file_line_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,lots,1,1,T4\n")
    assert main(["simulate", "--nodes", str(nodes), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{nodes}:2:4: column 'cpu_milli': 'lots' is not a number" in err
    assert "Traceback" not in err


def test_time_experiment_needs_durations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n  - {name: p, cpu_milli: 1, memory_mib: 1}\n")
    assert main(["simulate", "--pods", str(pods), "--experiment", "time", "--out", str(tmp_path)]) == 2
    assert "the time experiment needs them" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--policies", "binpack,best", "unknown policy 'best'"),
        ("--colocation", "1.5", "must be at most 1"),
        ("--jobs", "0", "must be at least 1"),
        ("--inflation", "-1", "must be more than 0"),
    ],
)
def test_bad_options_are_refused(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", flag, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
