"""Finds and loads ``libvgpu.so`` for the Python side (never as a preload: RTLD_LOCAL, so its
``dlsym`` override stays out of this process's global symbol scope)."""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

from tessera.contract import CONTAINER_HOOK_LIBRARY

LIBRARY_ENV = "TESSERA_HOOK_LIBRARY"
BUILD_LIBRARY = Path(__file__).resolve().parent / "build" / "libvgpu.so"


class HookLibraryError(RuntimeError):
    """libvgpu.so is missing or cannot be loaded; the message says where it was looked for."""


def library_path() -> Path:
    """``$TESSERA_HOOK_LIBRARY``, else the one ``make -C hook`` built, else the container's copy."""
    configured = os.environ.get(LIBRARY_ENV)
    if configured:
        return Path(configured)
    if BUILD_LIBRARY.exists():
        return BUILD_LIBRARY
    return Path(CONTAINER_HOOK_LIBRARY)


@cache
def load_library() -> ctypes.CDLL:
    path = library_path()
    try:
        return ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    except OSError as e:
        raise HookLibraryError(
            f"{LIBRARY_ENV}: cannot load {path} ({e}); build it with `make -C hook`"
        ) from None
