"""Speed profiles: how fast each GPU model runs a workload, relative to a reference GPU (V100 = 1.0).

The file (``deploy/speed-profiles.yaml``) has three keys::

    default_speed: 1.0          # a model no entry matches
    models: {T4: 0.4, V100: 1.0, A100: 2.0}
    workloads:                  # optional, per workload class (pod annotation <domain>/workload)
      llm-training: {T4: 0.25, A100: 2.6}

A profile key matches a GPU's model name (as NVML reports it, e.g. ``Tesla V100-SXM2-16GB``) when it
occurs in it case-insensitively as a whole token: not preceded by a letter or digit and not followed
by a digit, so ``A10`` matches ``NVIDIA A10`` but not ``NVIDIA A100-SXM4-40GB``. The longest matching
key wins. A workload's entry overrides the ``models`` entry for that model only.

The *gain* of a workload on a model is ``speed(workload, model) / speed(default, model)``: how much
more this workload profits from that model than the average workload does (its comparative
advantage, the quantity Gavel, OSDI '20, allocates by). Pods without a workload class, or whose class
has no entry, have gain 1 everywhere and no speed preference.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import yaml

from tessera.contract import ContractError


def _model_pattern(key: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![0-9])", re.IGNORECASE)


def _speed_table(raw: object, where: str) -> dict[str, float]:
    if not isinstance(raw, Mapping):
        raise ContractError(f"speed profiles: {where}: expected a mapping of model to speed, got {raw!r}")
    table: dict[str, float] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key.strip():
            raise ContractError(f"speed profiles: {where}: model {key!r} is not a non-empty string")
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ContractError(f"speed profiles: {where}.{key}: {value!r} is not a positive number")
        table[key.strip()] = float(value)
    return table


@dataclass(frozen=True)
class SpeedProfiles:
    models: Mapping[str, float] = field(default_factory=dict)
    workloads: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    default_speed: float = 1.0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SpeedProfiles:
        unknown = set(data) - {"models", "workloads", "default_speed"}
        if unknown:
            raise ContractError(f"speed profiles: unknown keys {sorted(unknown)}")
        default_speed = data.get("default_speed", 1.0)
        if (
            isinstance(default_speed, bool)
            or not isinstance(default_speed, int | float)
            or default_speed <= 0
        ):
            raise ContractError(f"speed profiles: default_speed: {default_speed!r} is not a positive number")
        workloads_raw = data.get("workloads") or {}
        if not isinstance(workloads_raw, Mapping):
            raise ContractError(f"speed profiles: workloads: expected a mapping, got {workloads_raw!r}")
        return cls(
            models=_speed_table(data.get("models") or {}, "models"),
            workloads={
                str(name): _speed_table(table, f"workloads.{name}") for name, table in workloads_raw.items()
            },
            default_speed=float(default_speed),
        )

    @classmethod
    def from_yaml(cls, text: str) -> SpeedProfiles:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ContractError(f"speed profiles: not YAML: {e}") from None
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ContractError(f"speed profiles: expected a mapping at the top, got {type(data).__name__}")
        return cls.from_mapping(data)

    @cached_property
    def _patterns(self) -> dict[str, re.Pattern[str]]:
        keys = set(self.models).union(*(set(t) for t in self.workloads.values()))
        return {key: _model_pattern(key) for key in keys}

    def _key(self, table: Mapping[str, float], model: str) -> str | None:
        matches = [key for key in table if self._patterns[key].search(model)]
        return max(matches, key=len) if matches else None

    def _lookup(self, table: Mapping[str, float], model: str) -> float | None:
        key = self._key(table, model)
        return None if key is None else table[key]

    def model_key(self, model: str) -> str | None:
        """The general profile's key that matches ``model`` (``A100`` for ``NVIDIA A100-SXM4-40GB``)."""
        return self._key(self.models, model)

    def has_workload(self, workload: str | None) -> bool:
        return workload is not None and workload in self.workloads

    @cached_property
    def _memo(self) -> dict[tuple[str, str | None], float]:
        return {}

    def speed(self, model: str, workload: str | None = None) -> float:
        """Relative throughput of ``model`` for ``workload`` (the workload's entry, else ``models``)."""
        key = (model, workload)
        known = self._memo.get(key)
        if known is None:
            known = self._memo[key] = self._speed(model, workload)
        return known

    def _speed(self, model: str, workload: str | None) -> float:
        if workload is not None and workload in self.workloads:
            own = self._lookup(self.workloads[workload], model)
            if own is not None:
                return own
        general = self._lookup(self.models, model)
        return self.default_speed if general is None else general

    def gain(self, model: str, workload: str | None) -> float:
        """The workload's comparative advantage on ``model`` (1.0 without a workload profile)."""
        if not self.has_workload(workload):
            return 1.0
        return self.speed(model, workload) / self.speed(model)
