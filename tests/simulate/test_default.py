"""The embedded default: reproducible from its generator, and true to the trace's published statistics."""

from __future__ import annotations

import statistics
from importlib import resources

from simulator import generate_default
from simulator.inputs import load_default


def test_shipped_default_is_what_the_generator_writes() -> None:
    shipped = (resources.files("simulator") / "data" / "default.yaml").read_text(encoding="utf-8")
    assert shipped == generate_default.render()


def test_default_follows_the_trace_statistics() -> None:
    inputs = load_default()
    pods = inputs.workload.pods
    gpu_pods = [p for p in pods if p.num_gpu]
    fractional = [p for p in gpu_pods if p.fractional]
    # Published: 43.6% of GPU pods ask a fraction of a GPU, median 0.47 GPU; 13.3% ask none.
    assert abs(len(fractional) / len(gpu_pods) - 0.436) < 0.03
    assert statistics.median(p.gpu_milli for p in fractional) in (460, 470, 480)
    assert abs(1 - len(gpu_pods) / len(pods) - 0.133) < 0.03
    assert any(p.num_gpu == 8 for p in pods)
    models = {n.model for n in inputs.cluster.nodes}
    assert models == {"A10", "G2", "G3", "P100", "T4", "V100M16", "V100M32"}
    g2_share = sum(n.gpus for n in inputs.cluster.nodes if n.model == "G2") / inputs.cluster.total_gpus
    assert 0.65 < g2_share < 0.75  # 4,392 of the trace's 6,212 GPUs
    assert inputs.workload.timed
    assert [p.arrival for p in pods] == sorted(p.arrival for p in pods)
