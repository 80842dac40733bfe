"""``tessera-extender``: the scheduler extender's command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import uvicorn
from kubernetes.config import ConfigException

from extender.app import create_app
from extender.kube import KubeApi, load_configuration
from extender.metrics import Metrics
from extender.server import Limits, uvicorn_options
from extender.service import DEFAULT_SCHEDULER_NAME, Extender
from extender.state import ClusterState
from extender.watch import Watcher
from tessera.cliargs import seconds
from tessera.contract import DEFAULT_DOMAIN, DOMAIN_ENV, KEYS, ContractError, Policy, keys_for, now
from tessera.inflight import DEFAULT_INFLIGHT_TIMEOUT
from tessera.placement import PlacementEngine, SpeedProfiles

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera-extender", description="kube-scheduler extender placing fractional-GPU pods."
    )
    parser.add_argument(
        "--listen",
        type=_listen,
        default=("127.0.0.1", 8888),
        metavar="HOST:PORT",
        help="address to serve on (default 127.0.0.1:8888)",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then ~/.kube/config)")
    parser.add_argument(
        "--policy",
        default=Policy.BINPACK.value,
        choices=[policy.value for policy in Policy],
        help="placement policy for pods without a policy annotation (default binpack)",
    )
    parser.add_argument(
        "--speed-profiles",
        type=Path,
        metavar="FILE",
        help="speed profiles YAML (deploy/speed-profiles.yaml); without it every GPU counts 1.0",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=60.0,
        metavar="SECONDS",
        help="a node whose device-plugin heartbeat is older gets no new pods (default 60)",
    )
    parser.add_argument(
        "--inflight-timeout",
        type=seconds,
        default=DEFAULT_INFLIGHT_TIMEOUT.total_seconds(),
        metavar="SECONDS",
        help="pods bound longer ago than this are no longer in flight: the in-flight rule ignores them "
        "(the same value as the device plugin's --inflight-timeout; default %(default)g)",
    )
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
        "--domain",
        default=None,
        help=f"resource and annotation domain (default ${DOMAIN_ENV} or {DEFAULT_DOMAIN})",
    )
    defaults = Limits()
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.max_body_bytes,
        metavar="BYTES",
        help="largest request body taken; a larger one gets 413 (default %(default)d)",
    )
    parser.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=defaults.max_buffered_bytes,
        metavar="BYTES",
        help="request bodies held at once, all connections together; past it a request gets 503 "
        "(default %(default)d)",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=int,
        default=defaults.max_header_bytes,
        metavar="BYTES",
        help="largest request head (request line and headers) taken (default %(default)d)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
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
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    for handler in logging.getLogger().handlers:
        handler.setFormatter(CutFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    try:
        keys = keys_for(args.domain) if args.domain else KEYS
        profiles = SpeedProfiles()
        if args.speed_profiles is not None:
            profiles = SpeedProfiles.from_yaml(args.speed_profiles.read_text())
    except (ContractError, OSError) as e:
        print(f"tessera-extender: {e}", file=sys.stderr)
        return 2
    engine = PlacementEngine(profiles, default_policy=Policy(args.policy))
    state = ClusterState(engine, keys, heartbeat_timeout=timedelta(seconds=args.heartbeat_timeout))
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
    app = create_app(extender, Watcher(kube, state, clock=now), limits)
    host, port = args.listen
    log.info(
        "serving on %s:%d, policy %s, filter keeps %s, domain %s",
        host,
        port,
        args.policy,
        args.filter_keeps,
        keys.domain,
    )
    # uvloop: with the verbs answered straight from ASGI messages, it cut the extender's CPU per
    # scheduled pod by about a fifth against the stdlib loop (docs/benchmarks.md, Extender).
    # No proxy headers: kube-scheduler calls the extender directly, and the middleware that would
    # read them is one more layer on every verb.
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=False,
        loop="uvloop",
        proxy_headers=False,
        **uvicorn_options(limits),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
