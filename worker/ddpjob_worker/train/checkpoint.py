"""The checkpoint on disk: written whole or not at all (a temporary file, flushed, renamed over
the old one, the directory flushed), so a reader sees the old checkpoint or the new one, never a
torn file. No torch."""

from __future__ import annotations

import os
from pathlib import Path


def write(path: Path, payload: bytes | memoryview) -> None:
    """Replace ``path`` with ``payload``, atomically and durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself
        finally:
            os.close(directory)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
