"""``tessera-extender``: the scheduler extender's command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import ssl
import sys
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import uvicorn
import uvloop
from kubernetes.config import ConfigException

from extender.app import ExtenderApp, create_app
from extender.binding import DEFAULT_SCHEDULER_NAME
from extender.kube import KubeApi, load_configuration
from extender.leader import LeaderLease
from extender.metrics import Metrics
from extender.resizing import Resizer
from extender.server import Limits, uvicorn_options
from extender.service import Extender
from extender.state import ClusterState
from extender.watch import Watcher
from tessera.cliargs import (
    REVIEWED_SCRAPES,
    add_domain,
    add_inflight_timeout,
    add_kubeconfig,
    add_metrics_authorization,
    add_qos_class_flags,
    add_speed_profiles,
    non_negative_int,
    percent,
    positive_int,
    qos_thresholds,
    seconds,
)
from tessera.contract import ContractError, Policy, keys_for, now
from tessera.placement import PlacementEngine, SpeedProfiles, UsageRule
from tessera.placement.usage import MARGIN_MIB, MARGIN_PERCENT, MAX_AGE
from tessera.scrapeauth import AccessCache

log = logging.getLogger("tessera.extender")


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


# The longest log line written: a request's content can reach a message, never megabytes of it.
MAX_LOG_LINE = 4000


class CutFormatter(logging.Formatter):
    """Log lines cut to ``MAX_LOG_LINE`` characters (a traceback's last lines kept)."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if len(line) <= MAX_LOG_LINE:
            return line
        half = MAX_LOG_LINE // 2
        return f"{line[:half]} [... {len(line) - 2 * half} characters cut ...] {line[-half:]}"


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="tessera-extender", description="kube-scheduler extender placing fractional-GPU pods."
    )
    add_kubeconfig(parser, None, "default: in-cluster, then ~/.kube/config")
    add_domain(parser, environ)
    _add_placement_flags(parser, environ)
    _add_qos_flags(parser)
    _add_serving_flags(parser)
    return parser


def _add_placement_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """How pods are placed and bound, and when this replica binds at all."""
    parser.add_argument(
        "--policy",
        default=Policy.BINPACK.value,
        choices=[policy.value for policy in Policy],
        help="placement policy for pods without a policy annotation (default binpack)",
    )
    add_speed_profiles(parser, None)
    parser.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=60.0,
        metavar="SECONDS",
        help="a node whose device-plugin heartbeat is older gets no new pods (default 60)",
    )
    add_inflight_timeout(parser, None)
    parser.add_argument(
        "--inflight-wait",
        type=seconds,
        default=2.0,
        metavar="SECONDS",
        help="how long a bind waits for other pods in flight on its node to be served before it fails "
        "(default 2; kube-scheduler gives a bind its httpTimeout, 5 s by default)",
    )
    parser.add_argument(
        "--filter-keeps",
        default="best",
        choices=["best", "all"],
        help="best: filter answers only the nodes with the top score, for a scheduler configured "
        "without prioritizeVerb (deploy/scheduler-config.yaml); all: every node that fits, for one "
        "that weighs the prioritize score against its own (default best)",
    )
    parser.add_argument(
        "--scheduler-name",
        action="append",
        dest="scheduler_names",
        metavar="NAME",
        help="bind only pods whose spec.schedulerName is NAME, the scheduler profile that calls this "
        f"extender (repeat for several; default {DEFAULT_SCHEDULER_NAME})",
    )
    parser.add_argument(
        "--leader-lease",
        metavar="NAMESPACE/NAME",
        help="the leader-election Lease of the kube-scheduler in this pod: bind only while it holds it "
        "(with --pod-name; the chart sets both). Unset: bind whenever called",
    )
    parser.add_argument(
        "--pod-name",
        default=environ.get("POD_NAME", ""),
        help="this pod's name, as kube-scheduler's Lease holder identity begins (env POD_NAME)",
    )


