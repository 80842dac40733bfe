"""Writes the fuzzers' seed corpora (hook/fuzz/seeds/): limits files as the device plugin writes them
(``hook.limits``), and the first bytes of a region a hooked process wrote over the fake GPU.

Run again after a change of either format: ``.venv/bin/python tests/hook/make_fuzz_seeds.py``. It
lives with the tests, not in hook/: it needs the fake GPU, a tool the shipped hook never imports.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import fakegpu
from hook.limits import DeviceLimit, render_limits
from tessera.contract import CONTAINER_COORDINATION_DIR, QosClass

SEEDS = Path(__file__).resolve().parents[2] / "hook" / "fuzz" / "seeds"
# The fuzzers read at most this much of an input (hook/Makefile: -max_len).
MAX_LEN = 4096
GIB = 2**30


def limits_seeds() -> dict[str, str]:
    one = [DeviceLimit(fakegpu.gpu_uuid(0), 4 * GIB, 30)]
    all_gpus = [DeviceLimit(fakegpu.gpu_uuid(i), (i + 1) * GIB, i * 6) for i in range(16)]
    return {
        "one-gpu": render_limits(one),
        "elastic": render_limits(one, elastic=True, region="/var/run/tessera/state/other"),
        "sixteen-gpus": render_limits(all_gpus),
        "no-compute-quota": render_limits([DeviceLimit(fakegpu.gpu_uuid(1), 1, 0)]),
        "best-effort": render_limits(one, qos=QosClass.BEST_EFFORT, coordination=CONTAINER_COORDINATION_DIR),
        # A standard container beside oversubscribed best-effort ones (version 3).
        "oversubscribed": render_limits(
            [DeviceLimit(fakegpu.gpu_uuid(0), 4 * GIB, 30, 5000), DeviceLimit(fakegpu.gpu_uuid(1), GIB, 0)]
        ),
        # What a device plugin before QoS classes wrote, still read by the hook.
        "version-1": f"version 1\nregion /var/run/tessera/state/region\nelastic 0\n"
        f"device {fakegpu.gpu_uuid(0)} memory {4 * GIB} cores 30\n",
    }


def region_seed(directory: Path) -> bytes:
    """A region two allocations on two GPUs left behind (the process has exited: its slot is dead,
    but the fuzzer counts every slot alive)."""
    fakegpu.build()
    library = fakegpu.build_hook()
    config = fakegpu.write_config(directory / "gpus.conf", [fakegpu.example_gpu(0), fakegpu.example_gpu(1)])
    region = directory / "region"
    env = fakegpu.client_env(config, directory / "state")
    env.update(
        LD_PRELOAD=str(library), TESSERA_REGION=str(region), TESSERA_MEMORY_LIMIT="1g", TESSERA_CORES="30"
    )
    for script in (
        ["alloc", "mem", "64m", "1", "launch", "sleep_us_100", "1", "4"],
        ["--device", "1", "alloc", "mem", "128m", "1"],
    ):
        subprocess.run(
            [str(fakegpu.cuclient()), *script], env=env, check=True, capture_output=True, timeout=60
        )
    return region.read_bytes()[:MAX_LEN]


def main() -> None:
    for name, text in limits_seeds().items():
        (SEEDS / "limits").mkdir(parents=True, exist_ok=True)
        (SEEDS / "limits" / name).write_text(text)
    with tempfile.TemporaryDirectory() as tmp:
        (SEEDS / "region").mkdir(parents=True, exist_ok=True)
        (SEEDS / "region" / "two-gpus").write_bytes(region_seed(Path(tmp)))


if __name__ == "__main__":
    main()
