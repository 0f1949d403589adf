"""What is in the workspace's package dir, and removing one thing from it.

The package dir is a ``pip --target`` tree: ``NAME-VERSION.dist-info`` directories whose
RECORD lists the files each distribution owns, plus whatever else someone put there by hand
(a copied module, a stray directory). Both kinds are listed; both can be removed, a
distribution by its RECORD, a hand-made top-level module by its import name. Nothing here
follows a symlink out of the package dir. Pure file operations: the caller holds the locks.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from ipyfence.errors import ToolInputError
from ipyfence.packages.layout import dist_name_version, record_paths, remove_dist
from ipyfence.packages.runtime_pins import NOT_MODULES, Shadow, shadowing

_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
MAX_NAME = 200


@dataclass(frozen=True)
class Installed:
    name: str  # as its metadata spells it (canonical when unreadable)
    version: str
    installed: str  # UTC time of the dist-info directory, "2026-11-22 23:10 UTC"


@dataclass(frozen=True)
class Unowned:
    entry: str  # top-level file or directory no distribution's RECORD lists
    installed: str


def _when(path: Path) -> str:
    try:
        mtime = path.lstat().st_mtime
    except OSError:
        return "unknown"
    return datetime.datetime.fromtimestamp(mtime, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _dist_infos(packages_dir: Path) -> list[Path]:
    try:
        return sorted(p for p in packages_dir.glob("*.dist-info") if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _display_name(dist_info: Path) -> str:
    try:
        for line in (dist_info / "METADATA").read_text(errors="replace").splitlines():
            if line.startswith("Name:"):
                return line.split(":", 1)[1].strip()
            if not line.strip():
                break
    except OSError:
        pass
    return dist_name_version(dist_info)[0]


def _owned_tops(packages_dir: Path) -> dict[str, str]:
    """Top-level entry -> the name of a distribution whose RECORD lists a file under it."""
    root = os.path.realpath(packages_dir)
    tops: dict[str, str] = {}
    for info in _dist_infos(packages_dir):
        name = _display_name(info)
        tops[info.name] = name
        for path in record_paths(info, root):
            tops.setdefault(os.path.relpath(path, root).split(os.sep, 1)[0], name)
    return tops


def tops_of(packages_dir: Path, names: set[str]) -> set[str]:
    """Import names (top-level entries) of the installed distributions called ``names`` (canonical)."""
    root = os.path.realpath(packages_dir)
    tops: set[str] = set()
    for info in _dist_infos(packages_dir):
        if dist_name_version(info)[0] in names:
            for path in record_paths(info, root):
                entry = os.path.relpath(path, root).split(os.sep, 1)[0]
                if not entry.endswith(".dist-info") and entry not in NOT_MODULES:
                    tops.add(entry.split(".", 1)[0])
    return tops


def owner_of(packages_dir: Path, entry: str) -> str | None:
    """The distribution that installed top-level ``entry``, None when it was put there by hand."""
    return _owned_tops(packages_dir).get(entry)


def list_installed(packages_dir: Path) -> tuple[list[Installed], list[Unowned]]:
    dists = [Installed(_display_name(i), dist_name_version(i)[1], _when(i)) for i in _dist_infos(packages_dir)]
    owned = _owned_tops(packages_dir)
    unowned: list[Unowned] = []
    try:
        entries = sorted(os.scandir(packages_dir), key=lambda e: e.name)
    except OSError:
        entries = []
    for entry in entries:
        if entry.name in owned or entry.name in NOT_MODULES or entry.name.endswith(".dist-info"):
            continue
        unowned.append(
            Unowned(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""), _when(Path(entry.path)))
        )
    return sorted(dists, key=lambda d: canonicalize_name(d.name)), unowned


def render_listing(packages_dir: Path) -> str:
    dists, unowned = list_installed(packages_dir)
    shadows = {s.entry: s for s in shadowing(packages_dir)}
    lines = [f"Package dir of this workspace: {packages_dir}"]
    if not dists and not unowned:
        lines.append("Nothing is installed (install_package adds packages here).")
    for d in dists:
        lines.append(f"{d.name} {d.version}  (installed {d.installed})")
    if dists:
        owned = _owned_tops(packages_dir)
        for entry, shadow in shadows.items():
            if entry in owned:
                lines.append(f"  WARNING: {owned[entry]} provides {entry}, which shadows the kernel's {shadow.owner}")
    if unowned:
        lines.append("Not installed by pip (put there by hand; uninstall_package(name) removes them by import name):")
        for u in unowned:
            note = ""
            hit = shadows.get(u.entry.rstrip("/"))
            if hit is not None:
                note = f"  SHADOWS the kernel's {hit.owner}: the kernel cannot rely on it"
            lines.append(f"  {u.entry}  (modified {u.installed}){note}")
    return "\n".join(lines)


def check_name(package_name: str) -> str:
    name = package_name.strip()
    if not name or len(name) > MAX_NAME or not _NAME.match(name):
        shown = package_name if len(package_name) <= 80 else package_name[:77] + "..."
        raise ToolInputError(
            f"uninstall_package rejected {shown!r}: give one distribution name as list_packages() shows it, "
            "e.g. 'requests' (no version, options or paths)"
        )
    return name


@dataclass(frozen=True)
class Removed:
    what: str  # "fencetab 1.0.0" or "traitlets/ (put there by hand)"
    shadows: list[Shadow]  # what still shadows the runtime afterwards


def uninstall(packages_dir: Path, package_name: str) -> Removed:
    """Remove distribution ``package_name``, or else a hand-made top-level module of that import name."""
    name = check_name(package_name)
    wanted = canonicalize_name(name)
    root = os.path.realpath(packages_dir)
    for info in _dist_infos(packages_dir):
        dname, version = dist_name_version(info)
        if dname == wanted or canonicalize_name(_display_name(info)) == wanted:
            shown = f"{_display_name(info)} {version}"
            remove_dist(info, root)
            return Removed(shown, shadowing(packages_dir))
    _, unowned = list_installed(packages_dir)
    for u in unowned:
        entry = u.entry.rstrip("/")
        if entry == name or entry.split(".", 1)[0] == name:
            path = packages_dir / entry
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            return Removed(f"{u.entry} (put there by hand)", shadowing(packages_dir))
    dists, unowned = list_installed(packages_dir)
    have = [d.name for d in dists] + [u.entry for u in unowned]
    raise ToolInputError(
        f"{name!r} is not installed in this workspace's package dir ({packages_dir}); "
        + (f"it holds: {', '.join(have)}. " if have else "it is empty. ")
        + "Only packages installed with install_package (see list_packages()) can be removed; the kernel's own "
        "runtime (ipykernel, pydantic, …) belongs to the server and cannot be uninstalled."
    )
