"""kube-scheduler's extender v1 JSON (``k8s.io/kube-scheduler/extender/v1``), checked on the way in.

The keys are the Go field names, PascalCase, and every field is always present (``null`` when
empty). Requests are validated here so that a malformed one gets HTTP 400 naming the field and the
value; the objects inside (Pod, Node) stay plain dicts in the API's camelCase shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class BadRequestError(ValueError):
    """A request kube-scheduler would never send; the message names what is wrong."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Kubernetes' own limits on names (a DNS subdomain; a namespace is a DNS label) and a UID's length
# (36): a longer one is in no request kube-scheduler sends, and is never sent to the API server.
MAX_NAME = 253
MAX_NAMESPACE = 63
MAX_UID = 128
_NodeName = Annotated[str, Field(max_length=MAX_NAME)]


class _Meta(_Wire):
    name: str = Field(min_length=1, max_length=MAX_NAME)
    namespace: str = Field(default="", max_length=MAX_NAMESPACE)
    uid: str = Field(default="", max_length=MAX_UID)
    annotations: dict[str, str] | None = None


class _Object(_Wire):
    metadata: _Meta


class _Pod(_Object):
    spec: dict[str, Any]


class _NodeList(_Wire):
    items: list[_Object] | None


class ExtenderArgs(_Wire):
    Pod: _Pod
    Nodes: _NodeList | None = None
    NodeNames: list[_NodeName] | None = None


class ExtenderBindingArgs(_Wire):
    PodName: str = Field(min_length=1, max_length=MAX_NAME)
    PodNamespace: str = Field(min_length=1, max_length=MAX_NAMESPACE)
    PodUID: str = Field(default="", max_length=MAX_UID)
    Node: str = Field(min_length=1, max_length=MAX_NAME)


@dataclass(frozen=True, slots=True)
class Victims:
    """One node's victims in a preempt call, as kube-scheduler's MetaVictims: pod UIDs (most
    important first) and how many of them break a PodDisruptionBudget."""

    uids: tuple[str, ...]
    budget_violations: int


class _MetaPod(_Wire):
    UID: str = Field(min_length=1, max_length=MAX_UID)


class _MetaVictims(_Wire):
    Pods: list[_MetaPod] | None = None
    NumPDBViolations: int = Field(default=0, ge=0)


class _Victims(_Wire):
    Pods: list[_Object] | None = None
    NumPDBViolations: int = Field(default=0, ge=0)


class ExtenderPreemptionArgs(_Wire):
    Pod: _Pod
    NodeNameToVictims: dict[_NodeName, _Victims | None] | None = None
    NodeNameToMetaVictims: dict[_NodeName, _MetaVictims | None] | None = None


def _describe(error: ValidationError) -> str:
    parts = []
    for err in error.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "missing":
            parts.append(f"{where}: missing")
            continue
        shown = json.dumps(err.get("input"), default=str)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        parts.append(f"{where}: {err['msg']} (got {shown})")
    return "; ".join(parts)


def _json(body: bytes) -> Any:
    if not body.strip():
        raise BadRequestError("request body is empty; expected a JSON object")
    try:
        return orjson.loads(body)  # bodies of thousands of node names: the fast decoder
    except orjson.JSONDecodeError:
        pass
    # The stdlib decoder's messages say more, and it takes what orjson refuses (NaN, lone surrogates).
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequestError(f"request body is not JSON: {e}") from None
    except RecursionError:
        raise BadRequestError("request body nests JSON too deeply (a Pod nests a few dozen levels)") from None
    _refuse_lone_surrogates(raw)
    return raw