def _add_qos_flags(parser: argparse.ArgumentParser) -> None:
    """Which class a pod is in, and how best-effort pods may be placed against measured use."""
    add_qos_class_flags(parser)
    parser.add_argument(
        "--best-effort-oversubscription",
        action="store_true",
        help="place a best-effort pod that fits nowhere by requests against the GPUs' measured use "
        "(the node agent's tessera.io/gpu-usage annotation) plus a safety margin; off by default "
        "(docs/placement.md, 'Usage-aware placement of best-effort pods')",
    )
    parser.add_argument(
        "--best-effort-margin-mib",
        type=non_negative_int,
        default=MARGIN_MIB,
        metavar="MIB",
        help="the safety margin on top of a GPU's measured use is at least this (default %(default)d)",
    )
    parser.add_argument(
        "--best-effort-margin-percent",
        type=percent,
        default=MARGIN_PERCENT,
        metavar="PERCENT",
        help="... and at least this percent of the GPU's memory (default %(default)g)",
    )
    parser.add_argument(
        "--best-effort-usage-max-age",
        type=seconds,
        default=MAX_AGE.total_seconds(),
        metavar="SECONDS",
        help="a node's measured use that holds as of neither its own time nor the node's heartbeat "
        "within this many seconds allows no placement against it (default %(default)g)",
    )


