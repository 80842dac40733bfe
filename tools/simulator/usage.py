"""The usage experiment: how many more pods run when best-effort pods are placed against measured
use, and whether a guaranteed pod's use ever lacks its memory.

The Alibaba traces the simulator reads have requests and no use columns, so each pod's use is drawn
from a stated distribution (:class:`UseRatio`, a parameter): the share of its GPU memory request it
really uses. Weng et al. ("MLaaS in the Wild", NSDI '22) report that tasks of Alibaba's PAI cluster
use far less GPU than they request (the trace's sensor table: low utilisation and memory held far
below the allocation for most instances); the default, Beta(2, 3) (mean 0.4), is an assumption in that
spirit, not a fit to their data: try others.

The experiment, for both placements (by requests only, and usage-aware: the product's rule,
``tessera.placement.usage``, with its default margin) over the same seeded input:

* pods arrive in the packing experiment's seeded order (up to ``inflation`` x the cluster's GPU
  capacity) and never leave; a share (``best_effort_share``) of the GPU pods is best-effort; a pod
  that fits nowhere stays pending and is tried again after each measurement, in arrival order (as
  kube-scheduler retries unschedulable pods);
* time advances in measurement periods: each period the node agent measures (every pod's use this
  period: ``its request x its ratio x a log-normal jitter``, at most its request; a guaranteed pod
  uses its whole request with probability ``burst``, which is how guaranteed use grows), then
  ``arrivals_per_measurement`` pods arrive and are placed by the placement core (the extender's
  code: measured use plus margin plus the pods placed since that measurement);
* on every GPU, every period: if the use of the promised grants (every grant placed by requests)
  and the oversubscribed ones together exceeds the memory, the node agent evicts oversubscribed
  best-effort pods, newest first, until it fits (an evicted pod is gone: it counts as not running);
  a *guaranteed failure* is a GPU where promised use alone exceeds the memory (the core's promise
  broken). It must stay 0;
* after the last arrival, ``settle_measurements`` more periods pass (use changing, evictions).

Reported per placement: pods placed, placed against use, evicted, running at the end (all, best-effort,
guaranteed GPU pods), guaranteed failures, and the GPU memory really in use at the end (share of the
cluster's). There is no preemption here: a guaranteed pod arriving after a borrower took the host CPU,
memory or slice it needed stays pending, where kube-scheduler would preempt the borrower when its
priority is lower (a best-effort pod's usually is).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from simulator.model import Cluster, Progress, SimPod, Workload
from simulator.packing import arrival_order
from simulator.scheduler import SimScheduler, system_named
from tessera.contract import QosClass
from tessera.placement import NodeFit, PodShape, SpeedProfiles, UsageRule, choose, release

# Tessera binpack, by requests: the placement both runs use.
SYSTEM = "binpack"
# The spread of a pod's use from one measurement to the next (sigma of the log-normal jitter).
JITTER_SIGMA = 0.25


@dataclass(frozen=True, slots=True)
class UseRatio:
    """The distribution of a pod's used / requested GPU memory: ``beta:A,B`` (Beta(A, B)),
    ``uniform:LOW,HIGH`` or ``fixed:X``; every value within 0..1."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> UseRatio:
        kind, _, numbers = text.partition(":")
        try:
            values = [float(v) for v in numbers.split(",")] if numbers else []
        except ValueError:
            raise ValueError(f"use ratio {text!r}: {numbers!r} are not numbers") from None
        wanted = {"beta": 2, "uniform": 2, "fixed": 1}.get(kind)
        if wanted is None:
            raise ValueError(f"use ratio {text!r}: {kind!r} is not beta, uniform or fixed")
        if len(values) != wanted:
            raise ValueError(f"use ratio {text!r}: {kind} takes {wanted} number(s)")
        if kind == "beta" and min(values) <= 0:
            raise ValueError(f"use ratio {text!r}: beta's parameters must be above 0")
        if kind != "beta" and not all(0 <= v <= 1 for v in values):
            raise ValueError(f"use ratio {text!r}: {kind}'s values must be within 0..1")
        if kind == "uniform" and values[0] > values[1]:
            raise ValueError(f"use ratio {text!r}: the low end is above the high end")
        return cls(kind, *values)

    def draw(self, rng: random.Random) -> float:
        if self.kind == "beta":
            return rng.betavariate(self.a, self.b)
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        return self.a

    def __str__(self) -> str:
        return f"{self.kind}:{self.a:g}" + ("" if self.kind == "fixed" else f",{self.b:g}")


@dataclass(frozen=True, slots=True)
class UsageOptions:
    seed: int = 42
    inflation: float = 1.3
    best_effort_share: float = 0.3
    use_ratio: UseRatio = field(default_factory=lambda: UseRatio("beta", 2, 3))
    burst: float = 0.05
    arrivals_per_measurement: int = 20
    settle_measurements: int = 100
    rule: UsageRule = field(default_factory=UsageRule)


