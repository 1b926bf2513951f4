"""Files replaced whole or not at all: a reader (a resume, another rank, a crash's survivor) sees the
old text or the new, never half of it; and folders only their owner may write into."""
from __future__ import annotations

import os
import stat
from pathlib import Path


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write `text` beside `path`, flush it to disk, and rename it over `path`. The temporary name carries
    the process id, so processes writing the same file at once do not write into each other's temporary;
    the data reaches the disk before the rename, so a crash leaves the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = text.encode("utf-8") if isinstance(text, str) else text
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class UnsafeFolder(OSError):
    """A cache folder another user could write into: nothing in it may be trusted or run."""


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user can write into (created 0700 if missing): what colorl caches and
    then loads or runs (compiled code, kernel verdicts) must not come from another local user. A folder of
    this user's that group or others may write into (an older colorl, a umask of 002) is closed to them;
    one owned by someone else raises UnsafeFolder."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise UnsafeFolder(f"{path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.chmod(path, 0o700)
    return path
