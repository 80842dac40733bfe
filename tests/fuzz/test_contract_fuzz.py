"""The contract's parsers under generated input: every refusal is a ContractError naming the field,
nothing else escapes (no AttributeError, TypeError, RecursionError, OverflowError, ValueError of
another kind), and what is accepted is within the contract's ranges."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tessera.contract import (
    KEYS,
    MAX_CORES,
    ContractError,
    parse_allocation,
    parse_integer_quantity,
    parse_inventory,
    parse_pod_request,
    parse_preferences,
)

# Any JSON value, nested a few levels.
JSON: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
RESOURCES = st.sampled_from([*KEYS.resources, "cpu", "nvidia.com/gpu"])
QUANTITY_TEXT = st.one_of(
    st.from_regex(r"\A[+-]?[0-9]{0,25}(\.[0-9]{0,5})?([eE][+-]?[0-9]{1,12}|[a-zA-Z]{0,3})\Z"),
    st.text(max_size=30),
)
QUANTITY = st.one_of(QUANTITY_TEXT, st.integers(), st.floats(), JSON)
ANNOTATIONS = st.dictionaries(
    st.sampled_from([*KEYS.preferences, KEYS.allocation, "other"]) | st.text(max_size=10),
    st.text(max_size=30) | JSON,
    max_size=6,
)


def container() -> st.SearchStrategy[Any]:
    resources = st.fixed_dictionaries(
        {},
        optional={
            "limits": st.dictionaries(RESOURCES, QUANTITY, max_size=4) | JSON,
            "requests": st.dictionaries(RESOURCES, QUANTITY, max_size=4) | JSON,
        },
    )
    return (
        st.fixed_dictionaries(
            {}, optional={"name": st.text(max_size=10) | JSON, "resources": resources | JSON}
        )
        | JSON
    )


POD = (
    st.fixed_dictionaries(
        {},
        optional={
            "metadata": st.fixed_dictionaries({}, optional={"annotations": ANNOTATIONS | JSON}) | JSON,
            "spec": st.fixed_dictionaries(
                {},
                optional={
                    "containers": st.lists(container(), max_size=3) | JSON,
                    "initContainers": st.lists(container(), max_size=2) | JSON,
                },
            )
            | JSON,
        },
    )
    | JSON
)


def names_a_field(error: ContractError) -> bool:
    text = str(error)
    return ": " in text and len(text) < 2000


@given(POD)
def test_pod_requests(pod: Any) -> None:
    try:
        request = parse_pod_request(pod)
    except ContractError as e:
        assert names_a_field(e), e
        return
    for c in request.containers:
        assert c.gpu_count >= 1
        assert c.memory_quota_mib is None or 0 < c.memory_quota_mib < 2**63
        assert c.cores is None or 1 <= c.cores <= MAX_CORES


@given(ANNOTATIONS | JSON)
def test_preferences(annotations: Any) -> None:
    try:
        parse_preferences(annotations)
    except ContractError as e:
        assert names_a_field(e), e


@given(QUANTITY)
def test_integer_quantities(value: Any) -> None:
    try:
        parsed = parse_integer_quantity(value, field="f")
    except ContractError as e:
        assert str(e).startswith("f: "), e
        assert len(str(e)) < 300
        return
    assert isinstance(parsed, int) and abs(parsed) < 2**63


def _gpu() -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries(
        {
            "uuid": st.text(max_size=12),
            "index": st.integers(-2, 2**40),
            "model": st.text(max_size=12),
            "memory_mib": st.integers(-2, 2**70),
            "sm_count": st.integers(-2, 2**40),
            "compute_capability": st.from_regex(r"\A\d{1,3}\.\d{1,3}\Z") | st.text(max_size=5),
            "split": st.integers(-2, 2**70),
        },
        optional={"health": st.sampled_from(["Healthy", "Unhealthy", "x"]), "numa_node": JSON},
    )


INVENTORY_TEXT = st.one_of(
    st.lists(_gpu() | JSON, max_size=4).map(json.dumps),
    JSON.map(json.dumps),
    st.text(max_size=60),
)


@given(INVENTORY_TEXT)
def test_inventories(text: str) -> None:
    try:
        parse_inventory(text, node="n")
    except ContractError as e:
        assert "annotation tessera.io/gpus" in str(e), e


def _allocation() -> st.SearchStrategy[Any]:
    grant = st.fixed_dictionaries(
        {"uuid": st.text(max_size=8), "memory_mib": st.integers(-2, 2**70), "cores": st.integers(-2, 300)}
    )
    container = st.fixed_dictionaries(
        {"name": st.text(max_size=8), "gpus": st.lists(grant | JSON, max_size=3)}
    )
    return st.fixed_dictionaries(
        {"node": st.text(max_size=8), "containers": st.lists(container | JSON, max_size=3)}
    )


@given(st.one_of(_allocation().map(json.dumps), JSON.map(json.dumps), st.text(max_size=60)))
def test_allocations(text: str) -> None:
    try:
        parse_allocation(text, pod="ns/p")
    except ContractError as e:
        assert "annotation tessera.io/allocation" in str(e), e
