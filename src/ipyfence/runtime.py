"""The server's private runtime directory and its housekeeping across crashes.

One 0700 directory per server holds every kernel's private dir, their logs, the server's pid and
the placeholders bwrap created. A server killed with SIGKILL cannot clean up, so the next server
start removes what dead servers left behind.

Shared temp dirs belong to every local user: anything named ``/tmp/ipyfence-*`` may have been made
by someone else. So runtime dirs live in a private parent — ``$XDG_RUNTIME_DIR/ipyfence`` when that
is ours, else ``/var/tmp/ipyfence-<uid>`` (or ``<tmp>/ipyfence-<uid>``) — created 0700 and verified
(a real directory, owned by us, no group/other access) before use. Clean-up looks only inside that
parent, only at entries we own, reads their files without following links and removes them with
``rmtree`` (which does not follow links). If the parent is not ours (another user made it first),
a fresh ``mkdtemp`` parent is used and nothing is cleaned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from pathlib import Path

from ipyfence import safefs
from ipyfence.errors import IpyfenceError

log = logging.getLogger(__name__)

RUNTIME_PREFIX = "ipyfence-"
MAX_OWNER_FILE = 4096  # bytes read from a stale dir's pid or placeholders file
OWNER_FILE = "server.pid"
PLACEHOLDERS_FILE = "placeholders"


def remove_placeholders(paths: list[str], *, trusted: bool = False) -> None:
    """Remove the empty read-only placeholders bwrap created; anything with content stays.

    The kernel may have replaced a placeholder's parent or the placeholder itself with a symlink:
    each one is removed relative to its parent directory opened without following links, and only
    if it is still an empty directory or an empty regular file.
    """
    from ipyfence.sandbox.plan import placeholder_names

    allowed = placeholder_names()
    for path in paths:
        parent, name = os.path.split(path)
        if not os.path.isabs(parent) or (not trusted and name not in allowed):
            continue  # from a file: only names ipyfence makes placeholders for, whatever the file says
        try:
            with safefs.opened_dir(parent) as fd:
                safefs.remove_if_empty(fd, name)
        except (OSError, IpyfenceError):
            continue


def _ours(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0


def shared_tmp_dirs() -> list[Path]:
    """Where the private parent may be made. /var/tmp before the temp dir: the kernel's writable
    /tmp must not contain its own private dir (Landlock rules apply to everything beneath a path)."""
    return list(dict.fromkeys([Path("/var/tmp"), Path(tempfile.gettempdir())]))


def private_parent(bases: list[Path] | None = None) -> tuple[Path, bool]:
    """(the parent of runtime dirs, whether it is our shared private parent, i.e. safe to clean)."""
    candidates: list[Path] = []
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg) and _ours(Path(xdg)):
        candidates.append(Path(xdg) / "ipyfence")
    candidates += [base / f"{RUNTIME_PREFIX}{os.geteuid()}" for base in bases or shared_tmp_dirs() if base.is_dir()]
    for candidate in candidates:
        with contextlib.suppress(FileExistsError, OSError):
            os.mkdir(candidate, 0o700)
        if _ours(candidate):
            return candidate, True
        log.warning("not using %s for runtime files: it is not a private directory of this user", candidate)
    base = (bases or shared_tmp_dirs())[0]
    return Path(tempfile.mkdtemp(prefix=f"{RUNTIME_PREFIX}{os.geteuid()}-", dir=base)), False


def _read_small(dir_fd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")
        return os.read(fd, MAX_OWNER_FILE).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def remove_stale_runtime_dirs(parent: Path) -> None:
    """Delete runtime dirs that killed servers left in our private ``parent`` (SIGKILL skips cleanup)."""
    try:
        parent_fd = safefs.open_dir(parent)
    except (OSError, IpyfenceError):
        return
    try:
        for name in os.listdir(parent_fd):
            if not name.startswith(RUNTIME_PREFIX):
                continue
            st = safefs.lstat_or_none(parent_fd, name)
            if st is None or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                with safefs.opened_dir(parent_fd, name) as fd:
                    pid = int(_read_small(fd, OWNER_FILE).strip())
                    if pid_alive(pid):
                        continue
                    with contextlib.suppress(OSError):
                        remove_placeholders(_read_small(fd, PLACEHOLDERS_FILE).splitlines())
                safefs.remove(parent_fd, name)
            except (OSError, ValueError, IpyfenceError):
                continue
    finally:
        os.close(parent_fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def make_runtime_root(bases: list[Path] | None = None) -> Path:
    """This server's runtime dir (0700), after removing what dead servers left behind."""
    parent, shared = private_parent(bases)
    if shared:
        remove_stale_runtime_dirs(parent)
    root = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX, dir=parent))
    with safefs.opened_dir(root) as fd:
        safefs.write_file(fd, OWNER_FILE, str(os.getpid()).encode(), mode=0o600)
    return root
