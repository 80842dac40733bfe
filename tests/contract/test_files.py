"""The one atomic write: a reader sees the old file or the new one, with its mode, and a failed write
leaves the old file and no temporary one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tessera.files import write_atomically


def test_text_and_bytes_replace_the_file_whole_with_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "file"
    write_atomically(path, "first\n", mode=0o644)
    before = path.stat().st_ino
    write_atomically(path, b"\x00\x01", mode=0o444)
    assert path.read_bytes() == b"\x00\x01"
    assert path.stat().st_mode & 0o777 == 0o444
    assert path.stat().st_ino != before  # renamed over the old one, not written into it
    assert sorted(p.name for p in path.parent.iterdir()) == ["file"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "file"
    write_atomically(path, "old", mode=0o644)

    def full_disk(src: str, dst: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, "new", mode=0o644)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
