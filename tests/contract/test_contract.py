"""The contract module: request parsing with exact error messages, and schema round trips."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    ContainerRequest,
    ContractError,
    GpuGrant,
    GpuInfo,
    GpuUsage,
    NodeGpuUsage,
    PodShapeError,
    Policy,
    QosClass,
    QuotaChange,
    ResizeOutcome,
    ResizeStatus,
    dump_allocation,
    dump_gpu_usage,
    dump_inventory,
    dump_resize_status,
    format_time,
    keys_for,
    parse_allocation,
    parse_gpu_usage,
    parse_integer_quantity,
    parse_inventory,
    parse_pod_request,
    parse_preferences,
    parse_resize,
    parse_resize_status,
    parse_time,
    slice_gpu,
    slice_id,
)


def pod(
    *containers: dict[str, Any],
    annotations: dict[str, str] | None = None,
    init: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = init
    return {"metadata": {"name": "p", "annotations": annotations or {}}, "spec": spec}


def container(
    name: str = "main", limits: dict[str, Any] | None = None, requests: dict[str, Any] | None = None
) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {"name": name, "resources": resources}


def test_keys_use_the_default_domain() -> None:
    assert KEYS.vgpu == "tessera.io/vgpu"
    assert KEYS.vgpu_memory == "tessera.io/vgpu-memory"
    assert KEYS.vgpu_cores == "tessera.io/vgpu-cores"
    assert KEYS.node_gpus == "tessera.io/gpus"
    assert KEYS.allocation == "tessera.io/allocation"
    assert KEYS.allocation_phase == "tessera.io/allocation-phase"
    assert KEYS.qos == "tessera.io/qos"
    assert KEYS.resize == "tessera.io/resize"
    assert KEYS.resize_status == "tessera.io/resize-status"


def test_domain_is_configurable_in_one_place() -> None:
    keys = keys_for("gpu.example.com")
    assert keys.vgpu == "gpu.example.com/vgpu"
    assert keys.allocation == "gpu.example.com/allocation"
    request = parse_pod_request(pod(container(limits={"gpu.example.com/vgpu": "2"})), keys)
    assert request.containers == (ContainerRequest("main", 2, None, None),)


@pytest.mark.parametrize("domain", ["", "Tessera.IO", "x.kubernetes.io", "a_b.io", "-a.io"])
def test_bad_domain_is_refused(domain: str) -> None:
    with pytest.raises(ContractError, match=r"^domain: "):
        keys_for(domain)


def test_full_request_parses() -> None:
    limits = {KEYS.vgpu: "1", KEYS.vgpu_memory: "4096", KEYS.vgpu_cores: 30, "cpu": "1"}
    request = parse_pod_request(pod(container(limits=limits, requests=dict(limits)), container("sidecar")))
    assert request.containers == (ContainerRequest("main", 1, 4096, 30),)
    assert request.wants_gpu


def test_request_without_gpu() -> None:
    assert not parse_pod_request(pod(container(limits={"cpu": "1"}))).wants_gpu


def test_requests_alone_count() -> None:
    request = parse_pod_request(pod(container(requests={KEYS.vgpu: "2"})))
    assert request.containers == (ContainerRequest("main", 2, None, None),)


@pytest.mark.parametrize(
    ("limits", "requests", "message"),
    [
        (
            {KEYS.vgpu: "0.5"},
            None,
            "container 'main': tessera.io/vgpu: '0.5' must be an integer",
        ),
        (
            {KEYS.vgpu: "1", KEYS.vgpu_memory: "1500m"},
            None,
            "container 'main': tessera.io/vgpu-memory: '1500m' must be an integer",
        ),
        (
            {KEYS.vgpu: "one"},
            None,
            "container 'main': tessera.io/vgpu: 'one' is not a quantity",
        ),
        (
            {KEYS.vgpu: "1", KEYS.vgpu_cores: "30"},
            {KEYS.vgpu: "1", KEYS.vgpu_cores: "20"},
            "container 'main': tessera.io/vgpu-cores: request '20' differs from limit '30'; they must be equal",
        ),
        (
            {KEYS.vgpu: "0"},
            None,
            "container 'main': tessera.io/vgpu: 0 must be at least 1",
        ),
        (
            {KEYS.vgpu: "-1"},
            None,
            "container 'main': tessera.io/vgpu: -1 must be at least 1",
        ),
        (
            {KEYS.vgpu: "1", KEYS.vgpu_memory: "0"},
            None,
            "container 'main': tessera.io/vgpu-memory: 0 must be more than 0 MiB",
        ),
        (
            {KEYS.vgpu: "1", KEYS.vgpu_memory: "-5"},
            None,
            "container 'main': tessera.io/vgpu-memory: -5 must be more than 0 MiB",
        ),
        (
            {KEYS.vgpu: "1", KEYS.vgpu_cores: "0"},
            None,
            "container 'main': tessera.io/vgpu-cores: 0 is outside 1..100",
        ),
        (
            {KEYS.vgpu: "1", KEYS.vgpu_cores: "101"},
            None,
            "container 'main': tessera.io/vgpu-cores: 101 is outside 1..100",
        ),
        (
            {KEYS.vgpu_memory: "1024"},
            None,
            "container 'main': tessera.io/vgpu-memory asked without tessera.io/vgpu",
        ),
        (
            {KEYS.vgpu_memory: "1024", KEYS.vgpu_cores: "10"},
            None,
            "container 'main': tessera.io/vgpu-memory, tessera.io/vgpu-cores asked without tessera.io/vgpu",
        ),
        (
            {KEYS.vgpu: "1", KEYS.vgpu_memory: "4Zi"},
            None,
            "container 'main': tessera.io/vgpu-memory: '4Zi' has an unknown suffix 'Zi'",
        ),
        (
            {KEYS.vgpu: True},
            None,
            "container 'main': tessera.io/vgpu: True must be an integer",
        ),
    ],
)
def test_invalid_requests_name_container_resource_and_value(
    limits: dict[str, Any], requests: dict[str, Any] | None, message: str
) -> None:
    with pytest.raises(ContractError) as error:
        parse_pod_request(pod(container(limits=limits, requests=requests)))
    assert str(error.value) == message


def test_init_container_with_gpu_is_refused() -> None:
    with pytest.raises(ContractError) as error:
        parse_pod_request(pod(container(), init=[container("setup", limits={KEYS.vgpu: "1"})]))
    assert str(error.value) == "init container 'setup': tessera.io/vgpu is supported on containers only"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("4096", 4096), (4096, 4096), ("4Ki", 4096), ("4000m", 4), ("1k", 1000), ("2e3", 2000), (" 7 ", 7)],
)
def test_integer_quantities(value: object, expected: int) -> None:
    assert parse_integer_quantity(value, field="f") == expected


def test_preferences_parse() -> None:
    prefs = parse_preferences(
        {
            KEYS.gpu_models: "A100, V100",
            KEYS.gpu_models_exclude: "T4",
            KEYS.workload: "resnet50",
            KEYS.min_speed: "1.5",
            KEYS.policy: "Spread",
            KEYS.qos: "Best-Effort",
        }
    )
    assert prefs.models == ("A100", "V100")
    assert prefs.models_exclude == ("T4",)
    assert prefs.workload == "resnet50"
    assert prefs.min_speed == 1.5
    assert prefs.policy is Policy.SPREAD
    assert prefs.qos is QosClass.BEST_EFFORT
    assert parse_preferences({}).qos is None


@pytest.mark.parametrize("key", [KEYS.gpu_models, KEYS.gpu_models_exclude, KEYS.workload])
def test_a_huge_wish_is_refused_with_a_short_message(key: str) -> None:
    """A pod's wishes are echoed into every node's filter reason, its condition, events and the
    scheduler's log: a 150 kB one is refused where it is read, and the refusal quotes 80 characters."""
    with pytest.raises(ContractError) as refused:
        parse_preferences({key: "x" * 150_000})
    assert str(refused.value).startswith(f"annotation {key}: 'xxx")
    assert "longer than 64 characters" in str(refused.value)
    assert len(str(refused.value)) < 200
    assert parse_preferences({key: "y" * 64}) is not None  # the bound itself is fine


