"""Mask a file inside a RUNNING sandbox, from the host, without restarting the kernel.

Masks are mounts made when the sandbox starts. A ``.env`` file created (or replaced by an
editor's atomic rename) on the host afterwards is readable in the running kernel. The server
created the sandbox's user namespace, so a helper process may join it (with ``setns``, after
finding the namespace that owns the sandbox's mount namespace: bwrap nests a second user
namespace for ``--disable-userns``) and mount ``/dev/null`` over the file in the sandbox's own
view. The kernel has no capabilities, so it cannot undo the mount.

The target is resolved inside the sandbox with ``openat2(RESOLVE_NO_SYMLINKS)`` and must be a
regular file: a symlink the kernel made is never followed, and a path that cannot be resolved
that way is reported as not masked (the caller then replaces the kernel: fail closed).
``setns`` into a user namespace needs a single-threaded process, hence a short-lived helper
run with the server's own interpreter in isolated mode (``-I``: no cwd, no PYTHON* variables).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)

HELPER_TIMEOUT = 10.0  # seconds for the helper to join the namespaces and mount

# Runs in a fresh single-threaded interpreter: argv = [pid, path, ...]; prints "ok PATH" per mask.
_HELPER = r"""
import ctypes, fcntl, os, stat, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NS_GET_USERNS, CLONE_NEWUSER, CLONE_NEWNS = 0xB701, 0x10000000, 0x00020000
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_OPENAT2 = 428, 429, 437  # the same on every architecture
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, 0o2000000
MOVE_MOUNT_F_EMPTY_PATH, MOVE_MOUNT_T_EMPTY_PATH = 0x4, 0x40
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS = 0x02, 0x04
AT_FDCWD = -100
def err(what):
    return f"{what}: {os.strerror(ctypes.get_errno())}"
mnt = os.open(f"/proc/{int(sys.argv[1])}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
owner = fcntl.ioctl(mnt, NS_GET_USERNS)
for fd, flag in ((owner, CLONE_NEWUSER), (mnt, CLONE_NEWNS)):
    if libc.setns(fd, flag) != 0:
        sys.exit(err("setns"))
how = struct.pack("QQQ", os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
for path in sys.argv[2:]:
    buf = ctypes.create_string_buffer(how, len(how))
    target = libc.syscall(SYS_OPENAT2, AT_FDCWD, path.encode(), buf, len(how))
    if target < 0:
        print("no", path, err("openat2"), flush=True)
        continue
    if not stat.S_ISREG(os.fstat(target).st_mode):
        print("no", path, "not a regular file", flush=True)
        continue
    null = libc.syscall(SYS_OPEN_TREE, AT_FDCWD, b"/dev/null", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
    if null < 0:
        sys.exit(err("open_tree"))
    flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
    if libc.syscall(SYS_MOVE_MOUNT, null, b"", target, b"", flags) != 0:
        print("no", path, err("move_mount"), flush=True)
        continue
    print("ok", path, flush=True)
"""


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        pass
    return found


def sandbox_pid(root: int) -> int | None:
    """The first process below ``root`` (the launched command) that lives in another mount namespace."""
    try:
        ours = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return None
    queue = [root]
    while queue:
        pid = queue.pop(0)
        try:
            if os.readlink(f"/proc/{pid}/ns/mnt") != ours:
                return pid
        except OSError:
            continue
        queue += _children(pid)
    return None


async def mask_files(root_pid: int, paths: Sequence[str]) -> set[str]:
    """Mask ``paths`` in the sandbox below ``root_pid``; returns those that are now masked."""
    pid = sandbox_pid(root_pid)
    if pid is None or not paths:
        return set()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-c",
        _HELPER,
        str(pid),
        *paths,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd="/",
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), HELPER_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return set()
    masked = set()
    for line in out.decode(errors="replace").splitlines():
        verdict, _, rest = line.partition(" ")
        if verdict == "ok":
            masked.add(rest)
        else:
            log.warning("could not mask %s in the running sandbox", rest)
    if proc.returncode != 0:
        log.warning("masking in the running sandbox failed: %s", err.decode(errors="replace").strip()[-300:])
    return masked
