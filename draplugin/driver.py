"""Prepare and unprepare claims on this node, with every step checkpointed on disk.

Per prepared claim, under the state dir (:class:`nodeagent.statedir.StateDir`)::

    claims/<claim UID>/limits          the hook's limits, read-only in the claim's containers
    claims/<claim UID>/state/          the hook's accounting region, shared by those containers
    claims/<claim UID>/prepared.json   what NodePrepareResources answered; written last

and the claim's CDI spec in the CDI dir. A claim with a record is prepared: a repeated call (the
kubelet retries, or the driver restarted) answers from the record without asking the API server.
A claim without one is prepared from scratch, overwriting whatever a call cut short left (every file
is written through a rename). Nothing is written before the claim is checked; a write that fails
removes what the call wrote. Unprepare removes the spec, then the claim's directory; both are
idempotent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from draplugin.cdi import cdi_device_id, render_spec, spec_file
from draplugin.claims import ClaimRef, plan_claim
from hook.limits import write_limits
from nodeagent.records import PreparedDevice, PreparedRecord, RecordError, dump_record, load_record
from nodeagent.statedir import ContainerDir, StateDir, create_state_dir
from tessera.contract import ContractError, ContractKeys, GpuInfo
from tessera.files import write_atomically

log = logging.getLogger(__name__)

RECORD_FILE = "prepared.json"


class ClaimReader(Protocol):
    def read_claim(self, namespace: str, name: str) -> Mapping[str, object] | None:
        """The ResourceClaim as JSON; None when it does not exist."""


class Driver:
    def __init__(
        self,
        *,
        keys: ContractKeys,
        node: str,
        gpus: Sequence[GpuInfo],
        state: StateDir,
        cdi_dir: Path,
        hook_library: Path,
        claims: ClaimReader,
    ) -> None:
        self.keys = keys
        self.node = node
        self.gpus = tuple(gpus)
        self.state = state
        self.cdi_dir = cdi_dir
        self.hook_library = hook_library
        self._claims = claims
        # The kubelet may prepare a claim for a second pod while the first call is under way.
        self._lock = threading.Lock()

    def _claim_dir(self, ref: ClaimRef) -> ContainerDir:
        try:
            return self.state.claim(ref.uid)
        except ValueError as e:
            raise ContractError(f"{ref}: {e}") from None

    def recorded(self, ref: ClaimRef) -> PreparedRecord | None:
        path = self._claim_dir(ref).root / RECORD_FILE
        try:
            record = load_record(path, PreparedRecord)
        except FileNotFoundError:
            return None
        except (OSError, RecordError) as e:
            log.warning("%s: preparing again: %s", ref, e)
            return None
        return record if record.uid == ref.uid else None

    def prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        """The claim's devices for the kubelet; raises :class:`ContractError` when it cannot be
        prepared here (the message says why) and the Kubernetes client's errors when the API server
        cannot be asked."""
        with self._lock:
            done = self.recorded(ref)
            if done is not None:
                return done.devices
            where = self._claim_dir(ref)
            claim = self._claims.read_claim(ref.namespace, ref.name)
            if claim is None:
                raise ContractError(f"{ref}: not found in the API server")
            plan = plan_claim(claim, ref, self.node, self.gpus, self.keys)
            cdi_id = cdi_device_id(self.keys, ref.uid)
            devices = tuple(
                PreparedDevice(
                    request_names=(d.request,),
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=(cdi_id,),
                    share_id=d.share_id,
                )
                for d in plan.devices
            )
            spec = spec_file(self.cdi_dir, self.keys, ref.uid)
            try:
                create_state_dir(where)
                write_limits(where.limits, plan.limits, elastic=plan.elastic)
                uuids = [limit.uuid for limit in plan.limits]
                rendered = render_spec(
                    self.keys,
                    ref.uid,
                    uuids=uuids,
                    where=where,
                    state=self.state,
                    hook_library=self.hook_library,
                )
                write_atomically(spec, json.dumps(rendered, indent=2), mode=0o644)
                record = PreparedRecord(namespace=ref.namespace, name=ref.name, uid=ref.uid, devices=devices)
                write_atomically(where.root / RECORD_FILE, dump_record(record), mode=0o644)
            except BaseException:
                self._remove(ref)
                raise
            log.info(
                "%s prepared: %s",
                ref,
                ", ".join(f"{lim.uuid} {lim.memory_quota_bytes} B {lim.cores}% cores" for lim in plan.limits),
            )
            return devices

    def unprepare(self, ref: ClaimRef) -> None:
        with self._lock:
            self._remove(ref)

    def _remove(self, ref: ClaimRef) -> None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            spec_file(self.cdi_dir, self.keys, ref.uid).unlink()
        root = self._claim_dir(ref).root
        if root.exists():
            shutil.rmtree(root)
            log.info("%s unprepared", ref)
