"""`tessera sandbox`: a local cluster with a real kubelet and containerd running pods on fake GPUs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from sandbox import cluster, demo, fakenode, install, nodelife, record
from sandbox.controlplane import DRA_K8S_VERSION, K8S_VERSION, ControlPlaneError
from sandbox.layout import DEFAULT_ROOT
from sandbox.processes import StartError
from tessera.cliargs import port


def _progress(message: str) -> None:
    print(f"sandbox: {message}", file=sys.stderr, flush=True)


def _options(args: argparse.Namespace, mode: record.Mode = "deviceplugin") -> cluster.Options:
    options = cluster.Options(
        root=args.dir,
        node=args.node or cluster.default_node_name(),
        kubelet_port=args.kubelet_port,
        kubelet_healthz_port=args.kubelet_healthz_port,
        timeout=args.timeout,
        values=tuple(args.set),
    )
    return cluster.in_mode(options, mode)


def _demo(args: argparse.Namespace) -> int:
    try:
        demo.run(_options(args), keep=args.keep)
    except (StartError, ControlPlaneError) as e:
        print(f"tessera sandbox demo: {e}", file=sys.stderr)
        return 1
    return 0


def _node_gpus(text: str) -> tuple[str, ...]:
    """``--node-gpus a100,t4``: one further node's GPU models."""
    models = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in models if m not in fakenode.PRESETS]
    if not models or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a comma-separated list of GPU models, each one of "
            + ", ".join(sorted(fakenode.PRESETS))
        )
    return models


def _up(args: argparse.Namespace) -> int:
    options = dataclasses.replace(
        _options(args, args.mode),
        monitoring=args.monitoring,
        nodes=args.nodes,
        node_gpus=tuple(args.node_gpus),
    )
    try:
        state = cluster.up(options, report=_progress)
    except (StartError, ControlPlaneError) as e:
        print(f"tessera sandbox up: {e}", file=sys.stderr)
        return 1
    names = ", ".join([state.node, *(n.name for n in state.nodes)])
    print(f"sandbox ready in {state.ready_seconds:.1f}s: node(s) {names}, apiserver {state.api_url}")
    print(f"Tessera installed by helm in namespace {install.NAMESPACE}; logs in {args.dir / 'logs'}")
    print(f"export KUBECONFIG={state.kubeconfig}")
    print(f"export PATH={options.kubernetes_bin}:$PATH   # kubectl")
    if state.prometheus_url:
        print(f"Prometheus (discovering Tessera's pods, with its alerts): {state.prometheus_url}")
    return 0


def _down(args: argparse.Namespace) -> int:
    left = cluster.down(args.dir, report=_progress)
    if left:
        print("tessera sandbox down: left on the host:", file=sys.stderr)
        for item in left:
            print(f"  - {item}", file=sys.stderr)
        return 1
    print("sandbox down: nothing left on the host")
    return 0


def _restart(args: argparse.Namespace) -> int:
    try:
        if args.component == cluster.AGENT:
            pod = cluster.replace_agent(args.dir)
            print(
                f"{cluster.AGENT}: the DaemonSet's new pod {pod} registered; the node's GPU slices are back"
            )
            return 0
        process = cluster.restart(args.dir, args.component)
    except (StartError, KeyError, ValueError) as e:
        print(f"tessera sandbox restart: {e}", file=sys.stderr)
        return 1
    if process.name in cluster.RESTARTABLE_AS_RECORDED:
        print(f"{process.name} restarted (pid {process.pid}) and healthy")
    else:
        print(f"{process.name} restarted (pid {process.pid}); the node's GPU slices are back")
    return 0


def _add_node(args: argparse.Namespace) -> int:
    try:
        cluster.add_node(args.dir, args.name, args.gpu)
    except (StartError, ValueError) as e:
        print(f"tessera sandbox add-node: {e}", file=sys.stderr)
        return 1
    print(f"node {args.name} added with {', '.join(args.gpu)} (no kubelet: pods bound there stay Pending)")
    return 0


NODE_COMMANDS = {
    "stop": (nodelife.stop_node, "stopped: its kubelet, containerd, kube-proxy and pods killed"),
    "start": (nodelife.start_node, "started again and Ready"),
    "partition": (nodelife.partition_node, "cut off from the control plane"),
    "heal": (nodelife.heal_node, "joined to the control plane again"),
}


def _node(args: argparse.Namespace) -> int:
    change, done = NODE_COMMANDS[args.action]
    try:
        change(args.dir, args.name)
    except StartError as e:
        print(f"tessera sandbox node {args.action}: {e}", file=sys.stderr)
        return 1
    print(f"node {args.name}: {done}")
    return 0


