"""What the fake libraries export, and that the pointers cuGetProcAddress hands out are the
library's own (-Bsymbolic-functions): a preloaded library defining cuMemAlloc_v2 catches linked
callers only, so a hook that intercepts nothing cannot look as if it works."""

from __future__ import annotations

import subprocess
from pathlib import Path

from fakegpu import BUILD_DIR, find_headers_dir
from tests.fakegpu.conftest import ClientProcesses, Gpus, fields

INTERPOSER = """
#include <cuda.h>
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { (void)dptr; (void)bytesize; return CUDA_ERROR_NOT_PERMITTED; }
"""


def exported(library: Path) -> list[str]:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def test_only_driver_api_symbols_are_exported(built: Path) -> None:
    cuda = exported(BUILD_DIR / "libcuda.so.1")
    nvml = exported(BUILD_DIR / "libnvidia-ml.so.1")
    assert cuda and all(name.startswith("cu") for name in cuda)
    assert nvml and all(name.startswith("nvml") for name in nvml)
    assert {
        "cuMemAlloc",
        "cuMemAlloc_v2",
        "cuCtxCreate_v4",
        "cuGetProcAddress",
        "cuGetProcAddress_v2",
    } <= set(cuda)


def test_a_preloaded_symbol_does_not_replace_what_cu_get_proc_address_returns(
    gpus: Gpus, procs: ClientProcesses, tmp_path: Path
) -> None:
    source = tmp_path / "interposer.c"
    source.write_text(INTERPOSER)
    library = tmp_path / "libinterposer.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", f"-I{find_headers_dir('cuda.h')}", "-o", str(library), str(source)],
        check=True,
        timeout=120,
    )
    env = gpus.env(LD_PRELOAD=str(library))
    results = {
        path: fields(procs.cuclient(env, "--path", path, "alloc", "mem", "1m", "1")[0])["result"]
        for path in ("linked", "dlopen", "procaddr")
    }
    assert results == {
        "linked": "CUDA_ERROR_NOT_PERMITTED",  # the executable's reference binds to the preload
        "dlopen": "CUDA_SUCCESS",  # dlsym on the driver's handle finds the driver's symbol
        "procaddr": "CUDA_SUCCESS",  # the driver's own pointer, never the interposed one
    }
