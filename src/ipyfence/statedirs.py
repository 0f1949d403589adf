"""Per-workspace persistent state: what lives where, listed and removed by ``ipyfence state``.

``$IPYFENCE_STATE_DIR`` (default ``~/.local/state/ipyfence``) holds ``workspaces/<name>-<digest>/``
per workspace: ``registry.json`` (registered MCP servers, placeholders kept, never secrets),
``site-packages/`` (install_package), ``pip-cache/``. The state dir is hidden from every kernel.
A server records its workspace path there (the directory name is only a digest of it) and marks
itself running, so a removal can refuse while a server uses the state.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ipyfence.errors import ConfigError
from ipyfence.runtime import pid_alive

WORKSPACE_FILE = "workspace"  # the absolute workspace path, one line
RUNNING_DIR = "running"  # one empty file per live server, named by its pid


@dataclass(frozen=True)
class StateInfo:
    directory: Path
    workspace: str | None  # None when no server recorded it (state from an older version)
    packages: int  # distributions in site-packages
    servers: int  # registered MCP servers
    size_bytes: int
    running: tuple[int, ...]  # pids of live servers using it


def mark_running(state_dir: Path, workspace: Path) -> Path:
    """Record the workspace path and this server's pid; returns the marker to remove at exit."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (state_dir / RUNNING_DIR).mkdir(mode=0o700, exist_ok=True)
    tmp = state_dir / f".{WORKSPACE_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(str(workspace) + "\n")
    os.replace(tmp, state_dir / WORKSPACE_FILE)
    marker = state_dir / RUNNING_DIR / str(os.getpid())
    marker.touch(mode=0o600)
    return marker


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):  # os.walk never follows symlinks to directories
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _info(directory: Path) -> StateInfo:
    try:
        workspace: str | None = (directory / WORKSPACE_FILE).read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        workspace = None
    packages = len(list((directory / "site-packages").glob("*.dist-info")))
    try:
        servers = len(json.loads((directory / "registry.json").read_text(encoding="utf-8")).get("servers", {}))
    except (OSError, ValueError, AttributeError):
        servers = 0
    running: list[int] = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory / RUNNING_DIR):
            if name.isdigit() and pid_alive(int(name)):
                running.append(int(name))
    return StateInfo(directory, workspace, packages, servers, _size(directory), tuple(sorted(running)))


def list_states(state_root: Path) -> list[StateInfo]:
    base = state_root / "workspaces"
    if not base.is_dir():
        return []
    dirs = sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink())
    return [_info(d) for d in dirs]


def remove_state(state_root: Path, key: str) -> StateInfo:
    """Remove one workspace's state, named by its workspace path or its state directory name."""
    states = list_states(state_root)
    wanted = os.path.abspath(os.path.expanduser(key))
    match = [s for s in states if s.directory.name == key or s.workspace == wanted]
    if not match:
        known = ", ".join(s.workspace or s.directory.name for s in states) or "none"
        raise ConfigError(f"no ipyfence state for {key!r} under {state_root} (known: {known})")
    state = match[0]
    if state.running:
        pids = ", ".join(map(str, state.running))
        raise ConfigError(f"a server (pid {pids}) is using the state of {state.workspace}; stop it first")
    shutil.rmtree(state.directory)
    return state