@dataclass(slots=True)
class UsageResult:
    placement: str  # "by requests" or "usage-aware"
    pods: int = 0
    placed: int = 0
    placed_best_effort: int = 0
    placed_against_use: int = 0
    evicted: int = 0
    pending: int = 0  # never placed
    running: int = 0
    running_best_effort: int = 0
    # Guaranteed GPU pods running (never evicted): fewer usage-aware when borrowers took the host
    # CPU, memory or slices a later guaranteed pod needed (the simulation has no preemption).
    running_guaranteed: int = 0
    guaranteed_failures: int = 0
    # GPU memory really in use at the end, % of the cluster's.
    memory_used_percent: float = 0.0
    measurements: int = 0


@dataclass(slots=True)
class _Running:
    pod: SimPod
    shape: PodShape
    fit: NodeFit
    ratio: float
    seq: int
    guaranteed: bool
    use: float = 0.0  # its use per GPU this period, MiB

    @property
    def oversubscribed(self) -> bool:
        return self.fit.oversubscribed


class _Run:
    def __init__(
        self,
        cluster: Cluster,
        workload: Workload,
        options: UsageOptions,
        *,
        usage_aware: bool,
        order: list[SimPod],
        drawn: list[tuple[bool, float]],
    ) -> None:
        """``order``: the arrivals; ``drawn``: each one's class (best-effort or not) and use ratio."""
        self.options = options
        self.order = order
        self.drawn = drawn
        self.pending: list[int] = []  # arrivals no node took yet, in arrival order
        self.usage_aware = usage_aware
        self.scheduler = SimScheduler(
            cluster, system_named(SYSTEM), SpeedProfiles(), workload.pods, options.seed
        )
        self.result = UsageResult("usage-aware" if usage_aware else "by requests", pods=len(order))
        # Each period's uses (the same sequence of draws for both runs).
        self.rng = random.Random(options.seed + 2)
        self.running: dict[int, _Running] = {}
        self.on_gpu: dict[tuple[str, int], list[int]] = {}

    def period(self, arrivals: range) -> None:
        """A measurement, then the pending pods tried again and the ``arrivals`` placed."""
        self.measure()
        still = []
        # Within a period placements only take room: a shape that found none finds none again.
        refused: set[PodShape] = set()
        for seq in [*self.pending, *arrivals]:
            shape = self.shape(seq)
            if shape in refused or not self.place(seq, shape):
                refused.add(shape)
                still.append(seq)
        self.pending = still

    def shape(self, seq: int) -> PodShape:
        shape = self.scheduler.shape(self.order[seq])
        return replace(shape, qos=QosClass.BEST_EFFORT) if self.drawn[seq][0] else shape

    def place(self, seq: int, shape: PodShape) -> bool:
        """Place arrival ``seq`` (of ``shape``) now if a node takes it (else it stays pending: False)."""
        pod = self.order[seq]
        best_effort, ratio = self.drawn[seq]
        engine = self.scheduler.engine
        fit = choose(engine.evaluate(shape).fits)
        if fit is None:
            return False
        engine.commit(shape, fit)
        self.result.placed += 1
        self.result.placed_best_effort += best_effort
        self.result.placed_against_use += fit.oversubscribed
        self.result.running_guaranteed += bool(pod.num_gpu) and not best_effort
        if pod.num_gpu:  # a CPU-only pod has nothing on a GPU to measure
            self.running[seq] = _Running(pod, shape, fit, ratio, seq, guaranteed=not best_effort)
            for grant in fit.placement.grants():
                self.on_gpu.setdefault((fit.name, grant.gpu), []).append(seq)
        return True

    def evict(self, seq: int) -> None:
        running = self.running.pop(seq)
        for grant in running.fit.placement.grants():
            self.on_gpu[(running.fit.name, grant.gpu)].remove(seq)
        engine = self.scheduler.engine
        engine.set_node(release(engine.nodes[running.fit.name], running.fit.placement, running.shape))
        self.result.evicted += 1

    def measure(self) -> None:
        """A period: every pod's use, the node agent's evictions, the promise checked, then (usage
        aware) the measurement handed to placement."""
        self.result.measurements += 1
        for running in self.running.values():
            memory = max(g.memory_quota_mib for g in running.fit.placement.grants())
            if running.guaranteed and self.rng.random() < self.options.burst:
                running.use = memory
            else:
                jitter = math.exp(self.rng.gauss(0.0, JITTER_SIGMA))
                running.use = min(memory, memory * running.ratio * jitter)
        engine = self.scheduler.engine
        used: dict[tuple[str, int], float] = {}
        for gpu, seqs in self.on_gpu.items():
            capacity = engine.nodes[gpu[0]].gpus[gpu[1]].total_memory_mib
            promised = sum(self.running[s].use for s in seqs if not self.running[s].oversubscribed)
            borrowers = sorted((s for s in seqs if self.running[s].oversubscribed), reverse=True)
            borrowed = sum(self.running[s].use for s in borrowers)
            for s in borrowers:  # newest first
                if promised + borrowed <= capacity:
                    break
                borrowed -= self.running[s].use
                self.evict(s)
            if promised > capacity:
                self.result.guaranteed_failures += 1
            used[gpu] = promised + borrowed
        if self.usage_aware:
            rule = self.options.rule
            for name, node in list(engine.nodes.items()):
                gpus = tuple(
                    replace(
                        gpu,
                        measured_mib=math.ceil(used.get((name, i), 0.0)) + rule.margin(gpu.total_memory_mib),
                    )
                    for i, gpu in enumerate(node.gpus)
                )
                engine.set_node(replace(node, gpus=gpus))

    def finish(self) -> UsageResult:
        engine = self.scheduler.engine
        total = sum(g.total_memory_mib for node in engine.nodes.values() for g in node.gpus)
        in_use = sum(r.use * r.pod.num_gpu for r in self.running.values())
        self.result.pending = len(self.pending)
        self.result.running = self.result.placed - self.result.evicted
        self.result.running_best_effort = self.result.placed_best_effort - self.result.evicted
        self.result.memory_used_percent = 100 * in_use / total if total else 0.0
        return self.result


