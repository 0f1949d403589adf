"""The kernel's own runtime: which distributions it needs, pinned so installs cannot replace them.

The package directory comes before the server's site-packages on the kernel's ``sys.path``
(that is how installed packages can be imported at all), so a file there named like a module
of the kernel's runtime shadows it, and a kernel that cannot import ``traitlets`` cannot
start. Three guards use this module:

- pip gets a constraints file pinning every runtime distribution to the version the server
  runs (``name==version``): pip keeps them, and a request that needs another version fails
  to resolve, which :func:`explain_conflict` turns into one sentence;
- :func:`shadowing` finds files that would shadow a runtime module whatever distribution
  ships them (a package can carry a top-level ``traitlets/`` under any name);
- the sandboxed start check (``runtime_check``) imports the runtime with the new files in
  front.

The runtime is ipykernel and pydantic with their whole dependency closure, ipyfence itself
(its kernel-side modules) and pip (install_package runs it with the package dir on its path).
ipyfence's other dependencies (mcp, click, …) run only in the server, never in the kernel:
the package dir may hold other versions of them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOTS = ("ipykernel", "pydantic")  # what the kernel imports to start and to serve mcptools
SELF = ("ipyfence", "pip")  # pinned, without their dependencies (see the module docstring)
# Import names the kernel relies on that no runtime distribution lists as a file: ipyfence
# may be installed editable, and mcptools/ is the workspace's generated package.
RESERVED_MODULES = {"ipyfence": "ipyfence", "mcptools": "the workspace's generated mcptools/"}
# Top-level entries of a --target install that are not importable modules.
NOT_MODULES = ("bin", "__pycache__")
_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd")


@dataclass(frozen=True)
class RuntimeDist:
    name: str  # canonical
    version: str
    needed_by: tuple[str, ...]  # the chain from a root, e.g. ("ipykernel", "ipython"); () for a root

    def why(self) -> str:
        """``traitlets 5.16.1, needed by ipykernel`` (for a root: ``ipykernel 7.4.0``)."""
        text = f"{self.name} {self.version}"
        if self.needed_by:
            text += f", needed by {self.needed_by[0]}"
            if len(self.needed_by) > 1:
                text += f" (via {', '.join(self.needed_by[1:])})"
        return text


def _active_requires(dist: importlib.metadata.Distribution) -> list[str]:
    names = []
    for line in dist.requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # extras and other platforms' dependencies are not installed
        names.append(req.name)
    return names


@functools.lru_cache(maxsize=1)
def runtime_dists() -> Mapping[str, RuntimeDist]:
    """Every runtime distribution of the server's environment, by canonical name."""
    found: dict[str, RuntimeDist] = {}
    queue: deque[tuple[str, tuple[str, ...], bool]] = deque((r, (), True) for r in ROOTS)
    queue.extend((s, (), False) for s in SELF)
    while queue:  # breadth first: each distribution's chain is a shortest one
        raw, chain, follow = queue.popleft()
        name = canonicalize_name(raw)
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency this environment does not have
        found[name] = RuntimeDist(name, dist.version, chain)
        if follow:
            queue.extend((dep, (*chain, name), True) for dep in _active_requires(dist))
    return found


def constraints_text(dists: Iterable[RuntimeDist]) -> str:
    """A pip constraints file: each runtime distribution at exactly the server's version."""
    return "".join(f"{d.name}=={d.version}\n" for d in sorted(dists, key=lambda d: d.name))


def write_constraints(path: Path) -> Path:
    path.write_text(constraints_text(runtime_dists().values()))
    return path


# --- pip's ResolutionImpossible output → one sentence -------------------------------------------

_CONSTRAINT = re.compile(r"^\s*The user requested \(constraint\) (?P<name>[A-Za-z0-9._-]+)\s*==\s*(?P<ver>\S+)\s*$")
_WANTS = re.compile(
    r"^\s*(?:The user requested (?P<req>\S.*?)|(?P<who>[A-Za-z0-9._-]+ \S+) depends on (?P<dep>\S.*?))\s*$"
)


def _requirement_name(text: str) -> str | None:
    try:
        return canonicalize_name(Requirement(text).name)
    except InvalidRequirement:
        return None


