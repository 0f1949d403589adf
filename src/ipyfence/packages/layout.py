"""Move a finished ``pip install --target STAGING`` into the kernel's package directory.

pip never writes the package directory itself: it installs into a staging directory
inside the sandbox, and the server moves the result in while no cell runs. Doing the
move here (instead of ``pip --target --upgrade``) means an upgrade removes the old
version's files by its RECORD (pip --target leaves the old ``.dist-info`` behind and
replaces whole shared directories such as ``bin/`` or namespace packages).

Everything in staging was written by untrusted build code, so nothing here follows a
symlink, and files named by an old RECORD are removed only inside the package directory.
"""

from __future__ import annotations

import csv
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name


@dataclass(frozen=True)
class Replaced:
    name: str
    old_version: str


def dist_name_version(dist_info: Path) -> tuple[str, str]:
    stem = dist_info.name[: -len(".dist-info")]
    name, _, version = stem.partition("-")
    return canonicalize_name(name), version


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def record_paths(dist_info: Path, root: str) -> list[str]:
    """Files an installed distribution owns, as absolute paths inside ``root``."""
    try:
        with open(dist_info / "RECORD", newline="", encoding="utf-8", errors="replace") as f:
            rows = list(csv.reader(f))
    except OSError:
        return []
    found: list[str] = []
    for row in rows:
        if not row or not row[0]:
            continue
        rel = row[0]
        # --target installs scripts from lib/python/../../bin: RECORD says ../../bin/NAME.
        if rel.startswith("../../"):
            rel = rel[len("../../") :]
        full = os.path.normpath(os.path.join(root, rel))
        if _inside(full, root) and full != root:
            found.append(full)
    return found


def remove_dist(dist_info: Path, root: str) -> None:
    parents: set[str] = set()
    for path in record_paths(dist_info, root):
        if _inside(os.path.realpath(os.path.dirname(path)), root) and (os.path.islink(path) or os.path.isfile(path)):
            os.unlink(path)
            parents.add(os.path.dirname(path))
    shutil.rmtree(dist_info, ignore_errors=True)
    # Drop directories the removal left empty (deepest first), never the root itself.
    for d in sorted(parents, key=len, reverse=True):
        while d != root and _inside(d, root):
            try:
                os.rmdir(d)
            except OSError:
                break
            d = os.path.dirname(d)


def _merge(src: Path, dst: Path) -> None:
    """Move src's entries into dst; directories present on both sides are merged."""
    for entry in os.scandir(src):
        if entry.is_symlink():
            continue  # wheels carry no symlinks: this one was planted by build code
        target = dst / entry.name
        if entry.is_dir(follow_symlinks=False):
            # Recurse even into new directories: a whole-directory move would carry symlinks along.
            if target.is_symlink() or (target.exists() and not target.is_dir()):
                target.unlink()
            target.mkdir(exist_ok=True)
            _merge(Path(entry.path), target)
            continue
        if not entry.is_file(follow_symlinks=False):
            continue  # fifos, sockets, devices
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        shutil.move(entry.path, target)  # a rename: staging is on the same filesystem


def install_staged(staging: Path, packages_dir: Path) -> list[Replaced]:
    """Replace older copies of the staged distributions, then move the staging tree in."""
    root = os.path.realpath(packages_dir)
    staged = {dist_name_version(p)[0] for p in staging.glob("*.dist-info") if not p.is_symlink()}
    replaced: list[Replaced] = []
    for old in sorted(packages_dir.glob("*.dist-info")):
        name, version = dist_name_version(old)
        if name in staged and not old.is_symlink():
            remove_dist(old, root)
            replaced.append(Replaced(name, version))
    _merge(staging, packages_dir)
    return replaced
