"""Loader for the Alibaba GPU cluster trace (cluster-trace-gpu-v2023) CSV files.

Node list columns: ``sn``, ``cpu_milli``, ``memory_mib``, ``gpu``, ``model``.
Pod list columns: ``name``, ``cpu_milli``, ``memory_mib``, ``num_gpu``, ``gpu_milli``, ``gpu_spec``
(``|``-separated models, empty = any), ``creation_time``, ``deletion_time`` (seconds); other
columns (``qos``, ``pod_phase``, ``scheduled_time``) are read past.

A pod's duration is ``deletion_time - creation_time``; ``gpu_milli`` is clipped to [0, 1000] as the
FGD simulator does.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

from simulator.model import (
    GPU_MEMORY_MIB,
    MILLI_PER_GPU,
    Cluster,
    InputError,
    SimNode,
    SimPod,
    Workload,
)

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")


class _Row:
    """One data row, with the position of every field for error messages."""

    def __init__(self, path: str, line: int, header: dict[str, int], fields: list[str]) -> None:
        self.path = path
        self.line = line
        self._header = header
        self._fields = fields

    def _column(self, index: int) -> int:
        # Character column of field `index`: the trace has no quoted fields, so commas delimit.
        return sum(len(f) + 1 for f in self._fields[:index]) + 1

    def error(self, name: str, message: str) -> InputError:
        index = self._header.get(name, 0)
        return InputError(self.path, self.line, self._column(index), f"column {name!r}: {message}")

    def text(self, name: str, *, required: bool = True) -> str:
        index = self._header.get(name)
        value = "" if index is None else self._fields[index].strip()
        if required and not value:
            raise self.error(name, "is empty")
        return value

    def integer(self, name: str, *, minimum: int = 0) -> int:
        return self._parse_integer(name, self.text(name), minimum)

    def optional_integer(self, name: str) -> int | None:
        value = self.text(name, required=False)
        return self._parse_integer(name, value, 0) if value else None

    def _parse_integer(self, name: str, value: str, minimum: int) -> int:
        try:
            number = int(value)
        except ValueError:
            try:
                as_float = float(value)
            except ValueError:
                raise self.error(name, f"{value!r} is not a number") from None
            if not as_float.is_integer():
                raise self.error(name, f"{value!r} is not an integer") from None
            number = int(as_float)
        if number < minimum:
            raise self.error(name, f"{value!r} is below {minimum}")
        return number


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[_Row]:
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(shown, 0, 0, f"cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise InputError(shown, 1, e.start + 1, "not UTF-8 text") from None
    lines = text.splitlines()
    if not lines:
        raise InputError(shown, 1, 1, f"empty file; expected a header with {', '.join(required)}")
    names = [n.strip() for n in next(csv.reader([lines[0]]))]
    header = {name: i for i, name in enumerate(names)}
    for name in required:
        if name not in header:
            raise InputError(shown, 1, 1, f"header has no column {name!r} (found: {', '.join(names)})")
    for number, raw in enumerate(lines[1:], start=2):
        if not raw.strip():
            continue
        fields = next(csv.reader([raw]))
        if len(fields) != len(names):
            raise InputError(
                shown, number, len(raw) + 1, f"{len(fields)} fields where the header has {len(names)}"
            )
        yield _Row(shown, number, header, fields)


def load_nodes(path: Path, gpu_memory_mib: dict[str, int] | None = None) -> Cluster:
    memory_table = {**GPU_MEMORY_MIB, **(gpu_memory_mib or {})}
    nodes: list[SimNode] = []
    seen: set[str] = set()
    for row in _rows(path, NODE_COLUMNS):
        name = row.text("sn")
        if name in seen:
            raise row.error("sn", f"node {name!r} appears twice")
        seen.add(name)
        model = row.text("model")
        if model not in memory_table:
            known = ", ".join(sorted(memory_table))
            raise row.error("model", f"GPU model {model!r} has no known memory (known: {known})")
        gpus = row.integer("gpu", minimum=1)
        cpu = row.integer("cpu_milli", minimum=1)
        memory = row.integer("memory_mib", minimum=1)
        nodes.append(SimNode(name, model, gpus, memory_table[model], cpu, memory))
    if not nodes:
        raise InputError(str(path), 2, 1, "no nodes")
    return Cluster(tuple(nodes))


def load_pods(path: Path) -> Workload:
    pods: list[SimPod] = []
    for row in _rows(path, POD_COLUMNS):
        num_gpu = row.integer("num_gpu")
        milli = row.integer("gpu_milli")
        cpu = row.integer("cpu_milli")
        memory = row.integer("memory_mib")
        milli = min(milli, MILLI_PER_GPU) if num_gpu else 0
        if num_gpu and milli == 0:
            raise row.error("gpu_milli", f"0 with num_gpu {num_gpu}: a GPU pod must ask some GPU")
        if num_gpu > 1 and milli != MILLI_PER_GPU:
            raise row.error("gpu_milli", f"{milli} with num_gpu {num_gpu}: multi-GPU pods ask whole GPUs")
        created = row.optional_integer("creation_time")
        deleted = row.optional_integer("deletion_time")
        duration: float | None = None
        if created is not None and deleted is not None:
            if deleted < created:
                raise row.error("deletion_time", f"{deleted} is before creation_time {created}")
            duration = float(deleted - created)
        spec = row.text("gpu_spec", required=False)
        models = tuple(sorted({m.strip() for m in spec.split("|") if m.strip()}))
        pods.append(
            SimPod(
                name=row.text("name"),
                cpu_milli=cpu,
                host_memory_mib=memory,
                num_gpu=num_gpu,
                gpu_milli=milli,
                gpu_models=models,
                arrival=float(created or 0),
                duration=duration,
            )
        )
    if not pods:
        raise InputError(str(path), 2, 1, "no pods")
    return Workload(tuple(pods))
