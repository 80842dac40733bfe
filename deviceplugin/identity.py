"""Pure logic: correcting which pod a served container belongs to, once the kubelet says.

At Allocate the agent can only tell containers apart by key (docs/deviceplugin.md); between pods
with equal keys it guesses the oldest bind first. Their answers are identical (GPUs, quotas), but the
guess names the container's state dir and its record, which label its metrics and decide when its
state is removed. The kubelet's pod-resources API later lists which devices each container got; the
record holding exactly those devices is then rewritten to name the right pod and container. (The dir
keeps its name: it is mounted. What it belongs to is what its record says.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir


@dataclass(frozen=True, slots=True)
class ContainerRef:
    namespace: str
    pod: str
    container: str


def corrected_records(
    records: Sequence[tuple[ContainerDir, ServedRecord]],
    owners: Mapping[frozenset[str], ContainerRef],
    pod_uids: Mapping[tuple[str, str], str],
) -> list[tuple[ContainerDir, ServedRecord, ServedRecord]]:
    """(dir, old record, new record) for the records whose devices the kubelet gave to another pod
    or container.

    ``owners`` maps each container's device set (from the pod-resources API) to the container;
    ``pod_uids`` maps (namespace, name) to UID for the pods on the node.
    """

    def names_owner(record: ServedRecord) -> bool:
        owner = owners.get(frozenset(record.device_ids))
        return owner is not None and (record.namespace, record.pod, record.pod_uid, record.container) == (
            owner.namespace,
            owner.pod,
            pod_uids.get((owner.namespace, owner.pod)),
            owner.container,
        )

    # A device set whose container already has its record: any other record of that set is of a
    # container that held it before, and renaming it would give the owner two records.
    settled = {frozenset(r.device_ids) for _, r in records if names_owner(r)}
    changes = []
    for where, record in records:
        devices = frozenset(record.device_ids)
        owner = owners.get(devices) if record.device_ids and devices not in settled else None
        if owner is None:
            continue
        uid = pod_uids.get((owner.namespace, owner.pod))
        if uid is None:
            continue
        changes.append(
            (
                where,
                record,
                record.model_copy(
                    update={
                        "namespace": owner.namespace,
                        "pod": owner.pod,
                        "pod_uid": uid,
                        "container": owner.container,
                    }
                ),
            )
        )
    return changes
