"""What Tessera's command lines share: argument types, each refusing bad input with a message naming
the value (argparse adds the option's name), and the flags both the extender and the node agents take,
each declared here once."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from tessera.contract import DEFAULT_DOMAIN, DOMAIN_ENV
from tessera.inflight import DEFAULT_INFLIGHT_TIMEOUT
from tessera.placement.qos import BEST_EFFORT_PRIORITY, LATENCY_CRITICAL_PRIORITY, QosThresholds

Number = TypeVar("Number", int, float)


def _parse(text: str, convert: Callable[[str], Number], what: str) -> Number:
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    value = _parse(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    value = _parse(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 0")
    return value


def positive_number(text: str) -> float:
    value = _parse(text, float, "a number")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def percent(text: str) -> float:
    value = _parse(text, float, "a number")
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 0..100")
    return value


def seconds(text: str) -> float:
    value = _parse(text, float, "a number of seconds")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 seconds")
    return value


def _port_in(text: str, lowest: int) -> int:
    value = _parse(text, int, "a port number")
    if not lowest <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is outside {lowest}..65535")
    return value


def port(text: str) -> int:
    return _port_in(text, 1)


def port_or_zero(text: str) -> int:
    """A port, or 0 for any free port."""
    return _port_in(text, 0)


# --metrics-authorization's values: a scrape of /metrics is reviewed by the API server
# (tessera.scrapeauth), or not.
REVIEWED_SCRAPES = "kubernetes"
OPEN_SCRAPES = "none"


def add_metrics_authorization(parser: argparse.ArgumentParser, default: str, env_note: str = "") -> None:
    """``--metrics-authorization``, as the node agent and the extender both take it; ``env_note``
    names the environment variable that sets its default, if one does."""
    parser.add_argument(
        "--metrics-authorization",
        choices=(REVIEWED_SCRAPES, OPEN_SCRAPES),
        default=default,
        help=f"who may scrape /metrics: {REVIEWED_SCRAPES} (a bearer token whose user the API server "
        "allows get on /metrics; the chart binds tessera-metrics-reader) or "
        f"{OPEN_SCRAPES} (anyone who reaches the port) ({env_note}default {REVIEWED_SCRAPES})",
    )


def add_domain(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """``--domain``: the prefix of every resource, annotation and label, and the DRA driver's name."""
    parser.add_argument(
        "--domain",
        default=environ.get(DOMAIN_ENV, DEFAULT_DOMAIN),
        help=f"resource, annotation and label domain, and the DRA driver's name (env {DOMAIN_ENV}, "
        f"default {DEFAULT_DOMAIN})",
    )


def add_kubeconfig(parser: argparse.ArgumentParser, default: str | None, unset: str) -> None:
    """``--kubeconfig``; ``unset`` says where the credentials come from without it."""
    parser.add_argument("--kubeconfig", type=Path, default=default, help=f"kubeconfig file ({unset})")


INFLIGHT_TIMEOUT_ENV = "TESSERA_INFLIGHT_TIMEOUT"


def add_inflight_timeout(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None) -> None:
    """``--inflight-timeout``, which the extender and the node agent must agree on; ``environ``: where
    its default comes from (the node agent's), None when no variable sets it (the extender's)."""
    default = f"{DEFAULT_INFLIGHT_TIMEOUT.total_seconds():g}"
    env_note = ""
    if environ is not None:
        default = environ.get(INFLIGHT_TIMEOUT_ENV, default)
        env_note = f"env {INFLIGHT_TIMEOUT_ENV}, "
    parser.add_argument(
        "--inflight-timeout",
        type=seconds,
        default=default,
        metavar="SECONDS",
        help="pods bound longer ago than this are no longer in flight: the extender's in-flight rule "
        "ignores them, and the node agent matches them after fresh ones (the extender and the node "
        f"agent take the same value; {env_note}default %(default)s)",
    )


def add_speed_profiles(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None) -> None:
    """``--speed-profiles``, the extender's and the DRA driver's; ``environ``: where its default comes
    from (the DRA driver's), None when no variable sets it (the extender's)."""
    env_note = "" if environ is None else "; env TESSERA_SPEED_PROFILES"
    parser.add_argument(
        "--speed-profiles",
        type=Path,
        default=None if environ is None else environ.get("TESSERA_SPEED_PROFILES") or None,
        metavar="FILE",
        help="speed profiles YAML (deploy/speed-profiles.yaml): each GPU model's speed, which the extender "
        "scores by and the DRA driver publishes as its devices' model and speedMilli attributes; "
        f"without it every GPU counts 1.0{env_note}",
    )


def add_qos_class_flags(parser: argparse.ArgumentParser) -> None:
    """Which QoS class a pod's priority grants, as the extender (at bind) and the DRA driver (at
    prepare, for the pods a claim is reserved for) both decide it; read with :func:`qos_thresholds`."""
    parser.add_argument(
        "--qos-latency-critical-priority",
        type=int,
        default=LATENCY_CRITICAL_PRIORITY,
        metavar="PRIORITY",
        help="a pod whose priority is at least this is granted latency-critical (default %(default)d)",
    )
    parser.add_argument(
        "--qos-latency-critical-namespaces",
        default="",
        metavar="NAMESPACE,...",
        help="namespaces whose pods (by the tessera.io/qos annotation) and claims (by qos in their "
        "GpuShareConfig) may ask for any QoS class; elsewhere they may only lower the class the "
        "priority grants (default: none)",
    )
    parser.add_argument(
        "--qos-best-effort-priority",
        type=int,
        default=BEST_EFFORT_PRIORITY,
        metavar="PRIORITY",
        help="a pod whose priority is below this is granted best-effort only "
        "(default %(default)d: a negative PriorityClass)",
    )


def qos_thresholds(args: argparse.Namespace) -> QosThresholds:
    """The flags of :func:`add_qos_class_flags`; a ValueError when the priorities are in the wrong order."""
    return QosThresholds(
        args.qos_latency_critical_priority,
        args.qos_best_effort_priority,
        frozenset(n.strip() for n in args.qos_latency_critical_namespaces.split(",") if n.strip()),
    )
