"""Seeded containerd roots (sandbox.seeds): the images imported once, each node's root a copy whose
content and snapshots are hard links to the seed's and whose databases are its own."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox import containerd, images, seeds
from sandbox.layout import Layout
from sandbox.processes import Started, stop

BLOBS = "io.containerd.content.v1.content/blobs/sha256"


def _spec(name: str, data: bytes) -> images.ImageSpec:
    return images.ImageSpec(
        name=f"docker.io/local/{name}:1",
        entries=(images.Entry("bin/tool", data=data),),
        entrypoint=("/bin/tool",),
    )


def _archives(directory: Path, *specs: images.ImageSpec) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for spec in specs:
        path = directory / f"{spec.name.rsplit('/', 1)[1].replace(':', '_')}.oci.tar"
        path.write_bytes(images.build_layout(spec))
        written[spec.name] = path
    return written


@pytest.fixture
def work() -> Iterator[Path]:
    # Short, in /tmp: the nodes' containerd sockets must fit sockaddr_un.
    with tempfile.TemporaryDirectory(prefix="tsd-", dir="/tmp") as directory:
        yield Path(directory)


def _node(work: Path, name: str, seed: Path) -> tuple[Layout, Started]:
    layout = Layout(work / name)
    seeds.plant(seed, layout.containerd_root)
    layout.containerd_state.mkdir(parents=True)
    layout.containerd_config.write_text(containerd.render_config(layout))
    return layout, containerd.start_containerd(layout, name=f"containerd-{name}")


# A containerd of its own, but containerd 1.6 keeps some host paths whatever it is told
# (sandbox/layout.py): it runs in the sandbox lane, never beside a sandbox.
@pytest.mark.sandbox
def test_nodes_seeded_from_one_import_each_hold_the_images_and_change_only_their_own(work: Path) -> None:
    tarballs = _archives(work / "archives", _spec("one", b"1"), _spec("two", b"2"))
    seed = seeds.seed(tarballs, seeds=work / "seeds")
    assert seeds.seed(tarballs, seeds=work / "seeds") == seed  # made once
    started = []
    try:
        nodes = {}
        for name in ("a", "b"):
            layout, process = _node(work, name, seed)
            started.append(process)
            nodes[name] = layout
            assert sorted(containerd.images(layout)) == sorted(tarballs)
        a = nodes["a"].containerd_root
        # Linked (containerd's collector may have taken blobs no image refers to: the import's index).
        blobs = [blob.name for blob in (a / BLOBS).iterdir()]
        assert blobs and all(os.stat(a / BLOBS / b).st_ino == os.stat(seed / BLOBS / b).st_ino for b in blobs)
        for database in seeds.DATABASES:
            assert os.stat(a / database).st_ino != os.stat(seed / database).st_ino  # its own

        containerd.ctr(nodes["a"], "images", "rm", "--sync", "docker.io/local/one:1")
        assert containerd.images(nodes["a"]) == ["docker.io/local/two:1"]
        assert sorted(containerd.images(nodes["b"])) == sorted(tarballs)
        assert all((seed / BLOBS / b).exists() for b in blobs)
    finally:
        for process in started:
            stop(process)
    # Other images: a seed of their own, and the seed of the same containerd for the old ones goes.
    changed = _archives(work / "changed", _spec("one", b"1 again"))
    assert seeds.seed(changed, seeds=work / "seeds") != seed
    assert not seed.exists()


def test_a_seed_goes_only_into_a_new_nodes_root(work: Path) -> None:
    (work / "seed").mkdir()
    (work / "root" / "io.containerd.content.v1.content").mkdir(parents=True)
    with pytest.raises(RuntimeError, match=r"containerd root .*/root is not empty"):
        seeds.plant(work / "seed", work / "root")
