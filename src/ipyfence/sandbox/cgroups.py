"""Per-kernel cgroups: the limits that rlimits cannot enforce.

Why: RLIMIT_NPROC is never applied to uid 0 (the kernel exempts the init user even inside a
user namespace), so as root a fork bomb is only stopped by a cgroup ``pids.max``; and
RLIMIT_AS bounds each process, not the kernel's whole process tree. Each kernel gets its own
group (``<our cgroup>/ipyfence-<server pid>/k<n>``) so a bomb in one kernel cannot starve the
standby, and so stopping a kernel can kill every process in its group, pid namespace or not.

Processes join the group *before* exec via a tiny ``sh`` wrapper, so nothing the kernel
starts can be outside it. cgroup v2 is used when our cgroup delegates the controller to us,
otherwise a writable cgroup v1 hierarchy; when neither works the limit falls back to rlimits
(logged once). Impure by design; the bwrap renderer stays pure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ipyfence.policy import LimitsPolicy

log = logging.getLogger(__name__)

PREFIX = "ipyfence-"
CONTROLLERS = ("pids", "memory")
# Joins every cgroup.procs given before "--", then execs the rest; exit 125 if a join fails,
# so a kernel never runs outside the limits it was promised.
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class Hierarchy:
    """Where one controller's groups are made: ``base`` is our server's own group."""

    controller: str
    base: Path
    version: int  # 1 or 2


@dataclass(frozen=True)
class Events:
    """Counters from a kernel's groups; compare two readings to see what a cell hit."""

    pids_max: int = 0  # fork/clone refused by pids.max
    oom_kills: int = 0  # processes killed by the memory limit


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, options) of the cgroup mounts we can see."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                found.append((parts[1].replace("\\040", " "), parts[2], set(parts[3].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Our cgroup path per v1 controller, and under key ``""`` for cgroup v2."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                paths[name] = path
    return paths


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _read_counter(path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _v2_hierarchies(mount: str, own: str, wanted: list[str]) -> list[Hierarchy]:
    """Controllers our v2 cgroup delegates (already in its subtree_control, or addable)."""
    parent = Path(mount) / own.lstrip("/")
    try:
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
    except OSError:
        return []
    usable = []
    for name in wanted:
        if name not in enabled and not _write(parent / "cgroup.subtree_control", f"+{name}"):
            continue  # not delegated, or our cgroup holds processes (the no-internal-process rule)
        usable.append(name)
    base = parent / f"{PREFIX}{os.getpid()}"
    if not usable or not _make_dir(base):
        return []
    usable = [n for n in usable if _write(base / "cgroup.subtree_control", f"+{n}")]
    return [Hierarchy(n, base, 2) for n in usable]


def _make_dir(path: Path) -> bool:
    try:
        path.mkdir(exist_ok=True)
        return True
    except OSError:
        return False


def detect(limits: LimitsPolicy) -> list[Hierarchy]:
    """Make this server's group in each hierarchy that can enforce a limit the policy sets."""
    wanted = [n for n, v in (("pids", limits.max_processes), ("memory", limits.memory_mb)) if v]
    if not wanted:
        return []
    mounts, own = _mounts(), _own_paths()
    found: list[Hierarchy] = []
    for mount, kind, _ in mounts:
        if kind == "cgroup2" and "" in own:
            found += _v2_hierarchies(mount, own[""], wanted)
    for mount, kind, options in mounts:
        for name in wanted:
            if kind != "cgroup" or name not in options or any(h.controller == name for h in found):
                continue
            base = Path(mount) / own.get(name, "/").lstrip("/") / f"{PREFIX}{os.getpid()}"
            if _make_dir(base):
                found.append(Hierarchy(name, base, 1))
    for h in found:
        remove_stale(h.base.parent)
    missing = sorted(set(wanted) - {h.controller for h in found})
    if "pids" in missing:
        log.warning(
            "no writable cgroup pids controller: maxProcesses falls back to RLIMIT_NPROC, "
            "which does not apply when the server runs as root"
        )
    if "memory" in missing:
        log.warning("no writable cgroup memory controller: memoryMb is enforced per process only (RLIMIT_AS)")
    return found


def remove_stale(parent: Path) -> None:
    """Remove groups left by servers that were SIGKILLed (their kernels died with them)."""
    for base in parent.glob(f"{PREFIX}*"):
        try:
            pid = int(base.name[len(PREFIX) :])
            os.kill(pid, 0)
        except ProcessLookupError:
            for child in _kernel_groups(base):
                kill_and_remove(child)
            with contextlib.suppress(OSError):
                base.rmdir()
        except (OSError, ValueError):
            continue


def _kernel_groups(base: Path) -> list[Path]:
    return [p for p in base.glob("k*") if p.is_dir()]


def kill_and_remove(group: Path, wait: float = 0.0) -> bool:
    """SIGKILL every process in ``group`` and remove it; True once it is gone."""
    deadline = time.monotonic() + wait
    while True:
        if _write(group / "cgroup.kill", "1"):  # v2: atomic, races no fork
            pass
        else:
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY: the killed processes have not been reaped yet
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


class KernelGroups:
    """One kernel's groups, one per controller in use."""

    def __init__(self, hierarchies: list[Hierarchy], name: str, limits: LimitsPolicy) -> None:
        self.dirs: dict[str, Path] = {}
        self.version = {h.controller: h.version for h in hierarchies}
        for h in hierarchies:
            group = h.base / name
            group.mkdir(exist_ok=True)
            self.dirs[h.controller] = group
        if "pids" in self.dirs:
            self._set("pids", "pids.max", str(limits.max_processes))
        if "memory" in self.dirs:
            size = str(limits.memory_mb * 1024 * 1024)
            if self.version["memory"] == 2:
                self._set("memory", "memory.max", size)
                _write(self.dirs["memory"] / "memory.swap.max", "0")  # absent without swap: fine
            else:
                self._set("memory", "memory.limit_in_bytes", size)

    def _set(self, controller: str, file: str, value: str) -> None:
        path = self.dirs[controller] / file
        if not _write(path, value):
            raise OSError(f"cannot write {value} to {path}")

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run by a shell that first joins our groups (before bwrap even starts)."""
        procs = sorted({str(d / "cgroup.procs") for d in self.dirs.values()})
        return ["/bin/sh", "-c", _JOIN, "ipyfence-cgroup", *procs, "--", *argv]

    def events(self) -> Events:
        pids = memory = 0
        if "pids" in self.dirs:
            pids = _read_counter(self.dirs["pids"] / "pids.events", "max")
        if "memory" in self.dirs:
            d = self.dirs["memory"]
            # v2 counts in memory.events; v1 (kernel >= 4.13) in memory.oom_control
            memory = _read_counter(d / "memory.events", "oom_kill") or _read_counter(
                d / "memory.oom_control", "oom_kill"
            )
        return Events(pids, memory)

    def remove(self) -> None:
        """Kill whatever is still in the groups (nothing escapes a reset) and remove them."""
        for group in set(self.dirs.values()):
            if not kill_and_remove(group, wait=2.0):
                log.warning("could not remove cgroup %s", group)


class Cgroups:
    """The server's groups: made at start, one child per kernel, removed at exit."""

    def __init__(self, limits: LimitsPolicy) -> None:
        self.limits = limits
        self.hierarchies = detect(limits)

    @property
    def controllers(self) -> list[str]:
        return sorted(h.controller for h in self.hierarchies)

    def for_kernel(self, name: str) -> KernelGroups | None:
        if not self.hierarchies:
            return None
        return KernelGroups(self.hierarchies, name, self.limits)

    def close(self) -> None:
        for base in {h.base for h in self.hierarchies}:
            for child in _kernel_groups(base):
                kill_and_remove(child, wait=2.0)
            with contextlib.suppress(OSError):
                base.rmdir()
