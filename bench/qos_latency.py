"""QoS classes on the fake GPU: the kernel latency of a latency-critical container (1 ms kernels at
30% of the GPU, each waited for) alone, beside a best-effort container launching 5 ms kernels flat
out, and beside the same container without classes; and the shares of two standard containers
(30% and 60%) beside a best-effort one. Latencies are device time, from just before the launch
call to the kernel's end, by CUDA events (the test client's `paced` mode).

    .venv/bin/python -m bench.qos_latency [--seconds 10] [--rounds 3]

Prints a Markdown table per part (the ones in docs/benchmarks.md): each round's numbers."""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import fakegpu

ROOT = Path(__file__).resolve().parents[1]
CLIENT_SOURCE = ROOT / "tests" / "hook" / "clients" / "hook_client.c"
CRITICAL = ("sleep_us_1000", 3333)  # kernel, period in us: 30% of the GPU
BEST_EFFORT_KERNEL, BEST_EFFORT_SECONDS = "sleep_us_5000", 5e-3


@dataclass(frozen=True)
class Latency:
    count: int
    p50_us: float
    p99_us: float
    max_us: float
    seconds: float


def build_client(work: Path) -> Path:
    fakegpu.build_hook()
    fakegpu.build()
    binary = work / "hook_client"
    include = fakegpu.find_headers_dir("cuda.h")
    subprocess.run(
        [
            "cc",
            "-O1",
            "-std=gnu11",
            f"-I{include}",
            "-o",
            str(binary),
            str(CLIENT_SOURCE),
            "-ldl",
            "-pthread",
        ],
        check=True,
    )
    return binary


class Node:
    """One fake GPU and the containers run on it, each with its own region."""

    def __init__(self, work: Path, client: Path) -> None:
        self.work, self.client = work, client
        self.config = fakegpu.write_config(work / "gpus.conf", [fakegpu.example_gpu(0)])
        self.started: list[subprocess.Popen[str]] = []

    def env(self, name: str, qos: str | None, **variables: str) -> dict[str, str]:
        env = fakegpu.client_env(self.config, self.work / "state")
        env.update(LD_PRELOAD=str(fakegpu.HOOK_LIBRARY), TESSERA_REGION=str(self.work / f"region-{name}"))
        if qos is not None:
            env.update(TESSERA_QOS=qos, TESSERA_COORDINATION=str(self.work / "coordination"))
        env.update(variables)
        return env

    def start(self, env: dict[str, str], *command: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [str(self.client), "dlsym", *command], env=env, stdout=subprocess.PIPE, text=True
        )
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
            process.communicate()


@contextmanager
def node(client: Path) -> Iterator[Node]:
    with tempfile.TemporaryDirectory() as tmp:
        fake = Node(Path(tmp), client)
        try:
            yield fake
        finally:
            fake.stop_all()


def output(process: subprocess.Popen[str]) -> str:
    out, _ = process.communicate(timeout=600)
    if process.returncode != 0:
        raise RuntimeError(f"{process.args} failed: {process.returncode}")
    return out


def latency(out: str) -> Latency:
    line = next(line for line in out.splitlines() if line.startswith("paced"))
    count, p50, p99, most, seconds = line.split()[1:]
    return Latency(int(count), float(p50), float(p99), float(most), float(seconds))


def share(out: str, kernel_seconds: float) -> float:
    line = next(line for line in out.splitlines() if line.startswith("launched"))
    count, seconds = line.split()[1:]
    return 100.0 * int(count) * kernel_seconds / float(seconds)


def share_between(out: str, kernel_seconds: float, start: float, end: float) -> float:
    """Percent of the GPU's time between two of the client's 100 ms ticks."""
    ticks = [
        (float(t), int(n))
        for _, t, n in (line.split() for line in out.splitlines() if line.startswith("tick"))
    ]
    inside = [(t, n) for t, n in ticks if start <= t <= end]
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return 100.0 * (n1 - n0) * kernel_seconds / (t1 - t0)


def critical(fake: Node, env: dict[str, str], seconds: float) -> Latency:
    kernel, period = CRITICAL
    return latency(output(fake.start(env, "paced", kernel, str(period), str(seconds))))


def flat_out(fake: Node, env: dict[str, str], kernel: str, seconds: float) -> subprocess.Popen[str]:
    return fake.start(env, "launch", kernel, "100000000", str(seconds))


def latency_round(client: Path, seconds: float) -> dict[str, tuple[Latency, float | None]]:
    """Each scenario's latency-critical numbers, and the batch container's share beside it."""
    results: dict[str, tuple[Latency, float | None]] = {}
    scenarios = {
        "alone": None,
        "beside best-effort (classes)": ("best-effort", "best-effort", {}),
        "beside a batch container at 60%, hard (no classes)": ("standard", None, {"TESSERA_CORES": "60"}),
        "beside a batch container without a quota (no classes)": ("standard", None, {}),
    }
    for title, batch in scenarios.items():
        with node(client) as fake:
            qos = "latency-critical" if batch and batch[1] else None
            critical_env = fake.env("critical", qos, TESSERA_CORES="40")
            if batch is None:
                results[title] = (critical(fake, critical_env, seconds), None)
                continue
            name, batch_qos, variables = batch
            other = flat_out(fake, fake.env(name, batch_qos, **variables), BEST_EFFORT_KERNEL, seconds + 1)
            measured = critical(fake, critical_env, seconds)
            # Over the latency-critical container's run (both start together).
            batch_share = share_between(output(other), BEST_EFFORT_SECONDS, 0.5, seconds - 0.5)
            results[title] = (measured, batch_share)
    return results


def shares_round(client: Path, seconds: float) -> dict[str, float]:
    with node(client) as fake:
        batch = flat_out(fake, fake.env("batch", "best-effort"), BEST_EFFORT_KERNEL, seconds + 1)
        standard = {
            cores: flat_out(
                fake,
                fake.env(f"standard-{cores}", "standard", TESSERA_CORES=str(cores)),
                "sleep_us_1000",
                seconds,
            )
            for cores in (30, 60)
        }
        shares = {f"standard {cores}%": share(output(p), 1e-3) for cores, p in standard.items()}
        shares["best-effort"] = share_between(output(batch), BEST_EFFORT_SECONDS, 0.5, seconds - 0.5)
        return shares


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        client = build_client(Path(tmp))
        columns = ("round", "kernels", "p50 us", "p99 us", "max us", "batch share %")
        print(f"| latency-critical (1 ms kernels, 30%) | {' | '.join(columns)} |")
        print("|---|---|---|---|---|---|---|")
        for round_ in range(1, args.rounds + 1):
            for title, (lat, batch_share) in latency_round(client, args.seconds).items():
                shown = f"{batch_share:.1f}" if batch_share is not None else ""
                print(
                    f"| {title} | {round_} | {lat.count} | {lat.p50_us:.0f} | {lat.p99_us:.0f} | "
                    f"{lat.max_us:.0f} | {shown} |"
                )
        print()
        print("| beside best-effort (5 ms kernels) | round | share % |")
        print("|---|---|---|")
        for round_ in range(1, args.rounds + 1):
            for title, value in shares_round(client, args.seconds).items():
                print(f"| {title} | {round_} | {value:.1f} |")


if __name__ == "__main__":
    main()