def test_too_many_models_are_refused() -> None:
    models = ",".join(f"M{i}" for i in range(33))
    with pytest.raises(ContractError, match=rf"^annotation {KEYS.gpu_models}: 33 models, at most 32$"):
        parse_preferences({KEYS.gpu_models: models})
    assert len(parse_preferences({KEYS.gpu_models: ",".join(f"M{i}" for i in range(32))}).models) == 32


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({KEYS.min_speed: "fast"}, "annotation tessera.io/min-speed: 'fast' is not a number"),
        ({KEYS.min_speed: "-1"}, "annotation tessera.io/min-speed: '-1' must be a positive number"),
        ({KEYS.min_speed: "nan"}, "annotation tessera.io/min-speed: 'nan' must be a positive number"),
        ({KEYS.min_speed: "inf"}, "annotation tessera.io/min-speed: 'inf' must be a positive number"),
        (
            {KEYS.policy: "random"},
            "annotation tessera.io/policy: 'random' is not one of binpack, spread, fragmentation",
        ),
        ({KEYS.workload: "  "}, "annotation tessera.io/workload: '  ' is empty"),
        (
            {KEYS.qos: "gold"},
            "annotation tessera.io/qos: 'gold' is not one of latency-critical, standard, best-effort",
        ),
    ],
)
def test_malformed_annotations(annotations: dict[str, str], message: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_pod_request(pod(container(limits={KEYS.vgpu: "1"}), annotations=annotations))
    assert str(error.value) == message


def gpu(index: int, **overrides: Any) -> GpuInfo:
    fields: dict[str, Any] = {
        "uuid": f"GPU-{index:08d}-0000-0000-0000-000000000000",
        "index": index,
        "model": "NVIDIA A100-SXM4-40GB",
        "memory_mib": 40960,
        "sm_count": 108,
        "compute_capability": "8.0",
        "pci_bus_id": f"00000000:{index:02X}:00.0",
        "numa_node": 0,
        "nvlink_peers": (),
        "split": 10,
    }
    fields.update(overrides)
    return GpuInfo(**fields)


def test_inventory_round_trip() -> None:
    gpus = (gpu(0, nvlink_peers=(gpu(1).uuid,)), gpu(1, health="Unhealthy", numa_node=None))
    text = dump_inventory(gpus)
    assert parse_inventory(text) == gpus
    assert not parse_inventory(text)[1].healthy


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("not json", "Invalid JSON"),
        ('{"uuid": "x"}', "Input should be a valid"),
        ('[{"uuid": "x"}]', "0.index: Field required"),
        (
            dump_inventory([gpu(0)]).replace('"split":10', '"split":0'),
            "0.split: Input should be greater than or equal to 1",
        ),
        (
            dump_inventory([gpu(0)]).replace('"Healthy"', '"Sick"'),
            "0.health: Input should be 'Healthy' or 'Unhealthy'",
        ),
        (
            dump_inventory([gpu(0)]).replace('"index":0', '"index":0,"extra":1'),
            "0.extra: Extra inputs are not permitted",
        ),
    ],
)
def test_malformed_inventory(text: str, fragment: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_inventory(text, node="n1")
    assert str(error.value).startswith("node 'n1': annotation tessera.io/gpus: ")
    assert fragment in str(error.value)


def allocation() -> Allocation:
    return Allocation(
        node="n1",
        containers=(
            ContainerAllocation(name="main", gpus=(GpuGrant(uuid="GPU-a", memory_quota_mib=4096, cores=30),)),
            ContainerAllocation(
                name="two",
                gpus=(
                    GpuGrant(uuid="GPU-a", memory_quota_mib=1, cores=0),
                    GpuGrant(uuid="GPU-b", memory_quota_mib=2, cores=100),
                ),
            ),
        ),
    )


def test_allocation_round_trip() -> None:
    original = allocation()
    assert parse_allocation(dump_allocation(original)) == original
    assert original.for_container("two") is not None
    assert original.for_container("nope") is None
    assert original.qos is QosClass.STANDARD
    best_effort = original.model_copy(update={"qos": QosClass.BEST_EFFORT})
    assert parse_allocation(dump_allocation(best_effort)).qos is QosClass.BEST_EFFORT


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (
            lambda s: s.replace('"cores":30', '"cores":101'),
            "containers.0.gpus.0.cores: Input should be less than or equal to 100",
        ),
        (
            lambda s: s.replace('"memory_mib":4096', '"memory_mib":0'),
            "containers.0.gpus.0.memory_mib: Input should be greater than 0",
        ),
        (lambda s: s.replace('"GPU-b"', '"GPU-a"'), "a container's GPUs must be distinct"),
        (lambda s: s.replace('"node":"n1",', ""), "node: Field required"),
        (lambda s: s[:-3], "Invalid JSON"),
        (
            lambda s: s[:-1] + ',"qos":"gold"}',
            "qos: Input should be 'latency-critical', 'standard' or 'best-effort'",
        ),
        (
            lambda s: s.replace('"cores":30,"oversubscribed":false', '"cores":30,"oversubscribed":true'),
            "only a best-effort allocation may be oversubscribed, this one is standard",
        ),
    ],
)
def test_malformed_allocation(mutate: Any, fragment: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_allocation(mutate(dump_allocation(allocation())), pod="ns/p")
    assert str(error.value).startswith("pod ns/p: annotation tessera.io/allocation: ")
    assert fragment in str(error.value)


def test_oversubscribed_best_effort_round_trip() -> None:
    original = allocation()
    main = original.containers[0]
    grant = main.gpus[0].model_copy(update={"oversubscribed": True})
    best_effort = original.model_copy(
        update={
            "qos": QosClass.BEST_EFFORT,
            "containers": (main.model_copy(update={"gpus": (grant,)}), *original.containers[1:]),
        }
    )
    parsed = parse_allocation(dump_allocation(best_effort))
    assert parsed.containers[0].gpus[0].oversubscribed
    assert not parsed.containers[1].gpus[0].oversubscribed


def test_gpu_usage_round_trip() -> None:
    usage = NodeGpuUsage(
        time="2026-11-26T10:00:00Z",
        gpus=(
            GpuUsage(uuid="GPU-a", memory_used_mib=2048, guaranteed_used_mib=1024, utilization_percent=40),
        ),
    )
    assert parse_gpu_usage(dump_gpu_usage(usage)) == usage


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda s: s.replace('"memory_used_mib":2048', '"memory_used_mib":-1'), "gpus.0.memory_used_mib"),
        (
            lambda s: s.replace('"utilization_percent":40', '"utilization_percent":101'),
            "gpus.0.utilization_percent",
        ),
        (
            lambda s: s.replace('"guaranteed_used_mib":1024', '"guaranteed_used_mib":4096'),
            "exceeds memory_used_mib",
        ),
        (lambda s: s.replace('"time":"2026-11-26T10:00:00Z",', ""), "time: Field required"),
        (lambda s: s[:-2], "Invalid JSON"),
    ],
)
def test_malformed_gpu_usage(mutate: Any, fragment: str) -> None:
    usage = NodeGpuUsage(
        time="2026-11-26T10:00:00Z",
        gpus=(
            GpuUsage(uuid="GPU-a", memory_used_mib=2048, guaranteed_used_mib=1024, utilization_percent=40),
        ),
    )
    with pytest.raises(ContractError) as error:
        parse_gpu_usage(mutate(dump_gpu_usage(usage)), node="n1")
    assert str(error.value).startswith("node 'n1': annotation tessera.io/gpu-usage: ")
    assert fragment in str(error.value)


