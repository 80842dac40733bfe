"""The sandbox's container images, built by the project itself: no registry is reachable here.

Each image is an OCI image-layout tarball (``oci-layout``, ``index.json``, ``blobs/sha256/...`` with a
manifest, a config and one uncompressed tar layer) that ``ctr images import`` accepts. The layer is
built from Debian's statically linked busybox, so an image is a few MiB and needs nothing from a
registry. The builder is pure (entries in, bytes out, byte-for-byte reproducible); the adapters at the
bottom read the host files and compile the probe.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_PREFIX = "docker.io/local"
IMAGE_TAG = "tessera-0.1"
PAUSE_IMAGE = f"{IMAGE_PREFIX}/pause:{IMAGE_TAG}"
PROBE_IMAGE = f"{IMAGE_PREFIX}/vgpu-probe:{IMAGE_TAG}"

BUSYBOX = Path("/bin/busybox")
PROBE_SOURCE = Path(__file__).with_name("vgpu_probe.c")
PROBE_PATH = "/usr/local/bin/vgpu-probe"
# The tenant's escapes of docs/security.md, tried from inside a container (tests/sandbox/test_escapes.py).
ESCAPE_SOURCE = Path(__file__).with_name("vgpu_escape.c")
# The hook's headers: vgpu-escape writes the accounting region in the hook's own layout.
HOOK_HEADERS = Path(__file__).resolve().parents[2] / "hook" / "src"
ESCAPE_PATH = "/usr/local/bin/vgpu-escape"
# Where Debian-based images keep shared libraries, and so where the NVIDIA container toolkit mounts
# libcuda.so.1 and libnvidia-ml.so.1; the probe image has the directory so the mounts have a target.
DRIVER_LIBRARY_DIR = "/usr/lib/x86_64-linux-gnu"
# The glibc runtime a dynamically linked program needs: the probe, the fake driver mounted beside it
# and the hook preloaded into it. Dynamic linking is required: /etc/ld.so.preload, which is how the
# hook enters every process, is read by the dynamic loader only.
GLIBC_RUNTIME = (
    Path("/lib64/ld-linux-x86-64.so.2"),
    # Also where Debian keeps it: a library that names it as a dependency (libc does) is found there,
    # e.g. by dlmopen into a new namespace.
    Path("/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
    Path("/lib/x86_64-linux-gnu/libc.so.6"),
    Path("/lib/x86_64-linux-gnu/libm.so.6"),
    Path("/lib/x86_64-linux-gnu/libdl.so.2"),
    Path("/lib/x86_64-linux-gnu/libpthread.so.0"),
    Path("/lib/x86_64-linux-gnu/librt.so.1"),
)
# The network applets let tests reach Services from inside pods (httpd serves, wget/nc call,
# nslookup asks cluster DNS).
BUSYBOX_APPLETS = (
    "sh", "sleep", "cat", "ls", "env", "echo", "true", "mkdir",
    "httpd", "wget", "nc", "nslookup", "hostname", "timeout",
)  # fmt: skip

_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True, slots=True)
class Entry:
    """One path in an image layer: a directory, a regular file (``data``) or a symlink (``target``)."""

    path: str
    data: bytes | None = None
    target: str | None = None
    mode: int = 0o755


@dataclass(frozen=True, slots=True)
class ImageSpec:
    name: str
    entries: tuple[Entry, ...]
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = field(default=("PATH=/usr/local/bin:/usr/bin:/bin",))


def _layer_tar(entries: tuple[Entry, ...]) -> bytes:
    """A reproducible tar: parents first, sorted, zero mtimes, root ownership."""
    paths: dict[str, Entry] = {}
    for entry in entries:
        parts = entry.path.strip("/").split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            paths.setdefault(parent, Entry(parent))
        paths[entry.path.strip("/")] = entry
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(paths):
            entry = paths[path]
            info = tarfile.TarInfo(path)
            info.mode = entry.mode
            info.mtime = 0
            if entry.target is not None:
                info.type = tarfile.SYMTYPE
                info.linkname = entry.target
                tar.addfile(info)
            elif entry.data is not None:
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
            else:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
    return buffer.getvalue()


def _digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def build_layout(spec: ImageSpec) -> bytes:
    """The OCI image-layout tarball of ``spec``. ``spec.name`` must be fully qualified (a containerd
    import keeps the name as written, and the kubelet asks for ``docker.io/...`` names)."""
    if spec.name.count("/") < 2 or ":" not in spec.name.rsplit("/", 1)[1]:
        raise ValueError(f"image name: {spec.name!r} must be fully qualified, as registry/repo/name:tag")
    layer = _layer_tar(spec.entries)
    config = _json(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": list(spec.entrypoint), "Cmd": list(spec.cmd), "Env": list(spec.env)},
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
            "history": [{"created_by": "tessera sandbox image builder"}],
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": _OCI_MANIFEST,
            "config": {"mediaType": _OCI_CONFIG, "digest": _digest(config), "size": len(config)},
            "layers": [{"mediaType": _OCI_LAYER, "digest": _digest(layer), "size": len(layer)}],
        }
    )
    index = _json(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": _OCI_MANIFEST,
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": spec.name,
                        "org.opencontainers.image.ref.name": spec.name,
                    },
                }
            ],
        }
    )
    files = {
        "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
        "index.json": index,
        **{f"blobs/sha256/{_digest(b).split(':')[1]}": b for b in (layer, config, manifest)},
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(files[name]), 0o644
            tar.addfile(info, io.BytesIO(files[name]))
    return out.getvalue()


def _busybox_entries(busybox: bytes) -> tuple[Entry, ...]:
    return (
        Entry("bin/busybox", data=busybox),
        *(Entry(f"bin/{applet}", target="busybox") for applet in BUSYBOX_APPLETS),
        Entry("tmp", mode=0o1777),
        Entry("etc"),
    )


# A pause container only has to live until it is told to stop; as PID 1 a shell gets no default
# signal handlers, so the trap is what makes SIGTERM end it promptly.
PAUSE_SCRIPT = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"


def pause_spec(busybox: bytes) -> ImageSpec:
    return ImageSpec(
        name=PAUSE_IMAGE, entries=_busybox_entries(busybox), entrypoint=("/bin/sh", "-c", PAUSE_SCRIPT)
    )


def probe_spec(busybox: bytes, probe: bytes, glibc: dict[str, bytes], escape: bytes) -> ImageSpec:
    """busybox, the glibc runtime (``glibc`` maps a path in the image to its bytes), the probe and
    the escapes."""
    return ImageSpec(
        name=PROBE_IMAGE,
        entries=(
            *_busybox_entries(busybox),
            *(Entry(path, data=data) for path, data in sorted(glibc.items())),
            Entry(DRIVER_LIBRARY_DIR),
            Entry(PROBE_PATH, data=probe),
            Entry(ESCAPE_PATH, data=escape),
        ),
        entrypoint=(PROBE_PATH,),
    )


# --------------------------------------------------------------------------------------------------
# Adapters: host files and the C compiler.


def compile_program(source: Path, out: Path) -> Path:
    """Compile a program of the probe image with the host's C compiler (the image carries the host's
    glibc to match)."""
    warnings = ("-Wall", "-Wextra", "-Werror")
    command = ["cc", "-O2", "-std=gnu11", *warnings, f"-I{HOOK_HEADERS}", "-o", str(out), str(source), "-ldl"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return out


def _read_glibc() -> dict[str, bytes]:
    # resolve(): the host paths are symlinks into versioned files; the image stores the contents
    # under the soname path the loader looks for.
    return {str(path).lstrip("/"): path.resolve().read_bytes() for path in GLIBC_RUNTIME}


def write_images(directory: Path) -> dict[str, Path]:
    """Build both images into ``directory``; returns image name -> tarball path."""
    directory.mkdir(parents=True, exist_ok=True)
    busybox = BUSYBOX.read_bytes()
    probe = compile_program(PROBE_SOURCE, directory / "vgpu-probe").read_bytes()
    escape = compile_program(ESCAPE_SOURCE, directory / "vgpu-escape").read_bytes()
    written: dict[str, Path] = {}
    for spec in (pause_spec(busybox), probe_spec(busybox, probe, _read_glibc(), escape)):
        path = directory / (spec.name.rsplit("/", 1)[1].replace(":", "_") + ".oci.tar")
        path.write_bytes(build_layout(spec))
        written[spec.name] = path
    return written
