"""Host file operations inside kernel-writable trees that never follow a kernel-made symlink.

The kernel can replace any entry of the workspace with a symlink at any moment, so the host never
uses a path there twice: it opens a directory once (component by component, ``O_NOFOLLOW``) and
does everything else relative to that descriptor. New files are written under a fresh name and
renamed into place (a rename replaces a symlink, it never writes through one); trees are removed
with ``shutil.rmtree(dir_fd=…)``, which does not follow links.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from ipyfence.errors import UnsafePathError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(base: int | str | Path, rel: str | Path = "", *, create: bool = False, mode: int = 0o755) -> int:
    """A descriptor for ``base/rel`` where no component of ``rel`` may be a symlink (``base`` is trusted)."""
    fd = os.dup(base) if isinstance(base, int) else os.open(base, _DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        for part in Path(rel).parts:
            if part in ("", ".", "..", "/"):
                raise UnsafePathError(f"refusing path component {part!r} in {rel}")
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, mode, dir_fd=fd)
                nxt = _open_checked(fd, part, rel)
            except OSError as exc:
                raise _unsafe(fd, part, rel, exc) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_checked(dir_fd: int, name: str, rel: str | Path) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _unsafe(dir_fd, name, rel, exc) from None


def _unsafe(dir_fd: int, name: str, rel: str | Path, exc: OSError) -> UnsafePathError:
    try:
        st = os.lstat(name, dir_fd=dir_fd)
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
    except OSError:
        kind = f"unusable ({exc.strerror})"
    return UnsafePathError(f"refusing to write through {rel}: {name!r} is {kind} (it may have been planted)")


@contextlib.contextmanager
def opened_dir(base: int | str | Path, rel: str | Path = "", *, create: bool = False) -> Iterator[int]:
    fd = open_dir(base, rel, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def write_file(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Create or replace ``name`` in the directory: write a fresh file, then rename it into place."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def make_temp_dir(dir_fd: int, prefix: str, mode: int = 0o700) -> str:
    """A new, empty directory in the directory (like mkdtemp, relative to a descriptor)."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(6)}"
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
            return name
        except FileExistsError:
            continue
    raise UnsafePathError(f"cannot create a temporary directory with prefix {prefix!r}")


def lstat_or_none(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None


def remove(dir_fd: int, name: str) -> None:
    """Remove ``name`` (a tree, a file or a symlink itself), never following links."""
    st = lstat_or_none(dir_fd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def remove_if_empty(dir_fd: int, name: str) -> bool:
    """Remove ``name`` only if it is an empty directory or an empty regular file (a placeholder)."""
    st = lstat_or_none(dir_fd, name)
    if st is None:
        return False
    try:
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=dir_fd)  # fails unless empty
            return True
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            os.unlink(name, dir_fd=dir_fd)
            return True
    except OSError:
        pass
    return False
