"""Render a policy into a bubblewrap command line. Pure: no subprocess, no ``which``.

Safety flags that are always on (not options): a new session (no TIOCSTI into the
server's terminal), die with the parent, every capability dropped (bwrap keeps them for
root otherwise, and with them kernel code could unmount its own masks), new user, pid,
ipc, uts and cgroup namespaces, a fresh /proc, a private /tmp, and a cleared environment.
The network namespace is always unshared for kernels, and for install_package's pip too (it
reaches the index through a unix socket to a filtering proxy, see packages/proxy.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ipyfence.policy import LimitsPolicy, Policy
from ipyfence.sandbox.plan import MountPlan, SandboxPaths

ALWAYS = (
    "--die-with-parent",
    "--new-session",
    "--unshare-user",
    "--unshare-pid",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--disable-userns",
    "--cap-drop",
    "ALL",
    "--hostname",
    "ipyfence",
)

# Host directories the plan hides that bwrap replaces with private writable ones instead (render).
PRIVATE_DIRS = frozenset({"/dev/shm"})

CPU_GRACE = 5  # CPU seconds between SIGXCPU and SIGKILL, for a cell that ignores SIGXCPU

# Mount operations at the same path apply in this order; parents always come first.
_BIND, _PIN, _SEAL, _REBIND, _HIDE, _MASK, _READONLY, _REALLOW, _KERNEL = range(9)


@dataclass(frozen=True)
class LaunchOptions:
    """Per-launch choices that are not part of the user's policy."""

    network: bool = False  # share the host network (nothing uses it under bwrap; srt: its index proxy)
    extra_writable: tuple[str, ...] = ()  # e.g. the package dir and pip cache while installing
    die_with_stdin: bool = False  # kill everything inside when stdin (a pipe the server holds) closes
    chdir: str = ""  # working directory inside ("" = the kernel's private dir); never the workspace


DEFAULT_OPTIONS = LaunchOptions()

# Inside the sandbox: a watcher waits for EOF on stdin, a pipe whose other end only the server
# holds, then kills every process in the sandbox's pid namespace. bwrap's --die-with-parent has a
# window (its inner process sets its death signal only after clone) in which a dying server
# leaves the sandbox running; the pipe closes however the server dies. The command itself gets
# /dev/null as stdin. (A background job's stdin is /dev/null in sh, hence the copy on fd 3.)
STDIN_WATCH = 'exec 3<&0; (read -r _ <&3; kill -KILL -1) & exec "$@" </dev/null 3<&-'


def _depth(path: str) -> int:
    return path.rstrip("/").count("/")


def _mount_ops(plan: MountPlan, paths: SandboxPaths, options: LaunchOptions) -> list[list[str]]:
    ops: list[tuple[int, int, str, list[str]]] = []
    for p in (*plan.writable, *options.extra_writable):
        ops.append((_depth(p), _BIND, p, ["--bind", p, p]))
    for p in plan.pinned:  # after the writable root, before the read-only binds inside it
        ops.append((_depth(p), _PIN, p, ["--bind", p, p]))
    for p in plan.sealed:  # read-only at its root; then its non-dot entries writable again
        ops.append((_depth(p), _SEAL, p, ["--ro-bind", p, p]))
    for p in plan.rebound:
        ops.append((_depth(p), _REBIND, p, ["--bind", p, p]))
    # Nothing can be created at a sealed dir's root: placeholders there are not needed (for srt
    # they are), and bwrap could not make their mount points in the read-only dir.
    absent_dirs = [p for p in plan.absent_dirs if os.path.dirname(p) not in plan.sealed]
    absent_files = [p for p in plan.absent_files if os.path.dirname(p) not in plan.sealed]
    # /dev/shm: render gives the sandbox a private writable one instead of hiding it.
    hidden = [p for p in (*plan.hidden_dirs, *absent_dirs, *plan.unscanned) if p not in PRIVATE_DIRS]
    for p in hidden:
        ops.append((_depth(p), _HIDE, p, ["--perms", "0555", "--tmpfs", p]))
    for p in (*plan.masked_files, *absent_files, *plan.sockets):
        ops.append((_depth(p), _MASK, p, ["--ro-bind", "/dev/null", p]))
    for p in plan.readonly:
        ops.append((_depth(p), _READONLY, p, ["--ro-bind", p, p]))
    for p in plan.reallowed:
        if p not in options.extra_writable:
            ops.append((_depth(p), _REALLOW, p, ["--ro-bind", p, p]))
    k = str(paths.kernel_dir)
    ops.append((_depth(k), _KERNEL, k, ["--bind", k, k]))
    ops.sort(key=lambda op: (op[0], op[1], op[2]))
    # Hidden dirs become read-only last, so that mount points inside them can still be made.
    remounts = [["--remount-ro", p] for p in hidden]
    return [op[3] for op in ops] + remounts


