"""The agents' records on disk: each round-trips, today's files (v0, without a version) are still
read, and a version this agent does not know is refused by name without losing the other records."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from draplugin.claims import ClaimRef
from draplugin.driver import Driver
from nodeagent.records import (
    RECORD_VERSION,
    GpuQuota,
    PreparedDevice,
    PreparedRecord,
    RecordError,
    ServedRecord,
    dump_record,
    load_record,
)
from nodeagent.statedir import StateDir
from tessera.contract import KEYS, GpuGrant, QosClass
from tessera.placement.qos import QosThresholds
from tests.draplugin.test_driver import Claims

POD_UID = "0f9c2a6e-5d43-4c1e-9a7b-2f3e4d5c6b7a"
CLAIM_UID = "5b1e7c3d-2a4f-4e6b-8c9d-0a1b2c3d4e5f"
GPU = "GPU-8f6d2c1a-0000-0000-0000-000000000001"
SERVED = ServedRecord(
    namespace="ml",
    pod="train-0",
    pod_uid=POD_UID,
    container="main",
    gpus=(GpuGrant(uuid=GPU, memory_quota_mib=4096, cores=30),),
    device_ids=(f"{GPU}::0", f"{GPU}::1"),
    qos=QosClass.BEST_EFFORT,
    served_at=1764252000.5,
)
PREPARED = PreparedRecord(
    namespace="ml",
    name="gpu-claim",
    uid=CLAIM_UID,
    devices=(
        PreparedDevice(
            request_names=("gpu",),
            pool_name="node-1",
            device_name="gpu-0",
            cdi_device_ids=(f"tessera.io/gpu-share={CLAIM_UID}",),
            share_id="1c2d3e4f-0000-4000-8000-000000000001",
        ),
    ),
)
# Since v2 a prepared record keeps the claim's quotas and who uses it (the labels of its series).
PREPARED_V2 = PREPARED.model_copy(
    update={
        "quotas": (GpuQuota(uuid=GPU, memory_quota_bytes=3 * 2**30, cores=25),),
        "pod": "train-0",
        "containers": ("main",),
    }
)
# Files exactly as the agents wrote them before records had a version ("v0"): an allocation.json of
# a time-sliced node (without `mps`), one of an MPS node, and a prepared.json.
V0_SERVED = (
    '{"namespace":"ml","pod":"train-0","pod_uid":"0f9c2a6e-5d43-4c1e-9a7b-2f3e4d5c6b7a","container":"main",'
    '"gpus":[{"uuid":"GPU-8f6d2c1a-0000-0000-0000-000000000001","memory_mib":4096,"cores":30,'
    '"oversubscribed":false}],"device_ids":["GPU-8f6d2c1a-0000-0000-0000-000000000001::0",'
    '"GPU-8f6d2c1a-0000-0000-0000-000000000001::1"],"qos":"best-effort","served_at":1764252000.5}'
)
V0_SERVED_MPS = V0_SERVED.removesuffix("}") + ',"mps":true}'
V0_PREPARED = (
    '{"namespace":"ml","name":"gpu-claim","uid":"5b1e7c3d-2a4f-4e6b-8c9d-0a1b2c3d4e5f","devices":'
    '[{"request_names":["gpu"],"pool_name":"node-1","device_name":"gpu-0","cdi_device_ids":'
    '["tessera.io/gpu-share=5b1e7c3d-2a4f-4e6b-8c9d-0a1b2c3d4e5f"],'
    '"share_id":"1c2d3e4f-0000-4000-8000-000000000001"}]}'
)


@pytest.mark.parametrize("record", [SERVED, SERVED.model_copy(update={"mps": True}), PREPARED, PREPARED_V2])
def test_each_record_round_trips_at_the_current_version(
    tmp_path: Path, record: ServedRecord | PreparedRecord
) -> None:
    path = tmp_path / "record.json"
    path.write_text(dump_record(record))
    assert json.loads(path.read_text())["version"] == RECORD_VERSION
    assert load_record(path, type(record)) == record


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (V0_SERVED, SERVED),
        (V0_SERVED_MPS, SERVED.model_copy(update={"mps": True})),
        (V0_PREPARED, PREPARED),
        ('{"version": "v1",' + V0_PREPARED.removeprefix("{"), PREPARED),
    ],
)
def test_files_of_before_versions_are_read(
    tmp_path: Path, text: str, expected: ServedRecord | PreparedRecord
) -> None:
    path = tmp_path / "record.json"
    path.write_text(text)
    assert load_record(path, type(expected)) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"version": "v9", "namespace": "ml"}',
            "record version 'v9' is not one this agent reads (v0, v1, v2)",
        ),
        ('{"version": 2}', "record version 2 is not one this agent reads"),
        ("[1, 2]", "not a JSON object"),
        ("{", "not JSON"),
        ('{"version": "v1", "namespace": "ml"}', "not a ServedRecord"),
    ],
)
def test_an_unreadable_record_is_named_with_why(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "allocation.json"
    path.write_text(text)
    with pytest.raises(RecordError) as refused:
        load_record(path, ServedRecord)
    assert str(refused.value).startswith(f"{path}: ")
    assert message in str(refused.value)


def test_a_served_record_of_a_newer_version_is_skipped_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = StateDir(tmp_path)
    state.prepare()
    kept = state.container(POD_UID, "main")
    state.write_record(kept, SERVED)
    newer = state.container("uid-newer", "main")
    newer.root.mkdir(parents=True)
    newer.record.write_text('{"version": "v3", "pod": "from-the-future"}')
    with caplog.at_level(logging.WARNING):
        assert list(state.records()) == [(kept, SERVED)]
        assert list(state.records()) == [(kept, SERVED)]
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == (
        f"{newer.record}: record version 'v3' is not one this agent reads (v0, v1, v2); written by a newer agent?"
    )
    assert warning.exc_info is None


def test_a_prepared_record_of_a_newer_version_is_named_and_the_claim_prepared_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = StateDir(tmp_path / "state")
    ref = ClaimRef(namespace="ml", name="gpu-claim", uid=CLAIM_UID)
    record = state.claim(CLAIM_UID).prepared
    record.parent.mkdir(parents=True)
    record.write_text('{"version": "v3"}')
    nothing = Claims(pods=())
    driver = Driver(
        keys=KEYS,
        node="node-1",
        gpus=(),
        state=state,
        cdi_dir=tmp_path / "cdi",
        hook_library=tmp_path / "libvgpu.so",
        claims=nothing,
        pods=nothing,
        qos=QosThresholds(),
    )
    with caplog.at_level(logging.WARNING):
        assert driver.recorded(ref) is None
    assert f"{record}: record version 'v3' is not one this agent reads" in caplog.text
    assert "Traceback" not in caplog.text
