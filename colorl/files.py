"""Files replaced whole or not at all: a reader (a resume, another rank, a crash's survivor) sees the
old text or the new, never half of it."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write `text` beside `path` and rename it over `path`. The temporary name carries the process
    id, so processes writing the same file at once do not write into each other's temporary; the
    file is created with the user's umask, like every other run file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
