"""Pure: a node's GPU sharing mode, and under MPS each container's client settings by its class.

The mode is the Node's ``<domain>/sharing`` label (set per node pool by the cluster's admins), else
the agent's ``--sharing`` (docs/deviceplugin.md, "MPS mode"). The policy is the one measured on a
real H200 (docs/hook.md, "MPS mode"): latency-critical and standard containers get every thread of
the GPU at normal priority; best-effort ones the node's best-effort thread share, below normal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hook.limits import MpsClient
from nodeagent.process import SetupError
from tessera.contract import (
    CONTAINER_MPS_PIPE_DIR,
    MAX_CORES,
    ContractError,
    ContractKeys,
    QosClass,
    SharingMode,
    parse_sharing_mode,
)

# CUDA_MPS_CLIENT_PRIORITY: 0 normal, 1 below normal.
NORMAL_PRIORITY = 0
BELOW_NORMAL_PRIORITY = 1
DEFAULT_BEST_EFFORT_THREADS = 50


class NodeModeError(SetupError):
    """The node's sharing mode cannot be decided; the message names the label, the node and the value."""


def node_sharing_mode(
    labels: Mapping[str, str], keys: ContractKeys, node: str, default: SharingMode
) -> SharingMode:
    """The node's mode: its label's when it has one, else ``default`` (``--sharing``). Raises
    :class:`NodeModeError` for a label that names no mode."""
    value = labels.get(keys.node_sharing)
    if value is None:
        return default
    try:
        return parse_sharing_mode(value, source=f"node {node}: label {keys.node_sharing}")
    except ContractError as e:
        raise NodeModeError(str(e)) from None


@dataclass(frozen=True, slots=True)
class MpsPolicy:
    """The client settings of a node in MPS mode."""

    # Percent of each GPU's threads a best-effort container's kernels may use (1..100).
    best_effort_threads: int = DEFAULT_BEST_EFFORT_THREADS
    # Where containers see the daemon's pipe directory.
    pipe_directory: str = CONTAINER_MPS_PIPE_DIR

    def __post_init__(self) -> None:
        threads = self.best_effort_threads
        if isinstance(threads, bool) or not 1 <= threads <= MAX_CORES:
            raise ContractError(f"MPS best-effort threads {threads!r} is outside 1..{MAX_CORES}")

    def client(self, qos: QosClass) -> MpsClient:
        """The ``mps`` line of a container of class ``qos``."""
        if qos == QosClass.BEST_EFFORT:
            return MpsClient(self.pipe_directory, self.best_effort_threads, BELOW_NORMAL_PRIORITY)
        return MpsClient(self.pipe_directory, MAX_CORES, NORMAL_PRIORITY)
