"""`tessera sandbox demo`: the whole path in one command. Brings the sandbox up (Tessera installed by
its Helm chart), shows Tessera's pods, applies the pods of deploy/examples/, shows where they ran and
what the hook let each container have (a busybox probe and a user's Python image with NVIDIA's own
clients), shows the pod that fits nowhere with the extender's reason, and brings the sandbox down
(unless ``--keep``)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

import yaml
from kubernetes import client

from sandbox import cluster, gpu, install, record
from sandbox.processes import StartError

EXAMPLES = gpu.REPO / "deploy" / "examples"
EXAMPLE_FILES = ("shared-gpu.yaml", "python-workload.yaml", "too-big.yaml")
NAMESPACE = "default"


def example_pods() -> list[dict[str, Any]]:
    return [doc for f in EXAMPLE_FILES for doc in yaml.safe_load_all((EXAMPLES / f).read_text()) if doc]


def _probe_report(core: client.CoreV1Api, name: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = core.read_namespaced_pod(name, NAMESPACE)
        if pod.status.phase in ("Running", "Succeeded"):
            text: str = core.read_namespaced_pod_log(name, NAMESPACE)
            if "refused_with=" in text:
                return text
        time.sleep(0.5)
    raise StartError(f"pod {name}: no probe report after {timeout:.0f}s")


def _scheduling_reason(core: client.CoreV1Api, name: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = core.list_namespaced_event(NAMESPACE, field_selector=f"involvedObject.name={name}").items
        reasons = [e.message for e in events if e.reason == "FailedScheduling"]
        if reasons:
            return str(reasons[-1])
        time.sleep(0.5)
    raise StartError(f"pod {name}: no FailedScheduling event after {timeout:.0f}s")


def _kubectl(options: cluster.Options, kubeconfig: str, *args: str) -> str:
    """The real kubectl's output, as a user would see it."""
    done = subprocess.run(
        [str(options.kubernetes_bin / "kubectl"), f"--kubeconfig={kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stdout if done.returncode == 0 else f"kubectl {' '.join(args)}: {done.stderr.strip()}"


def run(
    options: cluster.Options, keep: bool, say: Callable[[str], None] = print, timeout: float = 120
) -> None:
    state = cluster.up(options, report=lambda m: say(f"  starting {m}"))
    say(f"sandbox up in {state.ready_seconds:.1f}s (node {state.node}, two fake GPUs: A100 40 GB, T4 16 GB)")
    try:
        say(f"\nTessera, installed by helm (kubectl get pods -n {install.NAMESPACE}):")
        say(_kubectl(options, state.kubeconfig, "get", "pods", "-n", install.NAMESPACE).rstrip())
        api = record.api_client(state)
        try:
            core = client.CoreV1Api(api)
            pods = example_pods()
            for pod in pods:
                core.create_namespaced_pod(NAMESPACE, pod)
                say(f"applied pod {pod['metadata']['name']} (deploy/examples/)")
            running = [p["metadata"]["name"] for p in pods if p["metadata"]["name"] != "too-big"]
            reports = {name: _probe_report(core, name, timeout) for name in running}
            reason = _scheduling_reason(core, "too-big", timeout)
        finally:
            api.close()
        say("\nwhere they ran (tessera sandbox status):")
        status = cluster.status(options.root)
        models = {g["uuid"]: g["model"] for n in status["nodes"] for g in n["gpus"]}
        for pod in (p for p in status["pods"] if p["namespace"] == NAMESPACE):
            shares = ", ".join(
                f"{models.get(g['uuid'], g['uuid'])} {g['memory_mib']} MiB {g['cores']}%" for g in pod["gpus"]
            )
            say(f"  {pod['name']:<10} {pod['phase']:<8} node {pod['node'] or '-':<6} {shares}")
        for name, text in reports.items():
            say(f"\n{name}: inside the container the hook reports its quota as the GPU's memory and")
            say(
                "refuses the allocation that would pass it (refused_with: CUDA_ERROR_OUT_OF_MEMORY, error 2):"
            )
            say("\n".join(f"  {line}" for line in text.strip().splitlines()))
        say(f"\ntoo-big stays Pending; the extender's reason:\n  {reason}")
    finally:
        if keep:
            say(f"\nleft up: export KUBECONFIG={state.kubeconfig}")
            say(f"bring it down with: tessera sandbox down --dir {options.root}")
        else:
            left = cluster.down(options.root, report=lambda _: None)
            say("\nsandbox down: " + ("nothing left on the host" if not left else f"LEFT: {left}"))
