"""Compose the kernel's command line: base env + policy → backend renderer → argv.

This is where rendering meets the machine (paths, which binary). It never spawns anything.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ipyfence.errors import SandboxUnavailableError
from ipyfence.sandbox import bwrap
from ipyfence.sandbox.plan import MountPlan, SandboxPaths, default_server_install, plan_mounts
from ipyfence.settings import Settings, platform_backend

BRIDGE_SOCKET = "bridge.sock"


@dataclass(frozen=True)
class Launch:
    """Everything needed to start one process in the sandbox."""

    argv: list[str]  # full command, sandbox prefix included
    env: dict[str, str]  # environment for the outermost process
    plan: MountPlan | None  # None when unsandboxed
    backend: str  # "bwrap", "srt" or "none"


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
    env = {
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": str(kernel_dir / "home"),
        "TMPDIR": "/tmp",
        "IPYTHONDIR": str(kernel_dir / "ipython"),
        "MPLCONFIGDIR": str(kernel_dir / "mpl"),
        "JUPYTER_RUNTIME_DIR": str(kernel_dir / "jupyter"),
        "PYTHONPATH": os.pathsep.join([str(settings.packages_dir), str(settings.workspace)]),
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
    return env


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


def find_bwrap() -> str:
    found = shutil.which("bwrap")
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
    return Launch(argv=cmd, env={"PATH": "/usr/bin:/bin"}, plan=plan, backend="bwrap")


# Exits unless the process that spawned us is still our parent: run right after setpriv has
# set the parent-death signal, it closes the race in which the server dies before bwrap's own
# --die-with-parent is in place (the orphan would otherwise never get the signal).
_PARENT_GUARD = 'read -r _ _ _ ppid _ < /proc/$$/stat; [ "$ppid" = "$1" ] || exit 125; shift; exec "$@"'


def parent_guard(argv: Sequence[str], parent_pid: int) -> list[str]:
    """``argv`` that dies with ``parent_pid`` even if it dies while we are still starting."""
    guard = ["setpriv", "--pdeathsig", "KILL", "--", "/bin/sh", "-c", _PARENT_GUARD, "ipyfence-guard"]
    return [*guard, str(parent_pid), *argv]


def kernel_argv(connection_file: Path) -> list[str]:
    # pipguard: %pip / !pip install answer with a pointer to install_package (idempotent, so a
    # trusted start-up step may install it as well).
    guard = "--IPKernelApp.extra_extensions=ipyfence.pipguard"
    return [sys.executable, "-m", "ipykernel_launcher", "-f", str(connection_file), guard]
