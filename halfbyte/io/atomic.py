"""Writing outputs so that a killed process never leaves something that looks complete: write
beside the target under a hidden temporary name, then rename (atomic within one filesystem)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _default_mode(full: int) -> int:
    """The mode a plain mkdir/open would give: mkdtemp/mkstemp make private (0700/0600) entries."""
    umask = os.umask(0o022)
    os.umask(umask)
    return full & ~umask


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yields an empty temporary directory beside `target`, renamed to `target` when the block
    ends without an error and removed otherwise. Raises FileExistsError when `target` appeared
    (as a non-empty directory or a file) while the block ran; nothing is overwritten."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    os.chmod(tmp, _default_mode(0o777))
    try:
        yield tmp
        try:
            if target.is_file():
                raise FileExistsError(errno.EEXIST, "exists", str(target))
            os.rename(tmp, target)  # replaces only an empty directory
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise FileExistsError(errno.EEXIST, "exists", str(target)) from None
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yields a unique temporary path beside `path`; renamed over `path` when the block ends
    without an error, removed otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    os.chmod(name, _default_mode(0o666))
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
