"""Leadership: whether this extender's kube-scheduler holds its leader Lease (the binds and the live
resizes go through only then)."""

from __future__ import annotations

from dataclasses import dataclass

from extender.kube import ApiError, KubeApi


@dataclass(frozen=True, slots=True)
class LeaderLease:
    """The Lease a kube-scheduler beside this extender leads by, and the pod they share."""

    namespace: str
    name: str
    pod: str


class Leadership:
    def __init__(self, kube: KubeApi | None, leader: LeaderLease | None) -> None:
        """``leader``: beside a kube-scheduler that elects a leader, its Lease (None: it leads alone)."""
        self.kube = kube
        self.leader = leader

    async def leads(self) -> str:
        """ "" while this extender's kube-scheduler holds its leader Lease (or none is configured),
        else why not. A kube-scheduler that lost or released the Lease (its pod deleted: it releases
        on the way out) may still have binds in flight, decided by this extender's state while the
        new leader's extender decides by its own: two deciders on one node could break the in-flight
        rule or overcommit a GPU, so only the leader's binds go through."""
        if self.leader is None:
            return ""
        assert self.kube is not None
        try:
            lease = await self.kube.get_lease(self.leader.namespace, self.leader.name)
        except ApiError as e:
            # Not the pod's error: its reservation stays, and kube-scheduler retries the bind.
            return f"cannot read the lease {self.leader.namespace}/{self.leader.name}: {e}"
        holder = str((lease.get("spec") or {}).get("holderIdentity") or "")
        # kube-scheduler's identity is "<hostname>_<uuid>"; in a pod the hostname is the pod's name.
        if holder.split("_", 1)[0] == self.leader.pod:
            return ""
        return (
            f"this extender's scheduler ({self.leader.pod}) does not hold the lease "
            f"{self.leader.namespace}/{self.leader.name} (held by {holder or 'nobody'}); the leader binds"
        )
