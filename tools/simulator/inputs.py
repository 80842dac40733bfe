"""Choosing and loading the inputs of a run: trace CSV, the project's YAML, or the embedded default."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from simulator import alibaba, yamlformat
from simulator.model import Cluster, InputError, Workload

DEFAULT_NAME = "embedded default (tools/simulator/data/default.yaml)"


@dataclass(frozen=True, slots=True)
class Inputs:
    cluster: Cluster
    workload: Workload
    description: str


def _is_csv(path: Path) -> bool:
    return path.suffix.lower() == ".csv"


def _load_yaml(path: Path) -> yamlformat.Document:
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise InputError(str(path), 0, 0, "unknown file type; expected .csv (Alibaba trace) or .yaml/.yml")
    return yamlformat.load(path)


def load_default() -> Inputs:
    with resources.as_file(resources.files("simulator") / "data" / "default.yaml") as path:
        document = yamlformat.load(path)
    assert document.cluster is not None and document.workload is not None  # the shipped file has both
    return Inputs(document.cluster, document.workload, DEFAULT_NAME)


def load_inputs(cluster_path: Path | None, workload_path: Path | None) -> Inputs:
    """The cluster and workload of a run.

    Neither path: the embedded default. A YAML file may hold both sections; a missing one is taken
    from the other file, else from the embedded default.
    """
    if cluster_path is None and workload_path is None:
        return load_default()
    cluster: Cluster | None = None
    workload: Workload | None = None
    for path in (cluster_path, workload_path):
        if path is None or not _is_csv(path):
            continue
        if path is cluster_path:
            cluster = alibaba.load_nodes(path)
        else:
            workload = alibaba.load_pods(path)
    for path in dict.fromkeys(p for p in (cluster_path, workload_path) if p is not None and not _is_csv(p)):
        document = _load_yaml(path)
        cluster = cluster or document.cluster
        workload = workload or document.workload
    names = " + ".join(str(p) for p in dict.fromkeys(p for p in (cluster_path, workload_path) if p))
    if cluster is None or workload is None:
        default = load_default()
        missing = "nodes" if cluster is None else "pods"
        names += f" (with the {missing} of the embedded default)"
        cluster = cluster or default.cluster
        workload = workload or default.workload
    return Inputs(cluster, workload, names)