def _refuse_lone_surrogates(raw: Any) -> None:
    """A BadRequestError naming the first field whose name or text holds a lone surrogate: no such
    string can be encoded into an answer or sent to the API server (UTF-8 has no surrogates). Only
    bodies orjson refused are walked; iterative, as such a body nests up to the stdlib's limit."""
    pending: list[tuple[str, Any]] = [("", raw)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, str):
            items: list[tuple[str, Any]] = []
            text = value
        elif isinstance(value, dict):
            items = [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
            text = "".join(value)
        elif isinstance(value, list):
            items = [(f"{where}.{i}" if where else str(i), v) for i, v in enumerate(value)]
            text = ""
        else:
            continue
        try:
            text.encode()
        except UnicodeEncodeError:
            field = cut(where or "body")
            raise BadRequestError(
                f"{field}: a string holds a lone UTF-16 surrogate (not valid UTF-8)"
            ) from None
        pending.extend(reversed(items))


def cut(text: str, limit: int = 200) -> str:
    """``text`` for a message, cut to ``limit`` characters, unencodable characters escaped."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode()


def parse_extender_args(body: bytes) -> tuple[dict[str, Any], list[str], list[dict[str, Any]] | None]:
    """(pod, node names, full node objects or None in node-names mode) of a filter/prioritize call."""
    raw = _json(body)
    if not isinstance(raw, dict):
        raise BadRequestError(f"request body must be a JSON object (ExtenderArgs), got {type(raw).__name__}")
    try:
        args = ExtenderArgs.model_validate(raw)
    except ValidationError as e:
        raise BadRequestError(_describe(e)) from None
    if args.NodeNames is not None:
        return raw["Pod"], args.NodeNames, None
    if args.Nodes is not None:
        nodes: list[dict[str, Any]] = raw["Nodes"].get("items") or []
        return raw["Pod"], [n["metadata"]["name"] for n in nodes], nodes
    raise BadRequestError("NodeNames and Nodes are both null; one of them must list the candidate nodes")


def parse_binding_args(body: bytes) -> ExtenderBindingArgs:
    raw = _json(body)
    if not isinstance(raw, dict):
        raise BadRequestError(
            f"request body must be a JSON object (ExtenderBindingArgs), got {type(raw).__name__}"
        )
    try:
        return ExtenderBindingArgs.model_validate(raw)
    except ValidationError as e:
        raise BadRequestError(_describe(e)) from None


def parse_preemption_args(body: bytes) -> tuple[dict[str, Any], dict[str, Victims]]:
    """(pod, node name -> (victims' UIDs, their PodDisruptionBudget violations)) of a preempt call:
    UIDs only (``NodeNameToMetaVictims``, kube-scheduler with ``nodeCacheCapable``) or whole pods
    (``NodeNameToVictims``)."""
    raw = _json(body)
    if not isinstance(raw, dict):
        raise BadRequestError(
            f"request body must be a JSON object (ExtenderPreemptionArgs), got {type(raw).__name__}"
        )
    try:
        args = ExtenderPreemptionArgs.model_validate(raw)
    except ValidationError as e:
        raise BadRequestError(_describe(e)) from None
    proposed: dict[str, Victims] = {}
    if args.NodeNameToMetaVictims is not None:
        for node, meta in args.NodeNameToMetaVictims.items():
            if meta is not None:
                proposed[node] = Victims(tuple(p.UID for p in meta.Pods or []), meta.NumPDBViolations)
    elif args.NodeNameToVictims is not None:
        for node, victims in args.NodeNameToVictims.items():
            if victims is not None:
                uids = tuple(p.metadata.uid for p in victims.Pods or [])
                proposed[node] = Victims(uids, victims.NumPDBViolations)
    else:
        raise BadRequestError(
            "NodeNameToVictims and NodeNameToMetaVictims are both null; one of them must list the victims"
        )
    return raw["Pod"], proposed


def preemption_result(victims: Mapping[str, Victims]) -> bytes:
    """ExtenderPreemptionResult: per node, the victims' UIDs (kube-scheduler finds the pods by UID
    on that node) and their PodDisruptionBudget violations."""
    return orjson.dumps(
        {
            "NodeNameToMetaVictims": {
                node: {"Pods": [{"UID": uid} for uid in v.uids], "NumPDBViolations": v.budget_violations}
                for node, v in victims.items()
            }
        }
    )


def filter_result(
    passed: list[str],
    failed: dict[str, str],
    unresolvable: dict[str, str],
    nodes: list[dict[str, Any]] | None,
    error: str = "",
) -> bytes:
    """ExtenderFilterResult: survivors as NodeNames (node-names mode) or as a NodeList."""
    if nodes is None:
        kept_nodes = None
        names: list[str] | None = passed
    else:
        keep = set(passed)
        kept_nodes = {"metadata": {}, "items": [n for n in nodes if n["metadata"]["name"] in keep]}
        names = None
    result = {
        "Nodes": kept_nodes,
        "NodeNames": names,
        "FailedNodes": failed or None,
        "FailedAndUnresolvableNodes": unresolvable or None,
        "Error": error,
    }
    return orjson.dumps(result)


class HostPriorityWriter:
    """HostPriorityList JSON, written by hand: ``[{"Host":"n1","Score":7},...]``.

    Thousands of entries per request make building and encoding a list of dicts the slowest step of
    prioritize. The ``{"Host":"<name>","Score":`` prefix of each node is encoded once and kept, and
    prefixes and scores are looked up and joined by C-level calls, without a Python loop per entry.
    """

    def __init__(self, limit: int = 100_000) -> None:
        self._prefixes: dict[str, str] = {}
        self._limit = limit

    def write(self, hosts: Sequence[str], scores: Sequence[int]) -> bytes:
        if len(hosts) != len(scores):
            raise ValueError(f"{len(hosts)} hosts but {len(scores)} scores")
        try:
            prefixes = list(map(self._prefixes.__getitem__, hosts))
        except KeyError:
            self._learn(hosts)
            prefixes = [self._prefixes.get(host) or _prefix(host) for host in hosts]
        try:
            tails = list(map(_SCORE_TEXT.__getitem__, scores))
        except KeyError:
            tails = [f"{score}}}," for score in scores]
        parts = [""] * (2 * len(prefixes))
        parts[0::2] = prefixes
        parts[1::2] = tails
        return ("[" + "".join(parts)[:-1] + "]").encode()  # [:-1]: the last entry's comma

    def _learn(self, hosts: Sequence[str]) -> None:
        new = [host for host in hosts if host not in self._prefixes]
        if len(self._prefixes) + len(new) > self._limit:
            self._prefixes.clear()
            new = list(dict.fromkeys(hosts))[: self._limit]  # never more than the limit kept
        for host in new:
            self._prefixes[host] = _prefix(host)


def _prefix(host: str) -> str:
    return '{"Host":' + json.dumps(host) + ',"Score":'


# A score and what follows it: the entry's closing brace and the comma before the next entry.
_SCORE_TEXT = {score: f"{score}}}," for score in range(11)}


def binding_result(error: str) -> bytes:
    return orjson.dumps({"Error": error})
