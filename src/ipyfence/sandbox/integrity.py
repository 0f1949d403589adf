"""Notice when the host changes a path the sandbox masks or protects.

Masks are bind mounts on the file that existed at launch. When a host program replaces that
file by rename() (editors, ``dotenv set-key``, git's lock-file writes), Linux detaches the
mount in every other namespace, and the sandbox sees the new, unmasked file. Mounts cannot
be re-applied from outside, so ipyfence watches for it and replaces the kernel instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ipyfence.sandbox.plan import MountPlan

ENV_PREFIX = ".env"


@dataclass(frozen=True)
class Snapshot:
    """Inodes of masked/protected paths, and the .env names at the workspace root, at launch."""

    inodes: tuple[tuple[str, int, int], ...]  # (path, st_dev, st_ino)
    workspace: str
    root_env_names: frozenset[str]
    # Pinned ancestors: a host rename moves the protected path away with its mounts detached,
    # so for these "gone" counts as replaced too.
    pinned: tuple[tuple[str, int, int], ...] = ()


def _is_env_name(name: str) -> bool:
    return name == ENV_PREFIX or name.startswith(ENV_PREFIX + ".")


def _root_env_names(workspace: str) -> frozenset[str]:
    try:
        with os.scandir(workspace) as entries:
            return frozenset(e.name for e in entries if _is_env_name(e.name))
    except OSError:
        return frozenset()


def snapshot(plan: MountPlan, workspace: Path) -> Snapshot:
    """Take before the sandbox starts: a change in between then errs on the safe side."""
    inodes: list[tuple[str, int, int]] = []
    for path in (*plan.masked_files, *plan.readonly, *plan.sockets):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        inodes.append((path, st.st_dev, st.st_ino))
    pinned: list[tuple[str, int, int]] = []
    for path in plan.pinned:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        pinned.append((path, st.st_dev, st.st_ino))
    return Snapshot(tuple(inodes), str(workspace), _root_env_names(str(workspace)), tuple(pinned))


def replaced_paths(snap: Snapshot) -> list[str]:
    """Masked or protected paths that are now a different file: their mount is detached."""
    changed: list[str] = []
    for path, dev, ino in snap.inodes:
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone: nothing to read until it is re-created, which changes the inode
        if (st.st_dev, st.st_ino) != (dev, ino):
            changed.append(path)
    for path, dev, ino in snap.pinned:
        try:
            st = os.lstat(path)
        except OSError:
            changed.append(path)
            continue
        if (st.st_dev, st.st_ino) != (dev, ino):
            changed.append(path)
    return changed


def new_env_files(snap: Snapshot) -> list[str]:
    """``.env*`` files that appeared at the workspace root after launch (not masked in this kernel)."""
    return sorted(os.path.join(snap.workspace, n) for n in _root_env_names(snap.workspace) - snap.root_env_names)
