"""The extender's JSON fast paths (orjson, the hand-written HostPriorityList) against the stdlib."""

from __future__ import annotations

import json

import pytest

from extender import wire


def test_priorities_are_the_json_kube_scheduler_reads() -> None:
    writer = wire.HostPriorityWriter()
    hosts = ["n1", 'odd "name" \\ é', "n1", "n3"]
    scores = [0, 10, 7, 12]  # 12: outside 0..10, still written as given
    written = writer.write(hosts, scores)
    assert json.loads(written) == [{"Host": h, "Score": s} for h, s in zip(hosts, scores, strict=True)]
    assert writer.write(hosts, scores) == written  # from the cached prefixes
    assert writer.write([], []) == b"[]"


def test_priorities_refuse_hosts_and_scores_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 hosts but 1 scores"):
        wire.HostPriorityWriter().write(["a", "b"], [1])


def test_priority_prefixes_are_bounded() -> None:
    writer = wire.HostPriorityWriter(limit=3)
    writer.write(["a", "b"], [1, 2])
    written = writer.write(["c", "d", "e"], [3, 4, 5])  # over the limit: the cache starts afresh
    assert json.loads(written) == [{"Host": h, "Score": s} for h, s in zip("cde", [3, 4, 5], strict=True)]


def test_bodies_orjson_refuses_still_parse_as_the_stdlib_does() -> None:
    body = b'{"Pod": {"metadata": {"name": "p"}, "spec": {"x": NaN}}, "Nodes": null, "NodeNames": ["a"]}'
    pod, names, nodes = wire.parse_extender_args(body)
    assert names == ["a"] and nodes is None and pod["metadata"]["name"] == "p"


def test_filter_result_matches_the_stdlib_encoding() -> None:
    result = wire.filter_result(["a", "b"], {"c": "full"}, {}, None)
    assert json.loads(result) == {
        "Nodes": None,
        "NodeNames": ["a", "b"],
        "FailedNodes": {"c": "full"},
        "FailedAndUnresolvableNodes": None,
        "Error": "",
    }
    assert json.loads(wire.binding_result("no")) == {"Error": "no"}
