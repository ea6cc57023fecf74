"""Writes that survive a kill -9 or a power cut: a file or directory is either the old one or the new one.

Every durable write in artnb goes through here (the run directory, the judge cache, the converted model cache):
- `write_atomic`: a temp file in the same directory, flushed and fsynced, renamed over the target, then the
  directory fsynced, so the rename itself is on disk. Readers never see a half-written file.
- `publish_dir`: the same for a directory written in full first (a checkpoint): every file fsynced, then one
  rename. A directory that exists under its final name is complete.
- `append_line`: one `write` of a whole line to an append-only file, starting a fresh line if the file's last
  line was torn by a crash, then fsync. Readers skip a torn line (see `RunStore.history`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory `path` (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Replace `path` with `data` (str is written as UTF-8) so that a crash leaves the old or the new content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_tree(directory: str | Path) -> None:
    """fsync every file under `directory`, and the directories themselves."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def publish_dir(tmp: str | Path, final: str | Path) -> Path:
    """Move the fully written directory `tmp` to `final` (which must not exist) durably, in one rename."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    os.rename(tmp, final)  # not os.replace: a directory already there is an error, never merged or replaced
    fsync_dir(final.parent)
    return final


def append_line(path: str | Path, line: str) -> None:
    """Append `line` (no newline inside) durably; if a crash left the file without a final newline, start a new line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        torn = size > 0 and _last_byte(path, size) != b"\n"
        os.write(fd, (("\n" if torn else "") + line + "\n").encode())  # one write: readers see all or nothing
        os.fsync(fd)
    finally:
        os.close(fd)


def _last_byte(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1)
