"""`tessera sandbox up --monitoring`: a real Prometheus on the host that finds Tessera's pods the way
it does in a cluster, by Kubernetes discovery against the sandbox's API server.

The binaries come from ``hack/prometheus-binaries.sh`` (built from Go modules with Kubernetes
discovery, which Debian's package lacks). The configuration is the shipped one,
``deploy/prometheus/scrape-config.yaml`` (its jobs, relabelling and ``honor_labels`` unchanged) with
the sandbox's kubeconfig added to each job's discovery, and the chart's alert rule file. Pod IPs on
the sandbox's bridge are reachable from the host, so Prometheus scrapes the pods directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from sandbox.controlplane import LOOPBACK
from sandbox.layout import Layout
from sandbox.processes import Started, start

# The one Prometheus version (hack/prometheus-binaries.sh has the same default).
PROMETHEUS_VERSION = "v3.16.0"
BIN_ENV = "TESSERA_PROMETHEUS_BIN"
CACHE_ENV = "TESSERA_PROMETHEUS_CACHE"
BINARIES = ("prometheus", "promtool")
REPO = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "scrape-config.yaml"
RULE_FILE = REPO / "deploy" / "prometheus" / "tessera-alerts.yaml"
# Often enough that a test sees rates within a minute; Prometheus's default is 1m.
SCRAPE_INTERVAL = "5s"


def default_bin_dir() -> Path:
    if os.environ.get(BIN_ENV):
        return Path(os.environ[BIN_ENV])
    cache = os.environ.get(CACHE_ENV) or str(
        Path.home() / ".cache" / "tessera" / f"prometheus-{PROMETHEUS_VERSION}"
    )
    return Path(cache) / "bin"


def missing_binaries(bin_dir: Path) -> list[str]:
    return [
        f"{bin_dir / b} (run hack/prometheus-binaries.sh)"
        for b in BINARIES
        if not os.access(bin_dir / b, os.X_OK)
    ]


def binary(name: str) -> Path:
    """``prometheus`` or ``promtool`` from the default build; a clear error when not built."""
    bin_dir = default_bin_dir()
    if missing_binaries(bin_dir):
        raise FileNotFoundError(f"not built: {', '.join(missing_binaries(bin_dir))}")
    return bin_dir / name


def config(kubeconfig: Path, token_file: Path) -> dict[str, Any]:
    """The shipped scrape jobs, discovering pods through ``kubeconfig`` and scraping with the token in
    ``token_file`` (where a pod's Prometheus has its service account's), with the alert rules."""
    shipped = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = shipped["scrape_configs"]
    for job in jobs:
        for discovery in job["kubernetes_sd_configs"]:
            discovery["kubeconfig_file"] = str(kubeconfig)
        job["authorization"]["credentials_file"] = str(token_file)
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(RULE_FILE)],
        "scrape_configs": jobs,
    }


def start_prometheus(layout: Layout, bin_dir: Path, kubeconfig: Path, token: str, port: int) -> Started:
    """Prometheus listening on loopback ``port``, scraping with ``token`` (the sandbox's scraper's);
    its readiness URL is :func:`ready_url`."""
    layout.prometheus.mkdir(parents=True, exist_ok=True)
    token_file = layout.prometheus / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    config_file = layout.prometheus / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config(kubeconfig, token_file), sort_keys=False))
    argv = [
        str(bin_dir / "prometheus"),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={layout.prometheus / 'data'}",
        f"--web.listen-address={LOOPBACK}:{port}",
    ]
    return start("prometheus", argv, layout.log("prometheus"), cwd=layout.prometheus)


def url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def ready_url(base: str) -> str:
    return f"{base}/-/ready"
