"""The driver's gRPC edge over real unix sockets: registration as the kubelet does it, per-claim
answers and errors, and a kubelet API error reported on the claim rather than failing the call."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from kubernetes import client

from draplugin.claims import ClaimRef
from draplugin.driver import Driver
from draplugin.server import Servers, serve_driver
from nodeagent.statedir import StateDir
from tessera.contract import KEYS
from tessera.placement.qos import QosThresholds
from tests.draplugin.kubelet_standin import RegisteredDriver, claim, register
from tests.draplugin.test_driver import A100, NODE, REF, T4, Claims, share_config
from tests.draplugin.test_driver import claim as claim_object


class Unavailable:
    def read_claim(self, namespace: str, name: str) -> Mapping[str, object] | None:
        raise client.ApiException(status=503, reason="Service Unavailable")


def serving(tmp_path: Path, sockets: Path, claims: object) -> Servers:
    state = StateDir(tmp_path / "state")
    state.prepare()
    driver = Driver(
        keys=KEYS,
        node=NODE,
        gpus=(A100, T4),
        state=state,
        cdi_dir=tmp_path / "cdi",
        hook_library=tmp_path / "libvgpu.so",
        claims=claims,  # type: ignore[arg-type]
        pods=claims,  # type: ignore[arg-type]
        qos=QosThresholds(),
    )
    return serve_driver(driver, sockets / "plugins" / "dra.sock", sockets / "plugins_registry" / "reg.sock")


@pytest.fixture
def sockets() -> Iterator[Path]:
    # Unix socket paths are limited to 108 bytes: a short dir, not pytest's long tmp_path.
    directory = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def registered(servers: Servers, sockets: Path) -> RegisteredDriver:
    kubelet = register(sockets / "plugins_registry" / "reg.sock", KEYS.dra_driver, timeout=10)
    assert servers.status.registered.wait(5)
    return kubelet


def test_prepare_answers_each_claim_and_errors_stay_per_claim(tmp_path: Path, sockets: Path) -> None:
    servers = serving(tmp_path, sockets, Claims(claim_object()))
    kubelet = registered(servers, sockets)
    try:
        assert kubelet.info.endpoint == str(sockets / "plugins" / "dra.sock")
        missing = ClaimRef(namespace="team", name="gone", uid="0b1c2d3e-0000-4000-8000-0000000000ff")
        answer = kubelet.prepare(
            claim(REF.namespace, REF.name, REF.uid), claim(missing.namespace, missing.name, missing.uid)
        )
        ok, failed = answer.claims[REF.uid], answer.claims[missing.uid]
        assert ok.error == ""
        [device] = ok.devices
        assert (device.pool_name, device.device_name, list(device.request_names)) == (NODE, "gpu-0", ["gpu"])
        assert device.share_id == "5a0e6c1f-1111-4000-8000-000000000002"
        assert failed.error == f"{missing}: not found in the API server"
        assert list(failed.devices) == []
        unprepared = kubelet.unprepare(claim(REF.namespace, REF.name, REF.uid))
        assert unprepared.claims[REF.uid].error == ""
        assert not (tmp_path / "state" / "claims" / REF.uid).exists()
    finally:
        kubelet.close()
        servers.stop()
    # Both sockets go with the driver: the kubelet's plugin watcher sees it leave.
    assert list(sockets.rglob("*.sock")) == []


def test_an_api_server_that_cannot_answer_fails_the_claim_not_the_call(tmp_path: Path, sockets: Path) -> None:
    servers = serving(tmp_path, sockets, Unavailable())
    kubelet = registered(servers, sockets)
    try:
        answer = kubelet.prepare(claim(REF.namespace, REF.name, REF.uid))
        assert answer.claims[REF.uid].error == f"{REF}: the API server answered HTTP 503 Service Unavailable"
    finally:
        kubelet.close()
        servers.stop()


def test_a_claim_asking_for_an_unknown_class_fails_with_the_field_named(
    tmp_path: Path, sockets: Path
) -> None:
    config = share_config(qos="urgent")
    servers = serving(tmp_path, sockets, Claims(claim_object(config=config)))
    kubelet = registered(servers, sockets)
    try:
        answer = kubelet.prepare(claim(REF.namespace, REF.name, REF.uid))
        assert answer.claims[REF.uid].error == (
            f"{REF}: status.allocation.devices.config[0].opaque.parameters: qos: Input should be "
            "'latency-critical', 'standard' or 'best-effort' (got \"urgent\")"
        )
        assert not (tmp_path / "state" / "claims" / REF.uid).exists()
        assert not list((tmp_path / "state" / "coordination").rglob(REF.uid))
    finally:
        kubelet.close()
        servers.stop()