def test_slice_ids() -> None:
    assert slice_id("GPU-abc", 3) == "GPU-abc::3"
    assert slice_gpu("GPU-abc::3") == "GPU-abc"
    for bad in ("GPU-abc", "::3", "GPU-abc::x"):
        with pytest.raises(ContractError, match="device ID"):
            slice_gpu(bad)


def test_time_round_trip() -> None:
    moment = parse_time("2026-11-21T10:00:00Z", field="t")
    assert format_time(moment) == "2026-11-21T10:00:00Z"
    with pytest.raises(ContractError, match="t: 'yesterday' is not an RFC 3339 time"):
        parse_time("yesterday", field="t")
    with pytest.raises(ContractError, match="has no time zone"):
        parse_time("2026-11-21T10:00:00", field="t")


@pytest.mark.parametrize(
    ("pod_json", "message"),
    [
        ([], "pod: must be an object, got a list"),
        ({"spec": []}, "spec: must be an object, got a list"),
        ({"spec": {"containers": {}}}, "spec.containers: must be a list, got an object"),
        ({"spec": {"containers": [None, "x"]}}, "spec.containers[1]: must be an object, got a string"),
        (
            {"spec": {"containers": [{"name": ["x"]}]}},
            "spec.containers[0]: name: must be a string, got a list",
        ),
        (
            {"spec": {"containers": [{"name": "x", "resources": {"limits": 1}}]}},
            "container 'x': resources.limits: must be an object, got a number",
        ),
        ({"metadata": {"annotations": []}}, "metadata.annotations: must be an object, got a list"),
        (
            {"metadata": {"annotations": {KEYS.policy: 1}}},
            "annotation tessera.io/policy: must be a string, got a number",
        ),
    ],
)
def test_wrong_shapes_name_the_field(pod_json: Any, message: str) -> None:
    with pytest.raises(PodShapeError) as error:
        parse_pod_request(pod_json)
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1e1000000000", "f: '1e1000000000' is out of range"),
        ("9" * 5000, "f: '" + "9" * 76 + "... is not a quantity (over 64 characters)"),
        (2**80, f"f: {2**80} is out of range"),
        (float("nan"), "f: nan is not a quantity"),
        ([1], "f: [1] is not a quantity"),
        ({"a": 1}, "f: {'a': 1} is not a quantity"),
    ],
)
def test_quantities_out_of_range_or_of_another_type(value: object, message: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_integer_quantity(value, field="f")
    assert str(error.value) == message


def test_resize_request_forms() -> None:
    assert parse_resize("memory=6144,cores=40").containers == {
        "": QuotaChange(memory_quota_mib=6144, cores=40)
    }
    assert parse_resize(" cores = 60 ").containers == {"": QuotaChange(cores=60)}
    assert parse_resize("trainer:memory=6144;sidecar:cores=10;").containers == {
        "trainer": QuotaChange(memory_quota_mib=6144),
        "sidecar": QuotaChange(cores=10),
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "annotation tessera.io/resize: '' asks nothing (expected memory=<MiB>,cores=<percent>)"),
        ("memory=6Gi", "annotation tessera.io/resize: value: memory: '6Gi' is not a whole number"),
        ("memory=0", "annotation tessera.io/resize: value: memory: 0 must be more than 0 MiB"),
        ("cores=101", "annotation tessera.io/resize: value: cores: 101 is outside 1..100"),
        ("gpus=2", "annotation tessera.io/resize: value: 'gpus=2' is not memory=<MiB> or cores=<1-100>"),
        ("memory=1,memory=2", "annotation tessera.io/resize: value: memory is given twice"),
        (
            "a:cores=5;a:cores=6",
            "annotation tessera.io/resize: 'a:cores=5;a:cores=6' must name each container once",
        ),
        (
            "cores=5;b:cores=6",
            "annotation tessera.io/resize: 'cores=5;b:cores=6' must name each container once",
        ),
        ("A_b:cores=5", "annotation tessera.io/resize: 'A_b' is not a container name"),
        ("x:cores=-1", "annotation tessera.io/resize: container 'x': cores: '-1' is not a whole number"),
    ],
)
def test_bad_resize_requests_name_the_field_and_value(text: str, message: str) -> None:
    with pytest.raises(ContractError) as e:
        parse_resize(text)
    assert str(e.value).startswith(message)


