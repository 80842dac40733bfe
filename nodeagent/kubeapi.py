"""The API server's client of a node agent, from a kubeconfig or the pod's service account."""

from __future__ import annotations

from pathlib import Path

from kubernetes import client, config

from nodeagent.process import SetupError

# Connections kept to the API server: the device plugin's kubelet calls (up to 16 at once), the
# watch, the phase writer and the publisher each hold one while they wait; a connection beyond the
# pool is closed after its call and the next call pays a new TLS handshake.
CONNECTION_POOL = 32


class KubeConfigError(SetupError):
    """No usable credentials; the message names the source."""


def load_api(kubeconfig: Path | None) -> client.ApiClient:
    configuration = client.Configuration()
    try:
        if kubeconfig is not None:
            config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
    except (config.ConfigException, OSError) as e:
        where = (
            f"--kubeconfig {kubeconfig}" if kubeconfig is not None else "in-cluster config (no --kubeconfig)"
        )
        raise KubeConfigError(f"{where}: {e}") from None
    configuration.connection_pool_maxsize = CONNECTION_POOL
    return client.ApiClient(configuration)