def limits_prefix(limits: LimitsPolicy) -> list[str]:
    """``prlimit`` argv applying rlimits to the kernel process (inherited by its children)."""
    flags: list[str] = []
    if limits.memory_mb:
        flags.append(f"--as={limits.memory_mb * 1024 * 1024}")
    if limits.max_processes:
        flags.append(f"--nproc={limits.max_processes}")
    if limits.cpu_seconds:
        # soft < hard: at the soft limit the kernel gets SIGXCPU, which names the cause; with
        # soft == hard Linux sends SIGKILL instead, indistinguishable from an OOM kill.
        flags.append(f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + CPU_GRACE}")
    if limits.max_file_size_mb:
        flags.append(f"--fsize={limits.max_file_size_mb * 1024 * 1024}")
    if limits.open_files:
        flags.append(f"--nofile={limits.open_files}")
    flags.append("--core=0")  # no core dumps of kernel memory into the workspace
    return ["prlimit", *flags, "--"]


def render(
    policy: Policy,
    plan: MountPlan,
    paths: SandboxPaths,
    env: Mapping[str, str],
    argv: Sequence[str],
    *,
    bwrap: str = "bwrap",
    options: LaunchOptions = DEFAULT_OPTIONS,
) -> list[str]:
    """The full bwrap argv that runs ``argv`` under ``policy``."""
    cmd = [bwrap, *ALWAYS]
    if not options.network:
        cmd.append("--unshare-net")
    cmd.append("--clearenv")
    for key in sorted(env):
        cmd += ["--setenv", key, env[key]]
    cmd += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for p in plan.proc_readonly:  # always on: see plan.PROC_READONLY
        cmd += ["--ro-bind", p, p]
    for p in plan.proc_masked:
        cmd += ["--ro-bind", "/dev/null", p]
    if policy.limits.tmp_size_mb:
        cmd += ["--size", str(policy.limits.tmp_size_mb * 1024 * 1024)]
    cmd += ["--tmpfs", "/tmp"]
    # A private, sized /dev/shm (POSIX semaphores and shared memory work; --dev already hides the host's).
    if policy.limits.tmp_size_mb:
        cmd += ["--size", str(policy.limits.tmp_size_mb * 1024 * 1024)]
    cmd += ["--tmpfs", "/dev/shm"]
    for op in _mount_ops(plan, paths, options):
        cmd += op
    # Start in the private dir (or where the launch asks): nothing in the workspace is imported
    # before user code (kernel_boot), and pip never runs from it.
    cmd += ["--chdir", options.chdir or str(paths.kernel_dir), "--"]
    if options.die_with_stdin:
        cmd += ["/bin/sh", "-c", STDIN_WATCH, "ipyfence-watch"]
    cmd += [*limits_prefix(policy.limits), *argv]
    return cmd


ARGS_FD = 9  # bwrap reads its --setenv pairs from this descriptor (opened by launch.parent_guard)


def move_env_to_args_fd(argv: Sequence[str]) -> tuple[list[str], bytes]:
    """Take every ``--setenv KEY VALUE`` out of ``argv`` into NUL-separated bytes for ``--args FD``.

    ``/proc/PID/cmdline`` is readable by every local user: KERNEL_ENV_ values and the bridge token
    must not be there. bwrap reads the pairs from the descriptor at the place of ``--args``.
    """
    out: list[str] = []
    pairs: list[str] = []
    i = 0
    end = argv.index("--") if "--" in argv else len(argv)
    while i < len(argv):
        if i < end and argv[i] == "--setenv":
            if not pairs:
                out += ["--args", str(ARGS_FD)]
            pairs += argv[i : i + 3]
            i += 3
            continue
        out.append(argv[i])
        i += 1
    return out, b"".join(p.encode() + b"\0" for p in pairs)
