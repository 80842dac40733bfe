"""The comparison as a terminal table and as a JSON report."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from simulator.experiment import Options, SystemResult
from simulator.inputs import Inputs
from simulator.packing import REPORTED_LOADS

FRAGMENTATION_SHOWN = 90


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _change(new: float, old: float) -> float:
    return 100 * (old - new) / old if old else 0.0


def packing_table(results: Sequence[SystemResult]) -> str:
    header = ["policy", "alloc@100%", *(f"unalloc@{x}% (GPUs)" for x in REPORTED_LOADS)]
    header += [f"frag@{FRAGMENTATION_SHOWN}%", "placed", "ms/decision"]
    rows = []
    for r in results:
        p = r.packing
        if p is None:
            continue
        unallocated = [p.unallocated_at(x) for x in REPORTED_LOADS]
        fragmentation = p.fragmentation.get(FRAGMENTATION_SHOWN)
        rows.append(
            [
                r.system.name,
                f"{p.allocation_at(100):.2f}%",
                *(f"{pct:.2f}% ({gpus:.0f})" for pct, gpus in unallocated),
                "-" if fragmentation is None else f"{fragmentation[1]:.1f}%",
                f"{p.placed}/{p.pods}",
                f"{p.mean_decision_ms:.2f}",
            ]
        )
    return _table(header, rows)


def time_table(results: Sequence[SystemResult]) -> str:
    header = ["policy", "mean JCT", "p99 JCT", "mean wait", "p99 wait", "makespan", "GPU util", "never ran"]
    rows = []
    for r in results:
        t = r.time
        if t is None:
            continue
        rows.append(
            [
                r.system.name,
                _duration(t.mean_jct),
                _duration(t.p99_jct),
                _duration(t.mean_queueing),
                _duration(t.p99_queueing),
                _duration(t.makespan),
                f"{t.mean_utilization:.1f}%",
                str(t.never_started),
            ]
        )
    return _table(header, rows)


def findings(results: Sequence[SystemResult]) -> list[str]:
    """One-line conclusions the tables support."""
    by_name = {r.system.name: r for r in results}
    lines: list[str] = []
    fgd, binpack, exclusive = by_name.get("fragmentation"), by_name.get("binpack"), by_name.get("exclusive")
    if fgd and fgd.packing and binpack and binpack.packing:
        new, old = fgd.packing.unallocated_at(100)[0], binpack.packing.unallocated_at(100)[0]
        lines.append(
            f"fragmentation leaves {_change(new, old):.0f}% fewer GPUs unallocated than binpack at 100% load "
            f"({new:.2f}% vs {old:.2f}%)."
        )
    if exclusive and exclusive.packing:
        best = max(
            (r for r in results if r.packing), key=lambda r: r.packing.allocation_at(100) if r.packing else 0
        )
        if best.packing and best is not exclusive:
            lines.append(
                f"Sharing: {best.system.name} allocates {best.packing.allocation_at(100):.1f}% of GPU "
                f"capacity at 100% load; whole GPUs only (exclusive) "
                f"{exclusive.packing.allocation_at(100):.1f}%."
            )
    if exclusive and exclusive.time and fgd and fgd.time:
        lines.append(
            f"Time: whole GPUs make pods wait {_duration(exclusive.time.mean_queueing)} on average "
            f"(fragmentation {_duration(fgd.time.mean_queueing)}), but shared pods run slower "
            f"(mean JCT {_duration(exclusive.time.mean_jct)} vs {_duration(fgd.time.mean_jct)})."
        )
    aware = by_name.get("speed-aware")
    if aware and aware.time and binpack and binpack.time:
        lines.append(
            f"speed-aware cuts mean JCT by {_change(aware.time.mean_jct, binpack.time.mean_jct):.1f}% vs "
            f"speed-blind binpack ({_duration(aware.time.mean_jct)} vs {_duration(binpack.time.mean_jct)})."
        )
    return lines


def render(inputs: Inputs, options: Options, results: Sequence[SystemResult]) -> str:
    cluster, workload = inputs.cluster, inputs.workload
    models = ", ".join(f"{m} x{sum(n.gpus for n in cluster.nodes if n.model == m)}" for m in cluster.models)
    parts = [
        f"Input: {inputs.description}",
        f"Cluster: {len(cluster.nodes)} nodes, {cluster.total_gpus} GPUs ({models}); workload: "
        f"{len(workload.pods)} pods. Seed {options.seed}.",
    ]
    if any(r.packing for r in results):
        parts += [
            "",
            f"Packing (FGD paper): pods arrive until {100 * options.inflation:.0f}% of GPU capacity and "
            "never leave. alloc = GPU capacity allocated; unalloc = capacity left unallocated (% and GPUs) "
            "at that arrived load; frag = fragmentation ratio (idle capacity the workload's shapes cannot "
            "use).",
            packing_table(results),
        ]
    if any(r.time for r in results):
        parts += [
            "",
            f"Time: pods arrive at their times, queue when nothing fits, run at their GPU's speed x "
            f"{options.colocation:g} when sharing a GPU. JCT = end - arrival; wait = start - arrival; "
            "GPU util = mean compute in use while pods arrive.",
            time_table(results),
        ]
    lines = findings(results)
    if lines:
        parts += ["", *lines]
    return "\n".join(parts)


def to_json(inputs: Inputs, options: Options, results: Sequence[SystemResult]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "input": inputs.description,
        "cluster": {"nodes": len(inputs.cluster.nodes), "gpus": inputs.cluster.total_gpus},
        "pods": len(inputs.workload.pods),
        "options": {
            "seed": options.seed,
            "inflation": options.inflation,
            "colocation_throughput": options.colocation,
            "experiments": [e.value for e in options.experiments],
        },
        "findings": findings(results),
        "policies": [],
    }
    for r in results:
        entry: dict[str, Any] = {
            "policy": r.system.name,
            "description": r.system.description,
            "request": r.system.request.value,
            "seconds": round(r.seconds, 3),
            "cpu_seconds": round(r.cpu_seconds, 3),
        }
        if r.packing is not None:
            p = r.packing
            entry["packing"] = {
                "pods": p.pods,
                "placed": p.placed,
                "allocation_at_100": round(p.allocation_at(100), 3),
                "unallocated": {
                    str(x): {
                        "percent": round(p.unallocated_at(x)[0], 3),
                        "gpus": round(p.unallocated_at(x)[1], 1),
                    }
                    for x in REPORTED_LOADS
                },
                "fragmentation": {
                    str(x): {"amount_percent": round(a, 3), "ratio_percent": round(b, 3)}
                    for x, (a, b) in p.fragmentation.items()
                },
                "allocation_by_arrived_load": {str(k): round(v, 3) for k, v in p.allocation.items()},
                "mean_decision_ms": round(p.mean_decision_ms, 4),
            }
        if r.time is not None:
            t = r.time
            entry["time"] = {
                "pods": t.pods,
                "finished": t.finished,
                "never_started": t.never_started,
                "mean_jct_s": round(t.mean_jct, 1),
                "p99_jct_s": round(t.p99_jct, 1),
                "mean_queueing_s": round(t.mean_queueing, 1),
                "p99_queueing_s": round(t.p99_queueing, 1),
                "makespan_s": round(t.makespan, 1),
                "mean_utilization_percent": round(t.mean_utilization, 2),
                "utilization_over_time": [[round(a, 1), round(b, 2)] for a, b in t.utilization],
                "mean_decision_ms": round(t.mean_decision_ms, 4),
            }
        report["policies"].append(entry)
    return report


def dump_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2) + "\n"
