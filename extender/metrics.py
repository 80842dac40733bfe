"""Prometheus metrics of the extender, in a registry of its own (one per app)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tessera.placement.model import Shortfall

# Filter/prioritize take milliseconds; bind makes API calls (tens of milliseconds).
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# kube-scheduler's calls: the latency histogram's label, each verb's series there from the start (a
# p99 over a window with no call is then NaN, not absent, and one with calls never misses the first).
VerbName = Literal["filter", "prioritize", "preempt", "bind"]
# Why a bind was refused or failed: the bind_failures label. A Literal, so mypy holds every reason the
# service passes to this set, and each series exists at 0 from the start.
BindFailure = Literal[
    "no_fit", "inflight", "conflict", "api", "bound", "gone", "invalid", "scheduler", "not_leader"
]
# Every value of each label of a counter, created at 0 so that a rate over it is 0 rather than absent
# (a dashboard panel shows 0, an alert's expression has a series): all bounded sets. Shortfall.HOST is
# the simulator's (the extender never rejects for host resources).
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "pods_filtered": ("feasible", "infeasible"),
    "node_rejections": tuple(s.value for s in Shortfall if s is not Shortfall.HOST),
    "binds": ("bound", "failed"),
    "bind_failures": get_args(BindFailure),
    "preemption_nodes": ("victims", "kept", "removed"),
    "resizes": ("applied", "refused"),
    "filter_rechecks": ("changed", "unchanged", "failed"),
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "tessera_extender_request_seconds",
            "Time to answer a kube-scheduler request, by verb",
            ["verb"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "tessera_extender_requests",
            "Requests answered, by verb and HTTP status",
            ["verb", "code"],
            registry=self.registry,
        )
        self.pods_filtered = Counter(
            "tessera_extender_pods_filtered",
            "Filter decisions: pods with at least one feasible node, or none",
            ["result"],
            registry=self.registry,
        )
        self.node_rejections = Counter(
            "tessera_extender_node_rejections",
            "Nodes rejected at filter for pods that fit on none, by shortfall (memory, compute, slices, "
            "model, speed, ...)",
            ["reason"],
            registry=self.registry,
        )
        self.filter_rechecks = Counter(
            "tessera_extender_filter_rechecks",
            "Filters no node passed, the in-flight rule refusing some, after which the pods of those "
            "nodes were read from the API server, by result: changed (a pod changed meanwhile: the "
            "pod filtered again), unchanged, or failed (not read)",
            ["result"],
            registry=self.registry,
        )
        self.binds = Counter(
            "tessera_extender_binds", "Bind decisions, by result", ["result"], registry=self.registry
        )
        self.bind_failures = Counter(
            "tessera_extender_bind_failures",
            "Refused or failed binds, by reason (no_fit, inflight, conflict, api, ...)",
            ["reason"],
            registry=self.registry,
        )
        self.preemption_nodes = Counter(
            "tessera_extender_preemption_nodes",
            "Candidate nodes of kube-scheduler's preempt calls, by the extender's answer: victims (GPU "
            "pods chosen), kept (the pod fits on a GPU already: kube-scheduler's victims stand), "
            "removed (no eviction of lower-priority pods makes room)",
            ["result"],
            registry=self.registry,
        )
        self.preemption_victims = Counter(
            "tessera_extender_preemption_victims",
            "GPU pods the extender answered as victims to kube-scheduler's preempt calls",
            registry=self.registry,
        )
        self.resizes = Counter(
            "tessera_extender_resizes",
            "Live resize requests answered, by result: applied (the new allocation written on the pod) "
            "or refused (the status names the shortfall)",
            ["result"],
            registry=self.registry,
        )
        self.nodes = Gauge(
            "tessera_extender_nodes", "Nodes with a Tessera GPU inventory", registry=self.registry
        )
        self.oversubscribed_binds = Counter(
            "tessera_extender_oversubscribed_binds",
            "Best-effort pods bound against measured GPU use (oversubscribed grants), not requests",
            registry=self.registry,
        )
        self.oversubscribed_gpus = Gauge(
            "tessera_extender_oversubscribed_gpus",
            "GPUs holding at least one best-effort grant placed against measured use",
            registry=self.registry,
        )

        for verb in get_args(VerbName):
            self.latency.labels(verb)
        for name, values in LABEL_VALUES.items():
            counter = getattr(self, name)
            for value in values:
                counter.labels(value)

    def count_rejections(self, by_reason: Mapping[str, int]) -> None:
        for reason, n in by_reason.items():
            self.node_rejections.labels(reason).inc(n)
