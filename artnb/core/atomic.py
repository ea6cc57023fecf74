"""Writes that survive a kill -9 or a power cut: a file or directory is either the old one or the new one.

Every durable write in artnb goes through here (the run directory, the judge cache, the converted model cache):
- `write_atomic`: a temp file in the same directory, flushed and fsynced, renamed over the target, then the
  directory fsynced, so the rename itself is on disk. Readers never see a half-written file.
- `publish_dir`: the same for a directory written in full first (a checkpoint): every file fsynced, then one
  rename. A directory that exists under its final name is complete.
- `append_line`: one `write` of a whole line to an append-only file, starting a fresh line if the file's last
  line was torn by a crash, then fsync. Readers skip a torn line (see `RunStore.history`). A full disk can accept
  part of a line (a short write): the file is then cut back to where it was, and the error raised.

`disk_full(error)` tells a full disk (or quota) apart from other failures, whichever library raised it, so that
callers can say so and what to do.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

_FULL = (errno.ENOSPC, errno.EDQUOT)
# Libraries that wrap the OS error in their own (safetensors: "I/O error: No space left on device (os error 28)")
_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def disk_full(error: BaseException, where: str | Path | None = None) -> bool:
    """True when `error` (or an error it was raised from) says the disk or the user's quota is full, or, for
    libraries whose write errors say nothing of it (torch.save: "iostream error"), when the disk holding
    `where` has less than 1 MiB left after the failure."""
    if where is not None and _free_bytes(where) < 2**20:
        return True
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL:
            return True
        if any(text in str(current) for text in _FULL_TEXT):
            return True
        current = current.__cause__ or current.__context__
    return False


def _free_bytes(where: str | Path) -> int:
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return 2**63
    return stats.f_bavail * stats.f_frsize


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
        data = (("\n" if torn else "") + line + "\n").encode()
        try:
            written = os.write(fd, data)  # one write: readers see all or nothing
            if written < len(data):  # a nearly full disk took part of it
                raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes fit", str(path))
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, size)  # no torn line left behind: the file is as it was
            raise
    finally:
        os.close(fd)


def _last_byte(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1)
