"""The time experiment: pods arrive, queue, run for their duration and leave.

* A pod arrives at its ``arrival`` time and is scheduled at once if a node takes it; otherwise it
  waits. Whenever a pod ends, the waiting pods (oldest first, per shape) are tried again on the node
  it left, the only place where room appeared, and placed by the scheduler if they fit there.
* A pod's ``duration`` is its run time alone on a GPU of speed 1.0 (V100). It runs at
  ``speed x interference``: ``speed`` is the speed profile of the GPU model it got, for its workload
  class (the slowest of its GPUs); ``interference`` is 1 alone on its GPUs and ``colocation`` (0.68 by
  default) when another pod shares one of them. 0.68 is the median throughput a job keeps when it
  shares a V100 with another job in Gavel's measured pairs (Narayanan et al., OSDI '20). When the
  pods on a GPU ask more compute than it has (memory-only sharing reserves none), each gets its
  share of it too: ``x 100 / asked%``. Rates change as neighbours come and go.
* CPU-only pods run at speed 1.

Reported: job completion time (end - arrival) mean and 99th percentile, queueing delay (start -
arrival), makespan (last end - first arrival), and GPU utilization over time (compute asked by
running pods, each GPU counted at most full, over the cluster's GPUs).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from simulator.model import MILLI_PER_GPU, Cluster, Progress, SimPod, Workload
from simulator.scheduler import MILLI_PER_CORE, Scheduler
from tessera.contract import MAX_CORES
from tessera.placement import NodeFit, PodShape, SpeedProfiles

# Gavel (OSDI '20), Fig. 2 / Table 2 pairs on V100: median throughput kept when sharing a GPU.
GAVEL_COLOCATION_THROUGHPUT = 0.68
# Points kept of the utilization curve (the report and the plot need no more).
CURVE_POINTS = 200
# A pod of duration 0 in a trace still occupies its GPU for a moment.
MIN_DURATION_S = 1.0

GpuKey = tuple[str, int]


@dataclass(slots=True)
class _Job:
    pod: SimPod
    fit: NodeFit
    gpus: tuple[GpuKey, ...]
    speed: float
    remaining: float  # seconds of work at rate 1
    rate: float = 0.0
    updated: float = 0.0
    version: int = 0


@dataclass(slots=True)
class TimeResult:
    system: str
    pods: int
    finished: int = 0
    never_started: int = 0
    jct: list[float] = field(default_factory=list)
    queueing: list[float] = field(default_factory=list)
    makespan: float = 0.0
    # Mean % of GPU capacity in use while pods arrive (first to last arrival; the whole run when
    # every pod arrives at once).
    mean_utilization: float = 0.0
    # (seconds since the first arrival, % of GPU capacity in use)
    utilization: list[tuple[float, float]] = field(default_factory=list)
    decisions: int = 0
    decision_seconds: float = 0.0

    @property
    def mean_jct(self) -> float:
        return sum(self.jct) / len(self.jct) if self.jct else 0.0

    @property
    def p99_jct(self) -> float:
        return percentile(self.jct, 99)

    @property
    def mean_queueing(self) -> float:
        return sum(self.queueing) / len(self.queueing) if self.queueing else 0.0

    @property
    def p99_queueing(self) -> float:
        return percentile(self.queueing, 99)

    @property
    def mean_decision_ms(self) -> float:
        return 1000 * self.decision_seconds / self.decisions if self.decisions else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class _Simulation:
    def __init__(
        self,
        cluster: Cluster,
        scheduler: Scheduler,
        profiles: SpeedProfiles,
        colocation: float,
        result: TimeResult,
    ) -> None:
        self.scheduler = scheduler
        self.profiles = profiles
        self.colocation = colocation
        self.result = result
        self.capacity = cluster.total_gpus * MILLI_PER_GPU
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, job id, version)
        self.sequence = 0
        self.jobs: dict[int, _Job] = {}
        self.last_id = 0
        self.on_gpu: dict[GpuKey, set[int]] = {}
        self.asked: dict[GpuKey, int] = {}  # compute asked on a GPU, thousandths
        self.allocated = 0
        self.waiting: dict[PodShape, deque[SimPod]] = {}
        self.now = 0.0
        self.start = 0.0
        self.curve: list[tuple[float, float]] = []

    # -- placement -------------------------------------------------------------------------------

    def try_place(self, pod: SimPod) -> bool:
        started = time.perf_counter()
        fit = self.scheduler.place(pod)
        self.result.decision_seconds += time.perf_counter() - started
        self.result.decisions += 1
        if fit is None:
            return False
        self.start_job(pod, fit)
        return True

    def start_job(self, pod: SimPod, fit: NodeFit) -> None:
        node = self.scheduler.node(fit.name)
        gpus = tuple((fit.name, g.gpu) for g in fit.placement.grants())
        speed = min(
            (self.profiles.speed(node.gpus[g.gpu].model, pod.workload) for g in fit.placement.grants()),
            default=1.0,
        )
        work = max(MIN_DURATION_S, pod.duration or 0.0)
        job_id = self.last_id = self.last_id + 1
        job = _Job(pod, fit, gpus, speed, work, updated=self.now)
        self.jobs[job_id] = job
        self.result.queueing.append(self.now - pod.arrival)
        self._occupy(job_id, job, +1)

    def _gpu_load(self, key: GpuKey) -> int:
        return min(MILLI_PER_GPU, self.asked.get(key, 0))

    def _occupy(self, job_id: int, job: _Job, sign: int) -> None:
        neighbours: set[int] = set()
        for key in job.gpus:
            self.allocated -= self._gpu_load(key)
            self.asked[key] = self.asked.get(key, 0) + sign * job.pod.gpu_milli
            self.allocated += self._gpu_load(key)
            members = self.on_gpu.setdefault(key, set())
            if sign > 0:
                members.add(job_id)
            else:
                members.discard(job_id)
            neighbours |= members
        if sign > 0:
            neighbours.add(job_id)
        for other in neighbours:
            self._reschedule(other)
        self._record_utilization()

    def _rate(self, job: _Job) -> float:
        interference = 1.0
        for key in job.gpus:
            if len(self.on_gpu[key]) > 1:
                asked = self.asked[key] / MILLI_PER_CORE
                interference = min(interference, self.colocation * min(1.0, MAX_CORES / asked))
        return job.speed * interference

    def _reschedule(self, job_id: int) -> None:
        job = self.jobs[job_id]
        job.remaining -= job.rate * (self.now - job.updated)
        job.updated = self.now
        job.rate = self._rate(job)
        job.version += 1
        self.sequence += 1
        end = self.now + max(0.0, job.remaining) / job.rate
        heapq.heappush(self.events, (end, self.sequence, job_id, job.version))

    # -- clock -----------------------------------------------------------------------------------

    def _record_utilization(self) -> None:
        point = (self.now, 100 * self.allocated / self.capacity)
        if self.curve and self.curve[-1][0] == self.now:
            self.curve[-1] = point  # several changes at one instant: the last one holds
        else:
            self.curve.append(point)

    def finish(self, job_id: int) -> None:
        job = self.jobs.pop(job_id)
        self.result.finished += 1
        self.result.jct.append(self.now - job.pod.arrival)
        self.scheduler.remove(job.pod, job.fit)
        self._occupy(job_id, job, -1)
        self.retry_waiting(job.fit.name)

    def retry_waiting(self, node_name: str) -> None:
        """Waiting pods, oldest shape first, that now fit on the node that just freed room."""
        for shape, queue in sorted(self.waiting.items(), key=lambda item: item[1][0].arrival):
            while queue:
                if not self.scheduler.fits(shape, node_name) or not self.try_place(queue[0]):
                    break
                queue.popleft()
            if not queue:
                del self.waiting[shape]

    def wait(self, pod: SimPod) -> None:
        self.waiting.setdefault(self.scheduler.shape(pod), deque()).append(pod)


def run_time(
    cluster: Cluster,
    *,
    workload: Workload,
    scheduler: Scheduler,
    profiles: SpeedProfiles,
    colocation: float = GAVEL_COLOCATION_THROUGHPUT,
    progress: Progress | None = None,
) -> TimeResult:
    """Replay ``workload`` in time on ``scheduler``; ``profiles`` give the GPUs' real speeds."""
    pods = sorted(workload.pods, key=lambda p: (p.arrival, p.name))
    result = TimeResult(scheduler.system.name, len(pods))
    sim = _Simulation(cluster, scheduler, profiles, colocation, result)
    sim.start = sim.now = pods[0].arrival if pods else 0.0
    next_pod = 0
    handled = 0
    while next_pod < len(pods) or sim.events:
        next_end = sim.events[0][0] if sim.events else math.inf
        if next_pod < len(pods) and pods[next_pod].arrival <= next_end:
            pod = pods[next_pod]
            next_pod += 1
            sim.now = pod.arrival
            if not sim.try_place(pod):
                sim.wait(pod)
            handled += 1
            if progress is not None and handled % 64 == 0:
                progress(64)
            continue
        end, _, job_id, version = heapq.heappop(sim.events)
        job = sim.jobs.get(job_id)
        if job is None or job.version != version:
            continue  # superseded by a rate change
        sim.now = end
        sim.finish(job_id)
    if progress is not None:
        progress(handled % 64)
    sim._record_utilization()
    result.never_started = sum(len(q) for q in sim.waiting.values())
    result.makespan = sim.now - sim.start
    # While pods arrive; over the whole run when they all arrive at once.
    last_arrival = pods[-1].arrival if pods else 0.0
    result.mean_utilization = _mean_until(sim.curve, last_arrival if last_arrival > sim.start else sim.now)
    result.utilization = _downsample([(t - sim.start, u) for t, u in sim.curve], CURVE_POINTS)
    return result


def _mean_until(curve: list[tuple[float, float]], end: float) -> float:
    """Time-weighted mean of a step curve from its first point to ``end``."""
    if not curve or end <= curve[0][0]:
        return curve[0][1] if curve else 0.0
    area = 0.0
    for (moment, value), (following, _) in zip(curve, [*curve[1:], (end, 0.0)], strict=True):
        if moment >= end:
            break
        area += value * (min(following, end) - moment)
    return area / (end - curve[0][0])


def _downsample(curve: list[tuple[float, float]], points: int) -> list[tuple[float, float]]:
    """At most ``points`` samples of a step curve, evenly spaced in time (value at each instant)."""
    if len(curve) <= points:
        return curve
    end = curve[-1][0]
    sampled: list[tuple[float, float]] = []
    i = 0
    for k in range(points):
        moment = end * k / (points - 1)
        while i + 1 < len(curve) and curve[i + 1][0] <= moment:
            i += 1
        sampled.append((moment, curve[i][1]))
    return sampled
