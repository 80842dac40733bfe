"""The project's own YAML format for a cluster and a workload (docs/simulate.md shows an example).

One file may hold any of three top-level keys::

    gpu_models:            # memory of models the built-in table lacks, or overrides
      MyGPU: {memory_mib: 20480}
    nodes:
      - {name: v100, count: 4, model: V100, gpus: 8, cpu_milli: 96000, memory_mib: 786432}
    pods:
      - {name: train, count: 2, cpu_milli: 8000, memory_mib: 32768, gpus: 1, gpu_milli: 500,
         gpu_models: [V100], workload: training, arrival: 0, duration: 3600}

Every error names the file, the line and the column of the offending value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from simulator.model import (
    GPU_MEMORY_MIB,
    MILLI_PER_GPU,
    Cluster,
    InputError,
    SimNode,
    SimPod,
    Workload,
)

# libyaml's parser when PyYAML was built with it (several times faster); both give positions.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

NODE_KEYS = ("name", "count", "model", "gpus", "cpu_milli", "memory_mib")
POD_KEYS = (
    "name",
    "count",
    "cpu_milli",
    "memory_mib",
    "gpus",
    "gpu_milli",
    "gpu_models",
    "workload",
    "arrival",
    "duration",
)


@dataclass(frozen=True, slots=True)
class Document:
    """What one YAML file held; a section it lacks is None."""

    cluster: Cluster | None
    workload: Workload | None


class _Reader:
    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, node: yaml.Node, message: str) -> InputError:
        mark = node.start_mark
        return InputError(self.path, mark.line + 1, mark.column + 1, message)

    def mapping(self, node: yaml.Node, what: str, allowed: tuple[str, ...] | None) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, f"{what} must be a mapping")
        fields: dict[str, yaml.Node] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                raise self.error(key, f"{what}: keys must be plain names")
            if allowed is not None and key.value not in allowed:
                raise self.error(key, f"{what}: unknown key {key.value!r} (allowed: {', '.join(allowed)})")
            if key.value in fields:
                raise self.error(key, f"{what}: key {key.value!r} given twice")
            fields[key.value] = value
        return fields

    def sequence(self, node: yaml.Node, what: str) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(node, f"{what} must be a list")
        return list(node.value)

    def text(self, node: yaml.Node, what: str) -> str:
        if not isinstance(node, yaml.ScalarNode) or not str(node.value).strip():
            raise self.error(node, f"{what} must be a non-empty string")
        return str(node.value).strip()

    def number(self, node: yaml.Node, what: str, *, minimum: float) -> float:
        if isinstance(node, yaml.ScalarNode):
            try:
                value = float(node.value)
            except ValueError:
                value = float("nan")
            if math.isfinite(value) and value >= minimum:
                return value
        shown = node.value if isinstance(node, yaml.ScalarNode) else node.tag
        raise self.error(node, f"{what}: {shown!r} must be a number of at least {minimum:g}")

    def integer(self, node: yaml.Node, what: str, *, minimum: int) -> int:
        value = self.number(node, what, minimum=minimum)
        if not value.is_integer():
            raise self.error(node, f"{what}: {node.value!r} must be an integer")
        return int(value)

    def required(self, fields: dict[str, yaml.Node], parent: yaml.Node, key: str, what: str) -> yaml.Node:
        if key not in fields:
            raise self.error(parent, f"{what}: missing key {key!r}")
        return fields[key]


@dataclass(frozen=True, slots=True)
class _Entry:
    """One list item (a node or a pod) with its fields, read with errors naming ``what.key``."""

    reader: _Reader
    node: yaml.Node
    fields: dict[str, yaml.Node]
    what: str

    def get(self, key: str) -> yaml.Node:
        return self.reader.required(self.fields, self.node, key, self.what)

    def text(self, key: str) -> str:
        return self.reader.text(self.get(key), f"{self.what}.{key}")

    def integer(self, key: str, *, minimum: int, default: int | None = None) -> int:
        if default is not None and key not in self.fields:
            return default
        return self.reader.integer(self.get(key), f"{self.what}.{key}", minimum=minimum)


def load(path: Path) -> Document:
    shown = str(path)
    reader = _Reader(shown)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(shown, 0, 0, f"cannot read: {e.strerror}") from None
    try:
        root = yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise InputError(shown, line, column, f"not valid YAML: {e.problem}") from None
    if root is None:
        raise InputError(shown, 1, 1, "empty file; expected keys nodes, pods or gpu_models")
    top = reader.mapping(root, "the file", ("gpu_models", "nodes", "pods"))
    memory_table = dict(GPU_MEMORY_MIB)
    if "gpu_models" in top:
        for model, spec in reader.mapping(top["gpu_models"], "gpu_models", None).items():
            fields = reader.mapping(spec, f"gpu_models.{model}", ("memory_mib",))
            value = reader.required(fields, spec, "memory_mib", f"gpu_models.{model}")
            memory_table[model] = reader.integer(value, f"gpu_models.{model}.memory_mib", minimum=1)
    cluster = _nodes(reader, top["nodes"], memory_table) if "nodes" in top else None
    workload = _pods(reader, top["pods"]) if "pods" in top else None
    return Document(cluster, workload)


def _nodes(reader: _Reader, node: yaml.Node, memory_table: dict[str, int]) -> Cluster:
    nodes: list[SimNode] = []
    seen: set[str] = set()
    for i, item in enumerate(reader.sequence(node, "nodes")):
        what = f"nodes[{i}]"
        entry = _Entry(reader, item, reader.mapping(item, what, NODE_KEYS), what)
        name = entry.text("name")
        count = entry.integer("count", minimum=1, default=1)
        model = entry.text("model")
        if model not in memory_table:
            known = ", ".join(sorted(memory_table))
            raise reader.error(
                entry.get("model"),
                f"{what}.model: {model!r} has no known memory; add it under gpu_models ({known})",
            )
        gpus = entry.integer("gpus", minimum=1)
        cpu = entry.integer("cpu_milli", minimum=1)
        memory = entry.integer("memory_mib", minimum=1)
        for n in range(count):
            full_name = f"{name}-{n}" if count > 1 else name
            if full_name in seen:
                raise reader.error(item, f"{what}.name: node {full_name!r} appears twice")
            seen.add(full_name)
            nodes.append(SimNode(full_name, model, gpus, memory_table[model], cpu, memory))
    if not nodes:
        raise reader.error(node, "nodes: the list is empty")
    return Cluster(tuple(nodes))


def _pods(reader: _Reader, node: yaml.Node) -> Workload:
    pods: list[SimPod] = []
    for i, item in enumerate(reader.sequence(node, "pods")):
        what = f"pods[{i}]"
        fields = reader.mapping(item, what, POD_KEYS)
        entry = _Entry(reader, item, fields, what)
        name = entry.text("name")
        count = entry.integer("count", minimum=1, default=1)
        gpus = entry.integer("gpus", minimum=0, default=0)
        milli = entry.integer("gpu_milli", minimum=1, default=MILLI_PER_GPU) if gpus else 0
        if milli > MILLI_PER_GPU:
            raise reader.error(fields["gpu_milli"], f"{what}.gpu_milli: {milli} is more than {MILLI_PER_GPU}")
        if gpus > 1 and milli != MILLI_PER_GPU:
            raise reader.error(
                fields["gpu_milli"],
                f"{what}.gpu_milli: {milli} with gpus {gpus}: multi-GPU pods ask whole GPUs",
            )
        models: tuple[str, ...] = ()
        if "gpu_models" in fields:
            items = reader.sequence(fields["gpu_models"], f"{what}.gpu_models")
            models = tuple(sorted({reader.text(m, f"{what}.gpu_models") for m in items}))
        pod = SimPod(
            name=name,
            cpu_milli=entry.integer("cpu_milli", minimum=0),
            host_memory_mib=entry.integer("memory_mib", minimum=0),
            num_gpu=gpus,
            gpu_milli=milli,
            gpu_models=models,
            workload=entry.text("workload") if "workload" in fields else None,
            arrival=reader.number(fields["arrival"], f"{what}.arrival", minimum=0)
            if "arrival" in fields
            else 0.0,
            duration=reader.number(fields["duration"], f"{what}.duration", minimum=0)
            if "duration" in fields
            else None,
        )
        pods.extend(pod if count == 1 else replace(pod, name=f"{name}-{n}") for n in range(count))
    if not pods:
        raise reader.error(node, "pods: the list is empty")
    return Workload(tuple(pods))
