"""Argument types shared by Tessera's command lines: each refuses bad input with a message naming
the value (argparse adds the option's name)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

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
