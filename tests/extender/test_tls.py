"""Mutual TLS between the real kube-scheduler and the extender: scheduling works over HTTPS with the
scheduler's client certificate, and a client without one (or with one another CA signed) is refused
before any verb runs. Probes and metrics stay on a plain-HTTP port that serves no verb."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from sandbox.controlplane import ControlPlane, ManagedProcess, find_binaries, free_port
from tessera.contract import KEYS, parse_allocation
from tests.extender.conftest import REPO, ExtenderServer, scheduler_config
from tests.extender.helpers import gpu_pod
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key, "-out", cert, "-days", "1", "-subj", f"/CN={name}")  # fmt: skip
    return key, cert


def make_cert(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    ext = directory / f"{name}.ext"
    ext.write_text(extensions)
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key, "-out", csr, "-subj", f"/CN={name}")  # fmt: skip
    openssl("x509", "-req", "-in", csr, "-CA", ca[1], "-CAkey", ca[0], "-CAcreateserial",
            "-out", cert, "-days", "1", "-extfile", ext)  # fmt: skip
    return key, cert


SERVER_EXT = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
CLIENT_EXT = "extendedKeyUsage=clientAuth\n"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca = make_ca(tmp_path, "tessera-ca")
    other_ca = make_ca(tmp_path, "other-ca")
    server = make_cert(tmp_path, "tessera-extender", ca, SERVER_EXT)
    scheduler = make_cert(tmp_path, "tessera-scheduler", ca, CLIENT_EXT)
    stranger = make_cert(tmp_path, "stranger", other_ca, CLIENT_EXT)
    return {
        "ca": ca[1],
        "server.key": server[0],
        "server.crt": server[1],
        "client.key": scheduler[0],
        "client.crt": scheduler[1],
        "stranger.key": stranger[0],
        "stranger.crt": stranger[1],
    }


def tls_scheduler_config(url: str, pki: dict[str, Path]) -> str:
    config: dict[str, Any] = yaml.safe_load(scheduler_config(url))
    config["extenders"][0]["enableHTTPS"] = True
    config["extenders"][0]["tlsConfig"] = {
        "certFile": str(pki["client.crt"]),
        "keyFile": str(pki["client.key"]),
        "caFile": str(pki["ca"]),
    }
    return str(yaml.safe_dump(config))


def filter_over_tls(port: int, pki: dict[str, Path], cert: str | None) -> int:
    """POST a filter with the client certificate ``cert`` (a pki prefix) or none; the HTTP status."""
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if cert is not None:
        context.load_cert_chain(str(pki[f"{cert}.crt"]), str(pki[f"{cert}.key"]))
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        body = json.dumps({"Pod": gpu_pod("p", memory=1024), "NodeNames": ["t4-0"]})
        connection.request("POST", "/filter", body=body, headers={"Content-Type": "application/json"})
        return connection.getresponse().status
    finally:
        connection.close()


def test_scheduling_over_mutual_tls_and_strangers_refused(
    *,
    control_plane: ControlPlane,
    kube: client.ApiClient,
    namespace: str,
    gpu_cluster: dict[str, str],
    pki: dict[str, Path],
    start_scheduler: Callable[[str], ManagedProcess],
) -> None:
    server = ExtenderServer(
        control_plane,
        [
            f"--tls-cert-file={pki['server.crt']}",
            f"--tls-key-file={pki['server.key']}",
            f"--client-ca-file={pki['ca']}",
            "--heartbeat-timeout=600",
        ],
        health_port=free_port(),
    )
    server.extra_args.append(f"--health-listen=127.0.0.1:{server.health_port}")
    try:
        server.start()
        start_scheduler(tls_scheduler_config(f"https://127.0.0.1:{server.port}", pki))
        core = client.CoreV1Api(kube)
        body = gpu_pod("over-tls", memory=2048)
        body["metadata"].pop("namespace", None)
        core.create_namespaced_pod(namespace, body)

        def bound() -> str | None:
            pod = core.read_namespaced_pod("over-tls", namespace)
            return pod.spec.node_name  # type: ignore[no-any-return]

        node = wait_for(bound, timeout=60, what="the pod bound through the extender over mTLS")
        annotations = core.read_namespaced_pod("over-tls", namespace).metadata.annotations
        assert parse_allocation(annotations[KEYS.allocation]).node == node

        # The scheduler's certificate works; none, or one another CA signed, is refused in the handshake.
        assert filter_over_tls(server.port, pki, "client") == 200
        for cert in (None, "stranger"):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                filter_over_tls(server.port, pki, cert)
        # Plain HTTP on the verbs' port gets no answer either.
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"{server.url}/healthz", timeout=5)
        # The health port answers probes and metrics, and no verb.
        with urllib.request.urlopen(f"{server.health_url}/readyz", timeout=5) as response:
            assert response.status == 200
        assert 'tessera_extender_binds_total{result="bound"} 1.0' in server.metrics()
        request = urllib.request.Request(f"{server.health_url}/filter", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=5)
        assert error.value.code == 404
    finally:
        server.stop()


def helm(*args: str) -> str:
    binary = find_binaries(names=("helm",)) / "helm"
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_charts_certificates_secure_the_extender(control_plane: ControlPlane, tmp_path: Path) -> None:
    """The standalone extender's (for the cluster's own scheduler) generated CA, server and client
    certificates (Helm genCA/genSignedCert), used as the chart mounts them: the scheduler's
    certificate gets a filter answered under the Service's name; no certificate, none at all."""
    rendered = helm(
        "template", "t", str(REPO / "charts" / "tessera"), "--namespace", "kube-system",
        "--set", "scheduler.enabled=false", "--set", "extender.tls.enabled=true",
        "--set", "extender.networkPolicy.enabled=true",
        "--set", "extender.networkPolicy.schedulerCIDRs={10.0.0.10/32}",
    )  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    secrets = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    files: dict[str, Path] = {}
    for secret, prefix in (
        ("tessera-extender-tls", "server"),
        ("tessera-scheduler-extender-client", "client"),
    ):
        for key, value in secrets[secret].items():
            path = tmp_path / f"{prefix}-{key}"
            path.write_bytes(base64.b64decode(value))
            files[f"{prefix}-{key}"] = path
    assert files["server-ca.crt"].read_bytes() == files["client-ca.crt"].read_bytes()
    [deployment] = [
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tessera-extender"
    ]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--client-ca-file=/etc/tessera-tls/ca.crt" in args
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.10/32"}}]
    # Beside the chart's own scheduler the verbs are on the pod's loopback: no certificates to make.
    combined = helm("template", "t", str(REPO / "charts" / "tessera"), "--set", "extender.tls.enabled=true")
    assert not [d for d in yaml.safe_load_all(combined) if d and d["kind"] == "Secret"]

    server = ExtenderServer(
        control_plane,
        [
            f"--tls-cert-file={files['server-tls.crt']}",
            f"--tls-key-file={files['server-tls.key']}",
            f"--client-ca-file={files['server-ca.crt']}",
        ],
        health_port=free_port(),
    )
    server.extra_args.append(f"--health-listen=127.0.0.1:{server.health_port}")
    try:
        server.start()

        def filter_as(cert: bool) -> int:
            """The HTTP status, or 0 when the connection was refused (in or right after the handshake:
            with TLS 1.3 the server checks the client's certificate after the client's side is done)."""
            try:
                return _filter_as(cert)
            except (ssl.SSLError, ConnectionError):
                return 0

        def _filter_as(cert: bool) -> int:
            context = ssl.create_default_context(cafile=str(files["client-ca.crt"]))
            if cert:
                context.load_cert_chain(str(files["client-tls.crt"]), str(files["client-tls.key"]))
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            # The name the chart's scheduler calls it by (its urlPrefix).
            with context.wrap_socket(sock, server_hostname="tessera-extender.kube-system.svc") as tls:
                body = json.dumps({"Pod": gpu_pod("p"), "NodeNames": []}).encode()
                tls.sendall(
                    b"POST /filter HTTP/1.1\r\nHost: tessera-extender.kube-system.svc\r\n"
                    b"Content-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                answer = b""
                while chunk := tls.recv(65536):
                    answer += chunk
            return int(answer.split(b" ", 2)[1]) if answer else 0

        assert filter_as(cert=True) == 200
        assert filter_as(cert=False) == 0
    finally:
        server.stop()
