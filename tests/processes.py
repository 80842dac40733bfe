"""Client processes started by a test: each in its own process group, all killed when it ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RUN_TIMEOUT = 120.0


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return self.stdout.splitlines()


class Processes:
    def __init__(self) -> None:
        self._started: list[subprocess.Popen[str]] = []

    def start(self, argv: Sequence[str | Path], env: dict[str, str]) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [str(a) for a in argv],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._started.append(process)
        return process

    def run(self, argv: Sequence[str | Path], env: dict[str, str], timeout: float = RUN_TIMEOUT) -> Finished:
        process = self.start(argv, env)
        try:
            out, err = process.communicate(timeout=timeout)
        finally:
            self.stop(process)
        return Finished(process.returncode, out, err)

    @staticmethod
    def stop(process: subprocess.Popen[str]) -> None:
        """Kills the process's whole group and waits for it."""
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def stop_all(self) -> None:
        for process in self._started:
            self.stop(process)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream:
                    stream.close()
