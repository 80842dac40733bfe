"""What a simulation replays: a cluster of GPU nodes and a workload of pods, as plain data.

Both loaders (the Alibaba trace CSV and the project's YAML) produce these types; the experiments
read nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# Whole-GPU thousandths, the unit of the Alibaba trace's `gpu_milli` and of the FGD paper's metrics.
MILLI_PER_GPU = 1000

# Memory of the GPU models the simulator knows, MiB. The trace names GPU models but has no memory
# column; YAML input may add or override models under `gpu_models`. G1-G3 are anonymized in the
# trace; they are assumed to have 16 GiB like the other models of that fleet.
GPU_MEMORY_MIB: dict[str, int] = {
    "K80": 12288,
    "P100": 16384,
    "T4": 15360,
    "V100": 16384,
    "V100M16": 16384,
    "V100M32": 32768,
    "A10": 24576,
    "L4": 23034,
    "A100": 40960,
    "A100-80GB": 81920,
    "H100": 81920,
    "G1": 16384,
    "G2": 16384,
    "G3": 16384,
}


# Called with the number of pod decisions made since the last call.
Progress = Callable[[int], None]


class InputError(ValueError):
    """A bad input file: the message names the file, the line, the column and what is wrong."""

    def __init__(self, path: str, line: int, column: int, message: str) -> None:
        super().__init__(f"{path}:{line}:{column}: {message}")
        self.path = path
        self.line = line
        self.column = column


@dataclass(frozen=True, slots=True)
class SimNode:
    name: str
    model: str
    gpus: int
    gpu_memory_mib: int
    cpu_milli: int
    host_memory_mib: int


@dataclass(frozen=True, slots=True)
class SimPod:
    """One pod of the workload.

    ``gpu_milli`` is thousandths of one GPU asked on each of ``num_gpu`` GPUs (1000 = a whole GPU).
    ``duration`` is the run time alone on a GPU of speed 1.0 (the speed profiles' reference, V100);
    None when the input has none (the packing experiment needs no durations).
    """

    name: str
    cpu_milli: int
    host_memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_models: tuple[str, ...] = ()
    workload: str | None = None
    arrival: float = 0.0
    duration: float | None = None

    @property
    def total_gpu_milli(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def fractional(self) -> bool:
        return self.num_gpu == 1 and self.gpu_milli < MILLI_PER_GPU


@dataclass(frozen=True, slots=True)
class Cluster:
    nodes: tuple[SimNode, ...]

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted({n.model for n in self.nodes}))

    def memory_of(self, model: str) -> int:
        return next(n.gpu_memory_mib for n in self.nodes if n.model == model)


@dataclass(frozen=True, slots=True)
class Workload:
    pods: tuple[SimPod, ...]

    @property
    def timed(self) -> bool:
        return all(p.duration is not None for p in self.pods)


def derived_memory_mib(pod: SimPod, cluster: Cluster) -> int | None:
    """GPU memory a trace pod asks per GPU: its GPU fraction times the model's memory.

    The trace has a GPU fraction and no memory. The fraction is taken of the smallest memory among
    the models the pod may use, so memory never binds before compute on any GPU it may land on and
    the compute share (``gpu_milli``) stays the pod's real size. None (the whole GPU's memory) for
    whole-GPU pods.
    """
    if not pod.fractional:
        return None
    allowed = [m for m in cluster.models if not pod.gpu_models or m in pod.gpu_models]
    smallest = min((cluster.memory_of(m) for m in allowed), default=0)
    return max(1, math.floor(pod.gpu_milli * smallest / MILLI_PER_GPU))
