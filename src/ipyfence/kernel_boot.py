"""The kernel's trusted start-up inside the sandbox: lock down, then run ipykernel. Stdlib only.

Runs as ``python -m ipyfence.kernel_boot -f CONNECTION_FILE …`` from the server's read-only install,
with the kernel's private directory as the working directory and ``PYTHONSAFEPATH=1``, so nothing
from the workspace is imported before user code: a planted ``ipykernel_launcher.py``,
``sitecustomize.py`` or ``traitlets.py`` in the workspace never runs at start-up. Two steps:

1. ``main`` (single-threaded, before ipykernel starts any thread), when sandboxed: a Landlock
   ruleset that allows filesystem writes only beneath the writable roots (the workspace, the
   policy's allowWrite, the sandbox's private /tmp and /dev) and, beneath the kernel's private
   directory on the host disk, only the creation of its ZMQ sockets; with Landlock ABI >= 6 it
   also scopes abstract unix sockets and signals to the sandbox. Every later thread and process
   inherits it. Without Landlock the sandbox's read-only binds still hold; a warning says so.
2. ``after_start`` (from the PYTHONSTARTUP file, once the shell exists and before any cell):
   move into the workspace (which also puts it on ``sys.path`` as ``''``), open the one tool-bridge
   connection, then install a seccomp filter on every thread that refuses ``socket(AF_UNIX, …)``,
   io_uring and the kernel keyring. From then on no cell can connect to any host unix socket
   (ssh-agent, docker.sock, …): the kernel's own channels and bridge connection already exist.
   If the filter cannot be installed the kernel exits: it never runs without it (fail closed).

The configuration comes in ``$IPYFENCE_KERNEL`` (JSON, nothing secret), removed after use.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CONFIG_ENV = "IPYFENCE_KERNEL"
EXIT_LOCKDOWN_FAILED = 70  # the kernel exits with this when it cannot lock itself down

# Landlock (linux/landlock.h). The system call numbers are the same on every architecture.
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
FS_WRITE_FILE, FS_REMOVE_DIR, FS_REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
FS_MAKE_CHAR, FS_MAKE_DIR, FS_MAKE_REG, FS_MAKE_SOCK = 1 << 6, 1 << 7, 1 << 8, 1 << 9
FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM, FS_REFER, FS_TRUNCATE = 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _fail(message: str) -> None:
    print(f"ipyfence kernel start-up: {message}; refusing to run without it", file=sys.stderr, flush=True)
    os._exit(EXIT_LOCKDOWN_FAILED)


def landlock(writable: list[str], sockets_only: list[str]) -> str | None:
    """Apply the write ruleset to this (still single-threaded) process; None, or why it was not."""
    libc = _libc()
    abi = libc.syscall(SYS_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    if abi < 1:
        return f"Landlock is not available on this kernel ({os.strerror(ctypes.get_errno())})"
    handled = FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_CHAR | FS_MAKE_DIR | FS_MAKE_REG
    handled |= FS_MAKE_SOCK | FS_MAKE_FIFO | FS_MAKE_BLOCK | FS_MAKE_SYM
    handled |= (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = (ctypes.c_uint64 * 3)(handled, 0, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return f"landlock_create_ruleset failed ({os.strerror(ctypes.get_errno())})"
    try:
        for paths, allowed in ((writable, handled), (sockets_only, FS_MAKE_SOCK)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # absent: nothing to allow there
                rule = (ctypes.c_uint8 * 12).from_buffer_copy(allowed.to_bytes(8, "little") + fd.to_bytes(4, "little"))
                ok = libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), 0)
                os.close(fd)
                if ok != 0:
                    return f"landlock_add_rule({path}) failed ({os.strerror(ctypes.get_errno())})"
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if libc.syscall(SYS_RESTRICT_SELF, ruleset, 0) != 0:
            return f"landlock_restrict_self failed ({os.strerror(ctypes.get_errno())})"
    finally:
        os.close(ruleset)
    return None


def seccomp(deny_unix_sockets: bool) -> None:
    """The seccomp filter on every thread of this process (TSYNC), or exit."""
    from ipyfence import bpf

    arch = bpf.native()
    if arch is None:
        _fail(f"no seccomp filter for this architecture ({os.uname().machine})")
        return
    prog = bpf.program(arch, deny_unix_sockets=deny_unix_sockets)
    buf = ctypes.create_string_buffer(prog, len(prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail(f"prctl(NO_NEW_PRIVS) failed ({os.strerror(ctypes.get_errno())})")
    rc = libc.syscall(arch.seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(fprog))
    if rc != 0:
        _fail(f"the seccomp filter could not be installed on every thread (rc={rc}, {os.strerror(ctypes.get_errno())})")


def _strings(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _config() -> dict[str, object]:
    try:
        value = json.loads(os.environ.get(CONFIG_ENV, "") or "{}")
    except ValueError:
        value = {}
    return value if isinstance(value, dict) else {}


def main() -> None:
    cfg = _config()
    for path in _strings(cfg.get("private_dirs")):  # HOME, IPYTHONDIR, … (in the sandbox's /tmp)
        os.makedirs(path, mode=0o700, exist_ok=True)
    if cfg.get("lockdown"):
        why = landlock(_strings(cfg.get("writable")), _strings(cfg.get("sockets")))
        if why is not None:
            print(f"ipyfence kernel start-up: WARNING: {why}; the sandbox's mounts still apply", file=sys.stderr)
    import runpy

    sys.argv[0] = "ipykernel_launcher"
    runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)


def after_start() -> None:
    """Once the shell exists, before any cell: into the workspace, bridge connection, seccomp."""
    cfg = _config()
    os.environ.pop(CONFIG_ENV, None)
    os.environ.pop("PYTHONSAFEPATH", None)  # the kernel's own start-up only: `!python script.py` behaves normally
    workspace = cfg.get("workspace")
    if isinstance(workspace, str):
        try:
            os.chdir(workspace)
        except OSError as exc:
            _fail(f"cannot enter the workspace {workspace}: {exc}")
        # The workspace joins sys.path now, where IPython would put the current directory (after the
        # package dir and the standard library, before site-packages); PYTHONSAFEPATH kept it out so far.
        at = next((i for i, p in enumerate(sys.path) if os.path.basename(p) in ("site-packages", "dist-packages")), 0)
        if workspace not in sys.path:
            sys.path.insert(at, workspace)
    if not cfg.get("lockdown"):
        return
    block_unix = not cfg.get("allow_unix_sockets")
    if block_unix:
        from ipyfence.mcptools import client

        try:
            client.preconnect(float(str(cfg.get("bridge_timeout", 60))))
        except Exception as exc:  # no bridge: tool calls fail later, the lockdown must still happen
            print(f"ipyfence kernel start-up: no tool bridge connection: {exc}", file=sys.stderr)
    seccomp(deny_unix_sockets=block_unix)


def exec_filtered(argv: list[str]) -> None:
    """``--exec -- CMD …``: the seccomp filter (no keyring, no unix sockets), then exec CMD."""
    seccomp(deny_unix_sockets=True)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    if sys.argv[1:3] == ["--exec", "--"] and len(sys.argv) > 3:
        exec_filtered(sys.argv[3:])
    main()