def run_usage(
    cluster: Cluster, workload: Workload, options: UsageOptions, progress: Progress | None = None
) -> list[UsageResult]:
    """The experiment: by requests, then usage-aware, over the same arrivals and draws."""
    order = arrival_order(workload, cluster, options.seed, options.inflation)
    # Each arrival's class and use ratio, the same for both runs.
    rng = random.Random(options.seed + 1)
    drawn = [
        (bool(pod.num_gpu) and rng.random() < options.best_effort_share, options.use_ratio.draw(rng))
        for pod in order
    ]
    results = []
    for usage_aware in (False, True):
        run = _Run(cluster, workload, options, usage_aware=usage_aware, order=order, drawn=drawn)
        for start in range(0, len(order), options.arrivals_per_measurement):
            arrivals = range(start, min(start + options.arrivals_per_measurement, len(order)))
            run.period(arrivals)
            if progress is not None:
                progress(len(arrivals))
        for _ in range(options.settle_measurements):
            run.period(range(0))
        results.append(run.finish())
    return results


def render(description: str, cluster: Cluster, options: UsageOptions, results: list[UsageResult]) -> str:
    """The experiment as text: what was run, a row per placement, and the difference."""
    header = ["placement", "placed", "against use", "evicted", "running", "best-effort running",
              "guaranteed running", "guaranteed failures", "GPU memory used"]  # fmt: skip
    rows = [
        [
            r.placement,
            f"{r.placed}/{r.pods}",
            str(r.placed_against_use),
            str(r.evicted),
            str(r.running),
            str(r.running_best_effort),
            str(r.running_guaranteed),
            str(r.guaranteed_failures),
            f"{r.memory_used_percent:.1f}%",
        ]
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        f"Input: {description}",
        f"Cluster: {len(cluster.nodes)} nodes, {cluster.total_gpus} GPUs. Seed {options.seed}.",
        "",
        f"Usage: pods arrive until {100 * options.inflation:.0f}% of GPU capacity and never leave, "
        f"{options.arrivals_per_measurement} per measurement, then {options.settle_measurements} more "
        f"measurements; {100 * options.best_effort_share:.0f}% of GPU pods best-effort; use/request "
        f"{options.use_ratio}, guaranteed bursts to the full request {100 * options.burst:g}% of "
        f"measurements; margin max({options.rule.margin_mib} MiB, {options.rule.margin_percent:g}%).",
        "  ".join(
            h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        ),
        "  ".join("-" * w for w in widths),
    ]
    for row in rows:
        lines.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    by_requests, usage_aware = results
    more = usage_aware.running - by_requests.running
    share = 100 * more / max(1, by_requests.running)
    lines += [
        "",
        f"usage-aware placement runs {more:+d} pods ({share:+.1f}%) at the "
        f"end, after {usage_aware.evicted} best-effort evictions; guaranteed failures: "
        f"{by_requests.guaranteed_failures} by requests, {usage_aware.guaranteed_failures} usage-aware.",
    ]
    return "\n".join(lines)


def to_json(description: str, options: UsageOptions, results: list[UsageResult]) -> dict[str, Any]:
    return {
        "input": description,
        "options": {
            "seed": options.seed,
            "inflation": options.inflation,
            "best_effort_share": options.best_effort_share,
            "use_ratio": str(options.use_ratio),
            "burst": options.burst,
            "arrivals_per_measurement": options.arrivals_per_measurement,
            "settle_measurements": options.settle_measurements,
            "margin_mib": options.rule.margin_mib,
            "margin_percent": options.rule.margin_percent,
        },
        "placements": [asdict(r) for r in results],
    }