def explain_conflict(spec: str, pip_output: str, runtime: Mapping[str, RuntimeDist] | None = None) -> str | None:
    """One sentence for a resolution that failed on a runtime pin, or None if that is not the cause.

    Reads pip's "The conflict is caused by:" block (printed at normal verbosity), in which
    the constraint shows up as ``The user requested (constraint) traitlets==5.16.1`` next to
    the requirement that wants another version.
    """
    if "ResolutionImpossible" not in pip_output and "conflicting dependencies" not in pip_output:
        return None
    runtime = runtime_dists() if runtime is None else runtime
    lines = pip_output.splitlines()
    pinned = {}
    for line in lines:
        m = _CONSTRAINT.match(line)
        if m and canonicalize_name(m["name"]) in runtime:
            pinned[canonicalize_name(m["name"])] = m["ver"]
    if not pinned:
        return None
    wants: list[str] = []
    for line in lines:
        m = _WANTS.match(line)
        if m is None or _CONSTRAINT.match(line):
            continue
        text = m["req"] or m["dep"]
        name = _requirement_name(text)
        if name in pinned and text not in wants:
            wants.append(f"you asked for {text}" if m["req"] else f"{m['who']} depends on {text}")
    needs = "; ".join(runtime[n].why() for n in pinned)
    what = ", and ".join(wants) if wants else "it needs other versions of them"
    names = ", ".join(pinned)
    return (
        f"{spec!r} conflicts with ipyfence's kernel runtime: {what}, but the kernel itself runs on {needs}, "
        f"which installed packages may not replace (the kernel would no longer start). Nothing was installed. "
        f"Install a version that works with the kernel's {names}, or use a separate Python environment "
        "outside ipyfence for code that needs another version."
    )


# --- files that would shadow a runtime module ---------------------------------------------------


@dataclass(frozen=True)
class RuntimeModules:
    owners: Mapping[str, str]  # top-level import name -> "traitlets 5.16.1" (what it belongs to)
    files: frozenset[str]  # every runtime file, relative to its site dir ("traitlets/__init__.py")


def _module_name(entry: str) -> str | None:
    """The import name a top-level file provides (``x.py``, ``x.cpython-311-x86_64-linux-gnu.so``)."""
    if entry.endswith(_MODULE_SUFFIXES):
        return entry.split(".", 1)[0]
    return None


@functools.lru_cache(maxsize=1)
def runtime_modules() -> RuntimeModules:
    # The package dir comes before the standard library on sys.path too: a backport such as
    # enum34 (a top-level enum/) would replace the stdlib's for the kernel.
    owners: dict[str, str] = {name: f"the standard library's {name}" for name in sys.stdlib_module_names}
    owners.update(RESERVED_MODULES)
    files: set[str] = set()
    for rd in runtime_dists().values():
        dist = importlib.metadata.distribution(rd.name)
        label = f"{rd.name} {rd.version}"
        for top in (dist.read_text("top_level.txt") or "").split():
            owners.setdefault(top, label)
        for f in dist.files or []:
            parts = f.parts
            if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".egg-info", ".data")):
                continue
            if parts[0] in NOT_MODULES:
                continue
            files.add("/".join(parts))
            name = parts[0] if len(parts) > 1 else _module_name(parts[0])
            if name and name.isidentifier():
                owners.setdefault(name, label)
    return RuntimeModules(owners, frozenset(files))


def top_level_names(directory: Path) -> set[str]:
    """Import names the top-level entries of a --target tree provide."""
    names: set[str] = set()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return names
    for entry in entries:
        if entry.name in NOT_MODULES or entry.name.endswith((".dist-info", ".egg-info", ".data")):
            continue
        name = entry.name if entry.is_dir() else _module_name(entry.name)
        if name:
            names.add(name)
    return names


@dataclass(frozen=True)
class Shadow:
    entry: str  # top-level entry in the directory: "traitlets" (a dir) or "six.py"
    module: str  # the runtime module it shadows
    owner: str  # what the runtime module belongs to: "traitlets 5.16.1"


def _is_regular_package(path: Path) -> bool:
    return any((path / f"__init__{suffix}").is_file() for suffix in _MODULE_SUFFIXES)


def _files_under(root: Path, top: str) -> Iterable[str]:
    for dirpath, dirnames, filenames in os.walk(root / top, followlinks=False):
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            yield f"{rel}/{name}"


def shadowing(directory: Path, modules: RuntimeModules | None = None) -> list[Shadow]:
    """Top-level entries of ``directory`` (staging or the package dir) that shadow the runtime.

    A module or regular package of the same name always wins over the server's copy (it
    comes first on ``sys.path``). A namespace directory of the same name shadows only the
    files it shares with the runtime (a regular package later on the path wins over it).
    """
    modules = runtime_modules() if modules is None else modules
    found: list[Shadow] = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return []
    for entry in entries:
        if entry.name in NOT_MODULES or entry.name.endswith((".dist-info", ".egg-info", ".data")):
            continue
        top: str | None
        if entry.is_symlink():  # import follows it: judge it by its name
            top = entry.name if entry.name in modules.owners else _module_name(entry.name)
            if top is None or top not in modules.owners:
                continue
        elif entry.is_dir(follow_symlinks=False):
            top = entry.name
            if top not in modules.owners:
                continue
            regular = _is_regular_package(Path(entry.path))
            if not regular and not any(f in modules.files for f in _files_under(directory, entry.name)):
                continue
        else:
            top = _module_name(entry.name)
            if top is None or top not in modules.owners:
                continue
        found.append(Shadow(entry.name, top, modules.owners[top]))
    return found
