"""Running the experiments for every compared system, in parallel worker processes, with progress."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

import rich.console
import rich.progress

from simulator.inputs import Inputs
from simulator.model import Progress
from simulator.packing import PackingResult, arrival_order, run_packing
from simulator.scheduler import System, make_scheduler, system_named
from simulator.timeline import GAVEL_COLOCATION_THROUGHPUT, TimeResult, run_time
from tessera.placement import SpeedProfiles


class Experiment(StrEnum):
    PACKING = "packing"
    TIME = "time"


@dataclass(frozen=True, slots=True)
class Options:
    systems: tuple[str, ...]
    experiments: tuple[Experiment, ...] = (Experiment.PACKING, Experiment.TIME)
    seed: int = 42
    inflation: float = 1.3
    colocation: float = GAVEL_COLOCATION_THROUGHPUT


@dataclass(slots=True)
class SystemResult:
    system: System
    packing: PackingResult | None
    time: TimeResult | None
    seconds: float
    cpu_seconds: float


def run_system(
    inputs: Inputs,
    system: System,
    options: Options,
    profiles: SpeedProfiles,
    progress: Progress | None = None,
) -> SystemResult:
    started, cpu_started = time.perf_counter(), time.process_time()
    packing = timed = None
    if Experiment.PACKING in options.experiments:
        scheduler = make_scheduler(inputs.cluster, system, profiles, inputs.workload.pods, options.seed)
        order = arrival_order(inputs.workload, inputs.cluster, options.seed, options.inflation)
        packing = run_packing(
            inputs.cluster,
            workload=inputs.workload,
            system=system,
            scheduler=scheduler,
            order=order,
            progress=progress,
        )
    if Experiment.TIME in options.experiments:
        scheduler = make_scheduler(inputs.cluster, system, profiles, inputs.workload.pods, options.seed)
        timed = run_time(
            inputs.cluster,
            workload=inputs.workload,
            scheduler=scheduler,
            profiles=profiles,
            colocation=options.colocation,
            progress=progress,
        )
    return SystemResult(
        system, packing, timed, time.perf_counter() - started, time.process_time() - cpu_started
    )


def work_units(inputs: Inputs, options: Options) -> int:
    """Pod decisions a run makes across systems (the progress bar's total)."""
    per_system = 0
    if Experiment.PACKING in options.experiments:
        per_system += len(arrival_order(inputs.workload, inputs.cluster, options.seed, options.inflation))
    if Experiment.TIME in options.experiments:
        per_system += len(inputs.workload.pods)
    return per_system * len(options.systems)


# -- worker processes ------------------------------------------------------------------------------

_counter: multiprocessing.sharedctypes.Synchronized[int] | None = None


def _init_worker(counter: multiprocessing.sharedctypes.Synchronized[int]) -> None:
    global _counter
    _counter = counter


def _count(n: int) -> None:
    assert _counter is not None  # set by the pool's initializer
    with _counter.get_lock():
        _counter.value += n


def _run_in_worker(inputs: Inputs, name: str, options: Options, profiles: SpeedProfiles) -> SystemResult:
    return run_system(inputs, system_named(name), options, profiles, _count)


@contextmanager
def progress_bar(total: int, delay: float = 2.0) -> Iterator[Callable[[int], None]]:
    """A bar of pod decisions on stderr (rich), drawn only on a terminal and once the run has taken
    more than ``delay`` seconds; yields the function to call with the decisions done so far."""
    console = rich.console.Console(stderr=True)
    bar = rich.progress.Progress(
        rich.progress.BarColumn(),
        rich.progress.TaskProgressColumn(),
        rich.progress.MofNCompleteColumn(),
        rich.progress.TextColumn("pod decisions,"),
        rich.progress.TimeElapsedColumn(),
        rich.progress.TextColumn("elapsed, ~"),
        rich.progress.TimeRemainingColumn(),
        rich.progress.TextColumn("left"),
        console=console,
        disable=not console.is_terminal,
    )
    task = bar.add_task("simulate", total=max(1, total))
    started = time.monotonic()

    def show(done: int) -> None:
        bar.update(task, completed=done)
        if not bar.live.is_started and time.monotonic() - started >= delay:
            bar.start()

    try:
        yield show
    finally:
        bar.stop()


def run_all(
    inputs: Inputs,
    options: Options,
    profiles: SpeedProfiles,
    jobs: int,
    show: Callable[[int], None] | None = None,
) -> list[SystemResult]:
    """Every system of ``options``, ``jobs`` at a time; results in the order of ``options.systems``.
    ``show`` is called now and then with the pod decisions done so far (see ``work_units``)."""
    systems: Sequence[System] = [system_named(name) for name in options.systems]
    if jobs <= 1:
        done = 0

        def count(n: int) -> None:
            nonlocal done
            done += n
            if show is not None:
                show(done)

        results = [run_system(inputs, s, options, profiles, count) for s in systems]
    else:
        context = multiprocessing.get_context("spawn")
        counter = context.Value("q", 0)
        with ProcessPoolExecutor(jobs, context, initializer=_init_worker, initargs=(counter,)) as pool:
            futures: list[Future[SystemResult]] = [
                pool.submit(_run_in_worker, inputs, s.name, options, profiles) for s in systems
            ]
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                if show is not None:
                    show(counter.value)
            results = [f.result() for f in futures]
    return results
