"""Compose the kernel's command line: base env + policy → backend renderer → argv.

This is where rendering meets the machine (paths, which binary). It never spawns anything.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ipyfence.errors import SandboxUnavailableError
from ipyfence.policy import is_glob
from ipyfence.sandbox import bwrap
from ipyfence.sandbox.plan import MountPlan, SandboxPaths, default_server_install, plan_mounts
from ipyfence.settings import Settings, platform_backend

BRIDGE_SOCKET = "bridge.sock"
BWRAP_PRIVATE = "/tmp/.ipyfence"  # inside the sandbox: HOME, IPYTHONDIR, … on the private /tmp
KERNEL_CONFIG_ENV = "IPYFENCE_KERNEL"  # read by kernel_boot


@dataclass(frozen=True)
class Launch:
    """Everything needed to start one process in the sandbox."""

    argv: list[str]  # full command, sandbox prefix included
    env: dict[str, str]  # environment for the outermost process
    plan: MountPlan | None  # None when unsandboxed
    backend: str  # "bwrap", "srt" or "none"
    args: bytes = b""  # bwrap's --setenv pairs, read from a 0600 file on fd bwrap.ARGS_FD (never on argv)


def kernel_paths(settings: Settings, kernel_dir: Path, runtime_root: Path) -> SandboxPaths:
    return SandboxPaths(
        workspace=settings.workspace,
        kernel_dir=kernel_dir,
        runtime_root=runtime_root,
        state_root=settings.state_root,
        packages_dir=settings.packages_dir,
        server_install=default_server_install(),
        python=Path(sys.executable),
    )


def base_env(settings: Settings, kernel_dir: Path, bridge_token: str) -> dict[str, str]:
    """The minimal environment a kernel needs, then the user's KERNEL_ENV_ set.

    User variables may override anything except ``IPYFENCE_*``, which wire up the bridge,
    and ``PATH``/``PYTHONPATH``, which they extend (``merge_search_paths``).
    """
    bindir = os.path.dirname(sys.executable)
    backend = platform_backend(settings) if settings.sandbox else "none"
    # bwrap: the kernel's own files live in the sized private /tmp (a tmpfs), never on the host
    # disk; the host-disk private dir then holds only the connection file and sockets.
    private = Path(BWRAP_PRIVATE) if backend == "bwrap" else kernel_dir
    dirs = {"HOME": private / "home", "IPYTHONDIR": private / "ipython", "MPLCONFIGDIR": private / "mpl"}
    dirs["JUPYTER_RUNTIME_DIR"] = private / "jupyter"
    env = {
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        **{key: str(path) for key, path in dirs.items()},
        "TMPDIR": "/tmp",
        # The workspace joins sys.path only after start-up (kernel_boot), never before.
        "PYTHONPATH": str(settings.packages_dir),
        "PYTHONSAFEPATH": "1",
        "PYTHONNOUSERSITE": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        "TERM": "dumb",
        # ipykernel forces colour (TERM=xterm-color, FORCE_COLOR, ...); this undoes it before any cell.
        "PYTHONSTARTUP": str(Path(__file__).resolve().parents[1] / "kernel_plain_env.py"),
        # No network in here: a pip started from a cell fails at once instead of retrying (pipguard).
        "PIP_NO_INDEX": "1",
        "PIP_RETRIES": "0",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    user = {k: v for k, v in settings.kernel_env.items() if not k.startswith("IPYFENCE_")}
    env.update(user | merge_search_paths(env, user))
    env["IPYFENCE_BRIDGE_SOCKET"] = str(kernel_dir / BRIDGE_SOCKET)
    env["IPYFENCE_BRIDGE_TOKEN"] = bridge_token
    env[KERNEL_CONFIG_ENV] = json.dumps(kernel_config(settings, kernel_dir, backend, [str(d) for d in dirs.values()]))
    return env


def kernel_config(settings: Settings, kernel_dir: Path, backend: str, private_dirs: list[str]) -> dict[str, object]:
    """What the kernel's trusted start-up (kernel_boot) needs: nothing secret."""
    fs = settings.policy.filesystem
    writable = [str(settings.workspace), *(p for p in fs.allow_write if not is_glob(p)), "/tmp", "/dev"]
    if backend == "bwrap":  # its own /proc (e.g. /proc/self/oom_score_adj); /proc/sys & co. are read-only binds
        writable.append("/proc")
    if backend != "bwrap":  # srt: the kernel's own files stay in its private dir
        writable += [*private_dirs, str(kernel_dir / "tmp")]
    return {
        "workspace": str(settings.workspace),
        "private_dirs": private_dirs,
        "lockdown": settings.sandbox,
        "writable": list(dict.fromkeys(writable)),
        "sockets": [str(kernel_dir)],  # only its ZMQ sockets may be created there
        "allow_unix_sockets": settings.policy.network.allow_all_unix_sockets,
    }


def merge_search_paths(base: Mapping[str, str], user: Mapping[str, str]) -> dict[str, str]:
    """KERNEL_ENV_PATH / KERNEL_ENV_PYTHONPATH add to the kernel's paths instead of replacing them.

    PYTHONPATH: ipyfence's entries (the package dir first) then the user's. PATH: the server's
    bindir (the kernel's own python and pip) first, then the user's entries, then the system
    directories. Empty entries are dropped (an empty entry means the current directory) and
    duplicates keep their first place.
    """
    merged: dict[str, str] = {}
    for key, keep_first in (("PYTHONPATH", None), ("PATH", 1)):
        if key not in user:
            continue
        ours = [p for p in base.get(key, "").split(os.pathsep) if p]
        theirs = [p for p in user[key].split(os.pathsep) if p]
        cut = len(ours) if keep_first is None else keep_first
        merged[key] = os.pathsep.join(dict.fromkeys([*ours[:cut], *theirs, *ours[cut:]]))
    return merged


