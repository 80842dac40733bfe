"""The deploy/ manifests the extender ships: parseable and consistent with each other."""

from __future__ import annotations

from pathlib import Path

import yaml

from tessera.contract import KEYS
from tessera.placement import SpeedProfiles

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_configmap_carries_the_speed_profiles_file() -> None:
    documents = list(yaml.safe_load_all((DEPLOY / "extender.yaml").read_text()))
    [configmap] = [d for d in documents if d["kind"] == "ConfigMap"]
    shipped = (DEPLOY / "speed-profiles.yaml").read_text()
    assert yaml.safe_load(configmap["data"]["speed-profiles.yaml"]) == yaml.safe_load(shipped)
    assert SpeedProfiles.from_yaml(configmap["data"]["speed-profiles.yaml"]).models["A100"] == 2.0


def test_scheduler_config_manages_the_contract_resources() -> None:
    config = yaml.safe_load((DEPLOY / "scheduler-config.yaml").read_text())
    assert [p["schedulerName"] for p in config["profiles"]] == ["default-scheduler", "tessera-scheduler"]
    [extender] = config["extenders"]
    assert extender["nodeCacheCapable"] is True
    managed = {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]}
    assert managed == {KEYS.vgpu: False, KEYS.vgpu_memory: True, KEYS.vgpu_cores: True}
    assert (extender["filterVerb"], extender["preemptVerb"], extender["bindVerb"]) == (
        "filter",
        "preempt",
        "bind",
    )
    # The extender's filter answers only its best nodes (its default): a prioritize call would add a
    # round trip per pod and nothing to rank.
    assert "prioritizeVerb" not in extender


def test_deployment_runs_the_extender_with_the_profiles() -> None:
    documents = list(yaml.safe_load_all((DEPLOY / "extender.yaml").read_text()))
    [deployment] = [d for d in documents if d["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["tessera-extender"]
    assert "--speed-profiles=/etc/tessera/speed-profiles.yaml" in container["args"]
    rules = next(d for d in documents if d["kind"] == "ClusterRole")["rules"]
    assert {"resources": ["pods/binding"], "verbs": ["create"], "apiGroups": [""]} in rules
    # Preempt weighs PodDisruptionBudgets as kube-scheduler does.
    assert {"resources": ["poddisruptionbudgets"], "verbs": ["list"], "apiGroups": ["policy"]} in rules