def test_resize_status_round_trips_and_refuses_bad_json() -> None:
    status = ResizeStatus(
        request="cores=60", outcome=ResizeOutcome.APPLIED, message="", time="2026-01-01T00:00:00Z"
    )
    assert parse_resize_status(dump_resize_status(status)) == status
    with pytest.raises(ContractError, match=r"^pod a/b: annotation tessera.io/resize-status: outcome: "):
        parse_resize_status('{"request": "x", "outcome": "maybe", "message": "", "time": ""}', pod="a/b")


def test_fields_named_apart_in_code_keep_their_published_json_names() -> None:
    """The memory quota and a GPU's total memory have their own names in code (docs/glossary.md);
    the annotations keep `memory_mib`, the name the published formats have always had, and only it."""
    grant = GpuGrant(uuid="GPU-a", memory_quota_mib=2048, cores=10)
    text = dump_allocation(Allocation(node="n", containers=(ContainerAllocation(name="c", gpus=(grant,)),)))
    assert '"memory_mib":2048' in text and "memory_quota_mib" not in text
    assert parse_allocation(text).containers[0].gpus[0] == grant
    with pytest.raises(ContractError, match="memory_mib: Field required"):
        parse_allocation(text.replace('"memory_mib"', '"memory_quota_mib"'))
    gpu = GpuInfo(
        uuid="GPU-a",
        index=0,
        model="T4",
        total_memory_mib=15360,
        sm_count=40,
        compute_capability="7.5",
        split=4,
    )
    inventory = dump_inventory([gpu])
    assert '"memory_mib":15360' in inventory and "total_memory_mib" not in inventory
    assert parse_inventory(inventory) == (gpu,)
    with pytest.raises(ContractError, match="memory_mib: Field required"):
        parse_inventory(inventory.replace('"memory_mib"', '"total_memory_mib"'))
