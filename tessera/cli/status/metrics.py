"""The node agent's metrics (Prometheus text exposition) added to a node of the report: the device
plugin's, or the DRA driver's (its claims' series carry the claim's name)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tessera.cli.status.report import NodeStatus


def add_metrics(node: NodeStatus, text: str) -> None:
    """Fills in what the node agent's exposition (``text``) says about the node's GPUs and pods."""
    by_uuid = {gpu.uuid: gpu for gpu in node.gpus}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            gpu = by_uuid.get(sample.labels.get("UUID", ""))
            if gpu is None:
                continue
            if sample.name == "tessera_gpu_memory_used_bytes":
                gpu.memory_used_bytes = int(sample.value)
            elif sample.name == "tessera_gpu_utilization_ratio":
                gpu.utilization_ratio = float(sample.value)
            elif sample.name == "tessera_container_memory_used_bytes" and sample.labels.get("claim"):
                named = (sample.labels.get("namespace"), sample.labels["claim"])
                for claim in gpu.claims:
                    if (claim.namespace, claim.claim) == named:
                        claim.memory_used_bytes = int(sample.value)
            elif sample.name == "tessera_container_memory_used_bytes":
                for pod in gpu.pods:
                    if (pod.namespace, pod.pod, pod.container) == (
                        sample.labels.get("namespace"),
                        sample.labels.get("pod"),
                        sample.labels.get("container"),
                    ):
                        pod.memory_used_bytes = int(sample.value)
    node.metrics = "ok"
