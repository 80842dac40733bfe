"""Showing the report of `tessera status`: a table for a terminal (colours when asked), or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import TextIO

from tessera.cli.status.report import Status
from tessera.contract import MAX_CORES, pod_ref


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def _age(age: float | None) -> str:
    if age is None:
        return "no heartbeat"
    if age < 120:
        return f"heartbeat {max(age, 0):.0f}s ago"
    return f"heartbeat {age / 60:.0f}m ago"


class _Paint:
    def __init__(self, on: bool) -> None:
        self.on = on

    def __call__(self, text: str, colour: str) -> str:
        codes = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}
        return f"\033[{codes[colour]}m{text}\033[0m" if self.on and text else text


HEADER = ("NODE / GPU / POD", "MODEL", "MEMORY GiB", "CORES %", "SLICES", "STATE", "USE")
# A DRA node's state: its GPUs are its driver's devices, shared by claims; it has no heartbeat.
DRA_STATE = "DRA driver"


def render_table(report: Status, out: TextIO, colour: bool) -> None:
    paint = _Paint(colour)
    rows: list[tuple[tuple[str, ...], tuple[str, ...]]] = []  # (cells, colour per cell)

    def row(cells: Sequence[str], colours: Sequence[str] = ()) -> None:
        rows.append((tuple(cells), tuple(colours) + ("",) * (len(HEADER) - len(colours))))

    row(HEADER, ("bold",) * len(HEADER))
    for node in report.nodes:
        stale = not node.dra and (node.heartbeat_age_seconds is None or node.heartbeat_age_seconds > 60)
        state = node.error or (DRA_STATE if node.dra else _age(node.heartbeat_age_seconds))
        row(
            (node.name, "", "", "", "", state, "" if node.metrics == "ok" else f"metrics: {node.metrics}"),
            ("bold", "", "", "", "", "red" if node.error or stale else "green", "dim"),
        )
        for gpu in node.gpus:
            over = gpu.memory_allocated_bytes > gpu.memory_bytes or gpu.cores_allocated_percent > MAX_CORES
            use = []
            if gpu.utilization_ratio is not None:
                use.append(f"util {gpu.utilization_ratio:.0%}")
            if gpu.memory_used_bytes is not None:
                use.append(f"{_gib(gpu.memory_used_bytes)} GiB in use")
            row(
                (
                    f"  {gpu.index} {gpu.uuid}",
                    gpu.model,
                    f"{_gib(gpu.memory_allocated_bytes)} / {_gib(gpu.memory_bytes)}",
                    f"{gpu.cores_allocated_percent} / {MAX_CORES}",
                    f"{gpu.slices_used} claims" if node.dra else f"{gpu.slices_used} / {gpu.slices_total}",
                    gpu.health,
                    ", ".join(use),
                ),
                (
                    "",
                    "",
                    "red" if over else "",
                    "red" if over else "",
                    "",
                    "green" if gpu.health == "Healthy" else "red",
                ),
            )
            for pod in gpu.pods:
                used = "" if pod.memory_used_bytes is None else f"{_gib(pod.memory_used_bytes)} GiB used"
                row(
                    (
                        f"    {pod_ref(pod.namespace, pod.pod)} ({pod.container})",
                        "",
                        _gib(pod.memory_bytes),
                        str(pod.cores_percent),
                        "",
                        pod.phase,
                        used,
                    ),
                    ("", "", "", "", "", "yellow" if pod.phase != "allocated" else ""),
                )
            for claim in gpu.claims:
                used = "" if claim.memory_used_bytes is None else f"{_gib(claim.memory_used_bytes)} GiB used"
                row(
                    (
                        f"    claim {pod_ref(claim.namespace, claim.claim)} ({', '.join(claim.pods)})",
                        "",
                        _gib(claim.memory_bytes),
                        str(claim.cores_percent),
                        "",
                        "reserved" if claim.pods else "allocated",
                        used,
                    ),
                )
    widths = [max(len(cells[i]) for cells, _ in rows) for i in range(len(HEADER))]
    for cells, colours in rows:
        padded = [
            paint(c.ljust(w), k) if k else c.ljust(w) for c, w, k in zip(cells, widths, colours, strict=True)
        ]
        out.write("  ".join(padded).rstrip() + "\n")
    if not report.nodes:
        out.write(
            "no node has a Tessera GPU inventory or DRA ResourceSlice (is the device plugin or the DRA "
            "driver running?)\n"
        )
    if report.pending:
        out.write("\n" + paint("PENDING", "bold") + "\n")
        width = max(len(pod_ref(p.namespace, p.pod)) for p in report.pending)
        for p in report.pending:
            out.write(f"  {pod_ref(p.namespace, p.pod).ljust(width)}  {paint(p.reason, 'yellow')}\n")
    for problem in report.problems:
        out.write(paint(f"problem: {problem}", "red") + "\n")


def render_json(report: Status, out: TextIO) -> None:
    json.dump(asdict(report), out, indent=2)
    out.write("\n")
