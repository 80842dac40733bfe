"""A node's containerd root, seeded with the sandbox's images, as a node image with its images
pulled in advance is: the images are imported once into a *seed* (a containerd root kept under
``build/containerd-seeds``, one per containerd program and set of image archives), and each node's
root starts as a copy of the seed. Importing the images took a node's containerd about 8 CPU-seconds
and 7 wall seconds at every `up` (docs/benchmarks.md, "Seeded roots, two sandbox lanes"); the copy takes 0.3.

The copy hard-links the content blobs and the snapshots' files, which is safe because containerd
never writes either once an image is unpacked: a container writes into an upper directory of its
own, and removing an image or a snapshot unlinks. Its two bolt databases are written in place, so
each node gets copies of its own. Across file systems (no hard links) every file is copied.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from sandbox import containerd
from sandbox.install import REPO
from sandbox.layout import Layout
from sandbox.processes import stop

SEEDS = REPO / "build" / "containerd-seeds"
# The files containerd writes in place: the metadata store and the overlayfs snapshotter's.
DATABASES = ("io.containerd.metadata.v1.bolt/meta.db", "io.containerd.snapshotter.v1.overlayfs/metadata.db")


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def seed_name(program: Path, tarballs: Mapping[str, Path]) -> str:
    """The seed's name: the containerd program's identity (its path, size and time, so that a
    rebuilt containerd has a seed of its own), then the images' (their names and contents)."""
    stat = program.resolve().stat()
    runtime = hashlib.sha256(f"{program.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    images = hashlib.sha256(
        "".join(f"{name}={_digest(path)};" for name, path in sorted(tarballs.items())).encode()
    ).hexdigest()
    return f"{runtime[:12]}-{images[:12]}"


def _program(binaries: Path | None) -> Path:
    if binaries is not None:
        return binaries / "containerd"
    found = shutil.which("containerd")
    if found is None:
        raise RuntimeError("containerd is not on PATH (make sandbox-deps installs it)")
    return Path(found)


def _import_into(made: Path, binaries: Path | None, tarballs: Mapping[str, Path]) -> None:
    """The images imported, by a containerd of their own laid out as a node's under a short directory
    in /tmp (its ttrpc socket's path must fit sockaddr_un), into a root then moved to ``made``."""
    with tempfile.TemporaryDirectory(prefix="tessera-seed-", dir="/tmp") as short:
        layout = Layout(Path(short))
        for directory in (layout.containerd_root, layout.containerd_state):
            directory.mkdir(parents=True)
        if binaries is not None:
            layout.containerd_bin.symlink_to(binaries.resolve(), target_is_directory=True)
        layout.containerd_config.write_text(containerd.render_config(layout, built=binaries is not None))
        process = containerd.start_containerd(layout, name="seed-containerd")
        try:
            containerd.import_images(layout, tarballs)
        finally:
            stop(process)
        # mv, not a rename: /tmp may be another file system.
        subprocess.run(["mv", str(layout.containerd_root), str(made)], check=True, capture_output=True)


def seed(tarballs: Mapping[str, Path], binaries: Path | None = None, seeds: Path = SEEDS) -> Path:
    """The seed for these images and containerd (``binaries``: a built containerd's directory, else
    the host's), made when there is none; the seeds of that containerd for other images go then.
    Two sandboxes making the same seed at once each make their own, and the first one kept wins."""
    program = _program(binaries)
    name = seed_name(program, tarballs)
    made = seeds / name
    if made.is_dir():
        return made
    seeds.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=seeds, prefix=".making-") as making:
        root = Path(making) / "root"
        _import_into(root, binaries, tarballs)
        try:
            root.rename(made)
        except OSError:
            if not made.is_dir():
                raise
    runtime = name.split("-", 1)[0]
    for other in seeds.glob(f"{runtime}-*"):
        if other != made:
            shutil.rmtree(other, ignore_errors=True)
    return made


def plant(seed_root: Path, root: Path) -> None:
    """A node's containerd ``root`` (absent or empty; containerd not yet started on it) made a copy
    of ``seed_root``: hard links where it can, and the databases copied."""
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise RuntimeError(f"containerd root {root} is not empty: a seed goes only into a new node")
    linked = os.stat(seed_root).st_dev == os.stat(root).st_dev
    copy = ["cp", "--archive", *(["--link"] if linked else []), f"{seed_root}/.", str(root)]
    subprocess.run(copy, check=True, capture_output=True)
    for database in DATABASES if linked else ():  # copied already where nothing is linked
        target = root / database
        if target.exists():
            target.unlink()
            shutil.copy2(seed_root / database, target)
