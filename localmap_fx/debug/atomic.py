"""Atomic file writes shared by the dumper and the CLI."""

from __future__ import annotations

import os
import secrets

__all__ = ["atomic_write"]


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a fresh temporary file and a rename.

    The temporary name is created with O_EXCL, so it never follows or reuses
    an existing file; readers see the old file or the whole new one.
    """
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mode honours the umask
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
