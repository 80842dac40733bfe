"""Pure logic: the CDI spec (Container Device Interface) of one prepared claim.

The kubelet passes the CDI device names the driver returns to the container runtime, which applies
the spec's edits to every container using the claim: the GPUs' visibility variable and the mounts
the hook needs, its GPUs' coordination areas included (the same ones the device plugin path answers
Allocate with).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from nodeagent.mounts import VISIBLE_DEVICES_ENV, coordination_mounts, hook_mounts
from nodeagent.statedir import ContainerDir, StateDir
from tessera.contract import ContractKeys, JsonObject

# The CDI spec version the runtime must understand: 0.6.0 brought nothing used here, and
# containerd 1.7 and 2.x read it.
CDI_VERSION = "0.6.0"
_FILE_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def cdi_device_id(keys: ContractKeys, claim_uid: str) -> str:
    """The fully qualified CDI name of a claim's device: ``<domain>/gpu-share=<claim UID>``."""
    return f"{keys.cdi_kind}={claim_uid}"


def spec_file(cdi_dir: Path, keys: ContractKeys, claim_uid: str) -> Path:
    return cdi_dir / f"{_FILE_SAFE.sub('_', keys.cdi_kind)}_{claim_uid}.json"


def render_spec(
    keys: ContractKeys,
    claim_uid: str,
    *,
    slots: Sequence[tuple[str, Path]],
    where: ContainerDir,
    state: StateDir,
    hook_library: Path,
) -> JsonObject:
    """``slots``: each GPU's UUID and the claim's slot in its coordination area."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": keys.cdi_kind,
        "devices": [
            {
                "name": claim_uid,
                "containerEdits": {
                    "env": [f"{VISIBLE_DEVICES_ENV}={','.join(uuid for uuid, _ in slots)}"],
                    "mounts": [
                        {
                            "hostPath": m.host_path,
                            "containerPath": m.container_path,
                            "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "bind"],
                        }
                        for m in (
                            *hook_mounts(where, state, hook_library),
                            *coordination_mounts(state, slots),
                        )
                    ],
                },
            }
        ],
    }