def _print_status(status: dict[str, Any]) -> None:
    if not status["up"]:
        print("sandbox: not up")
        return
    print("processes:")
    for name, state in status["processes"].items():
        print(f"  {name:<28} {state}")
    models = {}
    print("nodes:")
    for node in status["nodes"]:
        ready = "Ready" if node["ready"] else "NotReady"
        power = "stopped" if node.get("stopped") else "partitioned" if node.get("partitioned") else ""
        where = node["address"]
        print(
            f"  {node['name']:<28} {ready:<9} {where:<12} {node['slices']} slices  {power}"
            f" {node.get('error', '')}"
        )
        for gpu in node["gpus"]:
            models[gpu["uuid"]] = gpu["model"]
            print(f"    {gpu['uuid']}  {gpu['model']}  {gpu['memory_mib']} MiB")
    print("pods:")
    for pod in status["pods"]:
        where = pod["node"] or "-"
        print(
            f"  {pod['namespace'] + '/' + pod['name']:<40} {pod['phase']:<10} {where}  {pod.get('error', '')}"
        )
        for share in pod["gpus"]:
            model = models.get(share["uuid"], share["uuid"])
            print(f"    {share['container']}: {model}  {share['memory_mib']} MiB  {share['cores']}% of time")


def _status(args: argparse.Namespace) -> int:
    status = cluster.status(args.dir)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        _print_status(status)
    return 0 if status["up"] else 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sandbox",
        help="a local cluster: real containerd, kubelet and control plane, pods on fake GPUs (root)",
        description="Run the whole Tessera path on this machine. Needs root; see docs/sandbox.md.",
    )
    commands = parser.add_subparsers(dest="sandbox_command", required=True, metavar="SUBCOMMAND")

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--dir", type=Path, default=DEFAULT_ROOT, help=f"the sandbox's directory (default {DEFAULT_ROOT})"
        )

    def starting(sub: argparse.ArgumentParser) -> None:
        common(sub)
        sub.add_argument("--node", help="node name; must resolve to 127.0.0.1 (default: this host's name)")
        sub.add_argument("--kubelet-port", type=port, default=10250)
        sub.add_argument("--kubelet-healthz-port", type=port, default=10248)
        sub.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for each component")
        sub.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a chart value for Tessera's install, as helm --set (repeatable), "
            "on top of deploy/sandbox-values.yaml",
        )

    up = commands.add_parser("up", help="start the sandbox and wait until the node is ready")
    starting(up)
    up.add_argument(
        "--monitoring",
        action="store_true",
        help="also run Prometheus on the host, discovering Tessera's pods through the API server "
        "(hack/prometheus-binaries.sh builds it; docs/observability.md)",
    )
    up.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="how many nodes, each a kubelet with its own containerd (the first in the host's "
        "network, the others each in network and mount namespaces of their own; docs/sandbox.md)",
    )
    up.add_argument(
        "--node-gpus",
        action="append",
        type=_node_gpus,
        default=[],
        metavar="MODEL,MODEL",
        help="the GPU models of the next further node (repeat for each, in order; default: "
        f"{' / '.join(','.join(g) for g in nodelife.DEFAULT_GPUS)} in turn; the first node has an A100 "
        "and a T4)",
    )
    up.add_argument(
        "--mode",
        choices=record.MODES,
        default="deviceplugin",
        help="the chart's node agent: the device plugin with the extender on Kubernetes "
        f"{K8S_VERSION} and the host's containerd (default), or the DRA driver on Kubernetes "
        f"{DRA_K8S_VERSION} with the containerd 2 hack/k8s-binaries.sh builds (docs/dra.md), or mixed: "
        "the DRA driver on the last node, the device plugin on the others, on the DRA path's "
        'Kubernetes (--nodes 2 or more; docs/dra.md, "One mode per node")',
    )
    up.set_defaults(func=_up)

    demo_parser = commands.add_parser(
        "demo", help="up, apply deploy/examples/, show placements and the hook's refusals, down"
    )
    starting(demo_parser)
    demo_parser.add_argument("--keep", action="store_true", help="leave the sandbox up afterwards")
    demo_parser.set_defaults(func=_demo)

    down = commands.add_parser("down", help="stop everything and remove what the sandbox left on the host")
    common(down)
    down.set_defaults(func=_down)

    restart = commands.add_parser(
        "restart",
        help="restart a component under running pods: the kubelet, the node agent (its pod is "
        "replaced by the DaemonSet), kube-controller-manager, kube-proxy or CoreDNS; a further "
        "node's kubelet, containerd or kube-proxy as NODE/COMPONENT",
    )
    common(restart)
    restart.add_argument(
        "component",
        help=f"one of {', '.join((*cluster.RESTARTABLE, cluster.AGENT))}, or NODE/"
        f"{{{','.join(nodelife.RESTARTABLE)}}}",
    )
    restart.set_defaults(func=_restart)

    add_node = commands.add_parser(
        "add-node", help="add a node with a GPU inventory but no kubelet, to see placement across nodes"
    )
    common(add_node)
    add_node.add_argument("name", help="node name")
    add_node.add_argument(
        "--gpu",
        action="append",
        required=True,
        choices=sorted(fakenode.PRESETS),
        help="a GPU model; repeat for several GPUs",
    )
    add_node.set_defaults(func=_add_node)

    node = commands.add_parser(
        "node",
        help="stop a further node as a power loss would, start it again, cut it off from the control "
        "plane or join it again",
    )
    common(node)
    node.add_argument("action", choices=tuple(NODE_COMMANDS))
    node.add_argument("name", help="a node after the first (`status` lists them)")
    node.set_defaults(func=_node)

    status = commands.add_parser("status", help="processes, nodes, GPUs, slices and pods")
    common(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_status)