def _add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """Where and how the verbs, health and metrics are served: address, request limits, TLS, logs."""
    parser.add_argument(
        "--listen",
        type=_listen,
        default=("127.0.0.1", 8888),
        metavar="HOST:PORT",
        help="address to serve on (default 127.0.0.1:8888)",
    )
    add_metrics_authorization(parser, REVIEWED_SCRAPES)
    defaults = Limits()
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=defaults.max_body_bytes,
        metavar="BYTES",
        help="largest request body taken; a larger one gets 413 (default %(default)d)",
    )
    parser.add_argument(
        "--max-buffered-bytes",
        type=positive_int,
        default=defaults.max_buffered_bytes,
        metavar="BYTES",
        help="request bodies held at once, all connections together; past it a request gets 503 "
        "(default %(default)d)",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=positive_int,
        default=defaults.max_header_bytes,
        metavar="BYTES",
        help="largest request head (request line and headers) taken (default %(default)d)",
    )
    parser.add_argument(
        "--max-connections",
        type=positive_int,
        default=defaults.max_connections,
        metavar="N",
        help="open connections; past it the oldest not yet answered (else idle) is closed "
        "(default %(default)d)",
    )
    parser.add_argument(
        "--header-timeout",
        type=seconds,
        default=defaults.header_timeout,
        metavar="SECONDS",
        help="a request's headers must arrive within this of the connection or of the request's "
        "start (default %(default)g)",
    )
    parser.add_argument(
        "--body-timeout",
        type=seconds,
        default=defaults.body_timeout,
        metavar="SECONDS",
        help="a request's body must arrive within this of its headers (default %(default)g)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=seconds,
        default=defaults.keep_alive_timeout,
        metavar="SECONDS",
        help="an idle kept-alive connection is closed after this (default %(default)g)",
    )
    parser.add_argument(
        "--tls-cert-file",
        metavar="FILE",
        help="serve HTTPS with this certificate (PEM); kube-scheduler's extender config then needs "
        "enableHTTPS and a tlsConfig",
    )
    parser.add_argument("--tls-key-file", metavar="FILE", help="the private key of --tls-cert-file (PEM)")
    parser.add_argument(
        "--client-ca-file",
        metavar="FILE",
        help="with --tls-cert-file: accept only clients presenting a certificate this CA signed "
        "(kube-scheduler's tlsConfig certFile)",
    )
    parser.add_argument(
        "--health-listen",
        type=_listen,
        default=None,
        metavar="HOST:PORT",
        help="also serve /healthz, /readyz and /metrics (not the verbs) on plain HTTP here, for "
        "probes and Prometheus when the verbs need a client certificate",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        parser.error("--tls-cert-file and --tls-key-file go together")
    if args.client_ca_file and not args.tls_cert_file:
        parser.error("--client-ca-file needs --tls-cert-file")
    try:
        thresholds = qos_thresholds(args)
        usage_rule = UsageRule(
            margin_mib=args.best_effort_margin_mib,
            margin_percent=args.best_effort_margin_percent,
            max_age=timedelta(seconds=args.best_effort_usage_max_age),
        )
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper())
    for handler in logging.getLogger().handlers:
        handler.setFormatter(CutFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    try:
        keys = keys_for(args.domain)
        profiles = SpeedProfiles()
        if args.speed_profiles is not None:
            profiles = SpeedProfiles.from_yaml(args.speed_profiles.read_text())
    except (ContractError, OSError) as e:
        print(f"tessera-extender: {e}", file=sys.stderr)
        return 2
    leader = None
    if args.leader_lease:
        namespace, _, name = args.leader_lease.partition("/")
        if not (namespace and name and args.pod_name):
            print(
                f"tessera-extender: --leader-lease {args.leader_lease!r} must be NAMESPACE/NAME, and "
                "--pod-name (or env POD_NAME) must be set with it",
                file=sys.stderr,
            )
            return 2
        leader = LeaderLease(namespace, name, args.pod_name)
    engine = PlacementEngine(profiles, default_policy=Policy(args.policy))
    state = ClusterState(
        engine,
        keys,
        heartbeat_timeout=timedelta(seconds=args.heartbeat_timeout),
        usage_rule=usage_rule if args.best_effort_oversubscription else None,
    )
    try:
        kube = KubeApi(load_configuration(args.kubeconfig))
    except (ConfigException, OSError) as e:
        print(f"tessera-extender: cannot load the Kubernetes client configuration: {e}", file=sys.stderr)
        return 2
    metrics = Metrics()
    extender = Extender(
        state,
        kube,
        keys,
        metrics,
        inflight_timeout=timedelta(seconds=args.inflight_timeout),
        clock=now,
        inflight_wait=timedelta(seconds=args.inflight_wait),
        filter_keeps_best=args.filter_keeps == "best",
        scheduler_names=frozenset(args.scheduler_names or [DEFAULT_SCHEDULER_NAME]),
        qos_thresholds=thresholds,
        leader=leader,
    )
    limits = Limits(
        max_body_bytes=args.max_body_bytes,
        max_buffered_bytes=args.max_buffered_bytes,
        max_header_bytes=args.max_header_bytes,
        max_connections=args.max_connections,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
    )
    resizer = Resizer(state, kube, keys, metrics, clock=now, leads=extender.leads)
    scrapes = AccessCache() if args.metrics_authorization == REVIEWED_SCRAPES else None
    app = create_app(extender, Watcher(kube, state, clock=now, resizer=resizer), limits, scrapes)
    host, port = args.listen
    log.info(
        "serving on %s:%d, policy %s, filter keeps %s, domain %s",
        host,
        port,
        args.policy,
        args.filter_keeps,
        keys.domain,
    )
    if args.best_effort_oversubscription:
        log.info(
            "best-effort pods may be placed against measured use: margin max(%d MiB, %g%%), max age %g s",
            usage_rule.margin_mib,
            usage_rule.margin_percent,
            usage_rule.max_age.total_seconds(),
        )
    # uvloop: with the verbs answered straight from ASGI messages, it cut the extender's CPU per
    # scheduled pod by about a fifth against the stdlib loop (docs/benchmarks.md, Extender).
    # No proxy headers: kube-scheduler calls the extender directly, and the middleware that would
    # read them is one more layer on every verb.
    common: dict[str, Any] = {"log_level": args.log_level, "access_log": False, "proxy_headers": False}
    tls: dict[str, Any] = {}
    if args.tls_cert_file:
        # kube-scheduler's extender tlsConfig (certFile, keyFile, caFile): only a client holding a
        # certificate signed by --client-ca-file gets past the handshake.
        tls = {"ssl_certfile": args.tls_cert_file, "ssl_keyfile": args.tls_key_file}
        if args.client_ca_file:
            tls |= {"ssl_ca_certs": args.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    if args.health_listen is None:
        uvicorn.run(app, host=host, port=port, loop="uvloop", **common, **tls, **uvicorn_options(limits))
        return 0
    verbs = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, **common, **tls, **uvicorn_options(limits))
    )
    health_host, health_port = args.health_listen
    health = _QuietServer(
        uvicorn.Config(
            ExtenderApp(app.api, {}, limits),  # health, readiness and metrics only: no verbs
            host=health_host,
            port=health_port,
            lifespan="off",  # the verbs' server runs the watches
            **common,
            **uvicorn_options(limits),
        )
    )
    log.info("health, readiness and metrics also on plain HTTP at %s:%d", health_host, health_port)
    uvloop.run(_serve_both(verbs, health))
    return 0


class _QuietServer(uvicorn.Server):
    """A second server in the process: the first one handles the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_both(verbs: uvicorn.Server, health: uvicorn.Server) -> None:
    health_task = asyncio.create_task(health.serve())
    try:
        await verbs.serve()
    finally:
        health.should_exit = True
        await health_task


if __name__ == "__main__":
    sys.exit(main())
