"""Correcting a served record from the kubelet's pod-resources answer (pure)."""

from __future__ import annotations

from pathlib import Path

from deviceplugin.identity import ContainerRef, corrected_records
from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir
from tessera.contract import GpuGrant

GRANT = (GpuGrant(uuid="GPU-a", memory_quota_mib=1024, cores=10),)


def record(pod: str, devices: tuple[str, ...]) -> tuple[ContainerDir, ServedRecord]:
    return (
        ContainerDir(Path(f"/state/containers/uid-{pod}/main")),
        ServedRecord(
            namespace="ns", pod=pod, pod_uid=f"uid-{pod}", container="main", gpus=GRANT, device_ids=devices
        ),
    )


def test_swapped_equal_key_containers_are_renamed_to_their_pods() -> None:
    records = [record("early", ("GPU-a::1",)), record("late", ("GPU-a::2",)), record("other", ("GPU-a::3",))]
    owners = {
        frozenset({"GPU-a::1"}): ContainerRef("ns", "late", "main"),
        frozenset({"GPU-a::2"}): ContainerRef("ns", "early", "main"),
        frozenset({"GPU-a::3"}): ContainerRef("ns", "other", "main"),
    }
    uids = {("ns", "early"): "uid-early", ("ns", "late"): "uid-late", ("ns", "other"): "uid-other"}
    changes = corrected_records(records, owners, uids)
    assert [(where.root.parent.name, old.pod, new.pod, new.pod_uid) for where, old, new in changes] == [
        ("uid-early", "early", "late", "uid-late"),
        ("uid-late", "late", "early", "uid-early"),
    ]


def test_unknown_devices_or_pods_change_nothing() -> None:
    records = [record("p", ("GPU-a::1",)), record("q", ())]
    assert corrected_records(records, {}, {("ns", "p"): "uid-p"}) == []
    owners = {frozenset({"GPU-a::1"}): ContainerRef("ns", "gone", "main")}
    assert corrected_records(records, owners, {("ns", "p"): "uid-p"}) == []


def test_a_record_of_a_device_set_its_owner_already_holds_is_left_alone() -> None:
    """The slices of a gone container given to a new one with its own record: the old record is
    not renamed (the owner would have two)."""
    records = [record("gone", ("GPU-a::1",)), record("new", ("GPU-a::1",))]
    owners = {frozenset({"GPU-a::1"}): ContainerRef("ns", "new", "main")}
    assert corrected_records(records, owners, {("ns", "gone"): "uid-gone", ("ns", "new"): "uid-new"}) == []