def trusted_path() -> str:
    """The server's PATH for finding its own helpers (bwrap, srt): no empty or relative entries and
    nothing under the server's working directory, which is often the workspace the kernel writes."""
    cwd = os.path.realpath(os.getcwd())
    kept = [
        p
        for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
        if os.path.isabs(p) and not (os.path.realpath(p) + "/").startswith(cwd.rstrip("/") + "/")
    ]
    return os.pathsep.join(kept) or "/usr/bin:/bin"


def find_bwrap() -> str:
    found = shutil.which("bwrap", path=trusted_path())
    if not found:
        raise SandboxUnavailableError(
            "bubblewrap (bwrap) is not installed, so the kernel cannot be sandboxed.\n"
            "  fix: sudo apt-get install bubblewrap   (Fedora: sudo dnf install bubblewrap)\n"
            "  check: ipyfence doctor\n"
            "  (or run unsandboxed on purpose with --no-sandbox)"
        )
    return found


def build_launch(
    settings: Settings,
    paths: SandboxPaths,
    env: Mapping[str, str],
    argv: Sequence[str],
    *,
    options: bwrap.LaunchOptions = bwrap.DEFAULT_OPTIONS,
) -> Launch:
    """The sandboxed (or, with --no-sandbox, plain) launch of ``argv``."""
    if not settings.sandbox:
        host = {**env, "PATH": env.get("PATH", os.environ.get("PATH", "/usr/bin:/bin"))}
        return Launch(argv=list(argv), env=host, plan=None, backend="none")
    backend = platform_backend(settings)
    if backend == "srt":
        from ipyfence.sandbox import srt_launch  # the srt backend lives in its own module

        return srt_launch.build(settings, paths, env, argv, options=options)
    if settings.policy.network.allowed_domains:
        raise SandboxUnavailableError(
            "the policy allows network domains "
            f"({', '.join(settings.policy.network.allowed_domains)}), which needs srt's filtering proxy; "
            "bwrap can only allow all network or none. Use --sandbox-backend srt (or auto)."
        )
    plan = plan_mounts(settings.policy, paths)
    cmd = bwrap.render(settings.policy, plan, paths, env, argv, bwrap=find_bwrap(), options=options)
    # bwrap itself gets a minimal environment: --clearenv resets it for the kernel anyway.
    cmd, args = bwrap.move_env_to_args_fd(cmd)
    return Launch(argv=cmd, env={"PATH": "/usr/bin:/bin"}, plan=plan, backend="bwrap", args=args)


# Exits unless the process that spawned us is still our parent: run right after setpriv has
# set the parent-death signal, it closes the race in which the server dies before bwrap's own
# --die-with-parent is in place (the orphan would otherwise never get the signal).
# With an args file ($2, not "-"), it is opened on bwrap's --args descriptor for the command.
_PARENT_GUARD = (
    'read -r _ _ _ ppid _ < /proc/$$/stat; [ "$ppid" = "$1" ] || exit 125; args="$2"; shift 2; '
    f'[ "$args" = - ] && exec "$@"; exec "$@" {bwrap.ARGS_FD}<"$args"'
)


def parent_guard(argv: Sequence[str], parent_pid: int, args_file: str = "-") -> list[str]:
    """``argv`` that dies with ``parent_pid`` even if it dies while we are still starting.

    ``args_file`` (a 0600 file in the runtime root) is opened on bwrap's ``--args`` descriptor."""
    guard = ["setpriv", "--pdeathsig", "KILL", "--", "/bin/sh", "-c", _PARENT_GUARD, "ipyfence-guard"]
    return [*guard, str(parent_pid), args_file, *argv]


def args_file(launch: Launch, path: Path) -> str:
    """Write the launch's bwrap ``--args`` pairs to ``path`` (0600, host-only); "-" when there are none."""
    if not launch.args:
        return "-"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(launch.args)
    return str(path)


def with_args_fd(argv: Sequence[str], args_path: str) -> list[str]:
    """``argv`` with the args file open on bwrap's ``--args`` descriptor (for launches without a guard)."""
    if args_path == "-":
        return list(argv)
    return ["/bin/sh", "-c", f'f="$1"; shift; exec "$@" {bwrap.ARGS_FD}<"$f"', "ipyfence-args", args_path, *argv]


def sandboxed_exec(argv: Sequence[str]) -> list[str]:
    """``argv`` behind kernel_boot's seccomp step (no keyring, no unix sockets), e.g. for pip."""
    return [sys.executable, "-P", "-m", "ipyfence.kernel_boot", "--exec", "--", *argv]


def kernel_argv(connection_file: Path) -> list[str]:
    # pipguard: %pip / !pip install answer with a pointer to install_package (idempotent, so a
    # trusted start-up step may install it as well).
    guard = "--IPKernelApp.extra_extensions=ipyfence.pipguard"
    # History in memory: a full private /tmp (tmpSizeMb) must not break the shell's sqlite file.
    memory_history = "--HistoryManager.hist_file=:memory:"
    # kernel_boot (the server's read-only install) locks the kernel down, then runs ipykernel_launcher.
    return [sys.executable, "-m", "ipyfence.kernel_boot", "-f", str(connection_file), guard, memory_history]
