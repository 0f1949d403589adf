"""From a resolved ``Policy`` plus the machine's paths to a concrete ``MountPlan``.

This is the one impure step between policy and renderers: it looks at the filesystem
(which ``.env`` files exist, which protected paths exist, which directories are real).
Renderers take the resulting frozen plan and stay pure.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wcmatch import glob as wcglob

from ipyfence.errors import SandboxError
from ipyfence.policy import Policy, is_glob, literal_path

# Paths that are always read-only inside writable roots, because writing them runs code on
# the host later (git hooks, shell start-up, editor/agent config). Taken from
# sandbox-runtime's list (DANGEROUS_FILES / getDangerousDirectories), plus the agent
# configs ipyfence's own users run: .claude/settings*.json and .cursor.
PROTECTED_FILES = (
    ".gitconfig",
    ".gitmodules",
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".zshrc",
    ".zprofile",
    ".zshenv",
    ".profile",
    ".ripgreprc",
    ".mcp.json",
    ".envrc",
)
PROTECTED_DIRS = (
    ".vscode",
    ".idea",
    ".cursor",
    ".claude",
    ".git/hooks",
)
GIT_CONFIG = ".git/config"

# Protected names that are created as read-only placeholders at the workspace root when they
# do not exist yet, so the kernel cannot plant them: an agent or editor would run what they
# say (Claude Code hooks in .claude/settings.json, MCP servers in .mcp.json, VS Code tasks,
# git hooks in a fresh .git). Empty placeholders are removed again when the server exits.
ROOT_PLACEHOLDER_DIRS = (".claude", ".vscode", ".idea", ".cursor", ".git")
ROOT_PLACEHOLDER_FILES = (".mcp.json",)
HOME_PLACEHOLDER_FILES = (".bashrc", ".bash_profile", ".profile", ".zshrc", ".zprofile", ".zshenv", ".gitconfig")

# Host directories that hold other programs' unix sockets (docker, dbus, ssh-agent, other
# ipyfence servers). Path sockets stay connectable across a network namespace, so hide them.
HOST_SOCKET_DIRS = ("/run", "/var/run", "/tmp", "/var/tmp", "/dev/shm")


def _scan_limit() -> int:
    # Settable so that tests can flood the workspace cheaply; read once at import.
    raw = os.environ.get("IPYFENCE_SCAN_LIMIT", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 200_000


SCAN_LIMIT = _scan_limit()  # directory entries listed per scanned tree; beyond it subtrees are hidden
LISTING_FACTOR = 4  # one directory may list up to this many times SCAN_LIMIT before it counts as unfinished
UNSCANNED_CAP = 256  # unfinished subtrees we hide; more than this and the kernel does not start
GLOB_FLAGS = wcglob.GLOBSTAR | wcglob.DOTGLOB | wcglob.FORCEUNIX


# Always on: /proc paths through which root in the sandbox (a user namespace mapped to host root)
# could change the host — bwrap's fresh /proc leaves /proc/sys writable — and files that show host
# kernel memory, keys or timers. Only those that exist are used (their names vary by kernel).
PROC_READONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
PROC_MASKED = (
    "/proc/kcore",
    "/proc/keys",
    "/proc/key-users",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/kallsyms",
)


def placeholder_names() -> frozenset[str]:
    """Every name ipyfence may create as an empty read-only placeholder (clean-up removes only these)."""
    return frozenset({*ROOT_PLACEHOLDER_DIRS, *ROOT_PLACEHOLDER_FILES, *HOME_PLACEHOLDER_FILES})


@dataclass(frozen=True)
class SandboxPaths:
    """Where things live on the host, for one kernel."""

    workspace: Path  # the user's workspace (cwd of the kernel)
    kernel_dir: Path  # private per-kernel dir: connection file, ipc sockets, HOME, bridge socket
    runtime_root: Path  # per-server runtime dir holding every kernel_dir; hidden except our own kernel_dir
    state_root: Path  # ipyfence's persistent state for all workspaces; hidden from the kernel
    packages_dir: Path | None  # user-installed packages, visible read-only (None: not used)
    server_install: tuple[Path, ...]  # the server's own venv/package files: always read-only
    python: Path  # interpreter that runs the kernel


@dataclass(frozen=True)
class MountPlan:
    """Concrete, existing paths to bind, mask or protect. Order inside each tuple is stable."""

    writable: tuple[str, ...]  # bind read-write
    hidden_dirs: tuple[str, ...]  # replace with an empty read-only dir
    masked_files: tuple[str, ...]  # replace with an empty read-only file
    readonly: tuple[str, ...]  # bind read-only over a writable root
    reallowed: tuple[str, ...]  # bind back (read-only) inside a hidden dir
    warnings: tuple[str, ...]  # things the user should know (scan limits, unhonoured entries)
    absent_files: tuple[str, ...] = ()  # protected names that do not exist: read-only empty placeholders
    absent_dirs: tuple[str, ...] = ()  # same, for directories
    pinned: tuple[str, ...] = ()  # ancestors of protected paths bound onto themselves: a mount point cannot be renamed
    unscanned: tuple[str, ...] = ()  # subtrees the scan did not finish: hidden (empty read-only), fail closed
    sockets: tuple[str, ...] = ()  # host unix sockets not the kernel's (agents, docker): masked with /dev/null
    sealed: tuple[str, ...] = ()  # writable dirs made read-only at their root ($HOME): nothing new appears there
    rebound: tuple[str, ...] = ()  # entries of a sealed dir bound back writable (non-dot dirs and files of ~)
    sealed_entries: tuple[str, ...] = ()  # entries of a sealed dir left read-only (dot entries); for srt
    proc_readonly: tuple[str, ...] = ()  # /proc paths that change the host: read-only (always on)
    proc_masked: tuple[str, ...] = ()  # /proc files that leak host state: masked (always on)


def default_server_install() -> tuple[Path, ...]:
    """The server's installation: venv prefix, base interpreter prefix and the ipyfence package."""
    import ipyfence

    found = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), Path(ipyfence.__file__).resolve().parent}
    return tuple(sorted(found))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass(frozen=True)
class _Tree:
    """One directory tree as os.walk lists it (no symlinks followed), up to SCAN_LIMIT entries."""

    entries: tuple[tuple[str, list[str], list[str]], ...]
    unfinished: tuple[str, ...] = ()  # directories whose subtree was not (fully) listed
    sockets: tuple[str, ...] = ()  # unix sockets found on the way

    @property
    def complete(self) -> bool:
        return not self.unfinished


class _Trees:
    """Walk each root once per plan: the deny-read and protected-path scans share the listing."""

    def __init__(self) -> None:
        self._trees: dict[str, _Tree] = {}

    def __call__(self, root: str) -> _Tree:
        if root not in self._trees:
            self._trees[root] = _list_tree(root, SCAN_LIMIT)
        return self._trees[root]

    def all(self) -> list[_Tree]:
        return list(self._trees.values())


def _list_tree(root: str, limit: int) -> _Tree:
    """Depth-first listing like ``os.walk`` (symlinks to dirs listed, not followed).

    When ``limit`` entries have been listed, the directories not yet (fully) listed are
    returned as ``unfinished``: depth first keeps that list short (the pending siblings on
    one path), and the caller hides them rather than trusting a partial scan.
    """
    entries: list[tuple[str, list[str], list[str]]] = []
    sockets: list[str] = []
    seen = 0
    stack = [root]
    while stack:
        top = stack.pop()
        if seen >= limit:
            return _Tree(tuple(entries), (top, *reversed(stack)), tuple(sockets))
        dirnames: list[str] = []
        filenames: list[str] = []
        descend: list[str] = []
        try:
            with os.scandir(top) as it:
                for entry in it:
                    seen += 1
                    # A directory once begun is listed whole (its names are checked), up to a
                    # hard bound: a flood of names in one directory must not exhaust memory.
                    if seen > LISTING_FACTOR * limit:
                        partial: tuple[tuple[str, list[str], list[str]], ...] = (
                            (top, [], [""] * (len(dirnames) + len(filenames))),
                        )
                        return _Tree(tuple(entries) + partial, (top, *reversed(stack)), tuple(sockets))
                    try:
                        if entry.is_dir():
                            dirnames.append(entry.name)
                            if not entry.is_symlink():
                                descend.append(entry.path)
                            continue
                        filenames.append(entry.name)
                        # Sockets are neither files nor dirs; stat only those rare entries.
                        rare = not entry.is_file() and not entry.is_symlink()
                        if rare and stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                            sockets.append(entry.path)
                    except OSError:
                        filenames.append(entry.name)
        except OSError:
            continue  # unreadable (or vanished): nothing the kernel can read there either
        entries.append((top, dirnames, filenames))
        stack.extend(reversed(descend))
    return _Tree(tuple(entries), (), tuple(sockets))


def _glob_base(pattern: str) -> str:
    """The longest leading directory of ``pattern`` without glob characters."""
    parts = pattern.split("/")
    base: list[str] = []
    for part in parts[:-1]:
        if is_glob(part):
            break
        base.append(part)
    return literal_path("/".join(base)) or "/"


def _matches(path: str, patterns: Iterable[str]) -> bool:
    literal, tail, matcher = _compiled(tuple(patterns))
    if path in literal:
        return True
    if matcher is None or (tail is not None and not tail.match(path.rsplit("/", 1)[-1])):
        return False  # the cheap test on the last component rules out almost every file
    return bool(matcher.match(path))


@functools.lru_cache(maxsize=64)
def _compiled(patterns: tuple[str, ...]) -> tuple[frozenset[str], re.Pattern[str] | None, Any]:
    """Literal entries, a last-component pre-filter, and one compiled matcher for the globs.

    The workspace scan calls ``_matches`` for every file, so nothing here may be per call.
    """
    globs = [p for p in patterns if is_glob(p)]
    tails = [p.rsplit("/", 1)[-1] for p in globs]
    # Only for tails whose syntax fnmatch reads exactly as wcmatch does (no classes, no escapes):
    # a pre-filter that disagreed would leave a secret unmasked.
    simple = tails and all("**" not in t and "[" not in t and "\\" not in t for t in tails)
    tail = re.compile("|".join(fnmatch.translate(t) for t in tails)) if simple else None
    matcher = wcglob.compile(globs, flags=GLOB_FLAGS) if globs else None
    return frozenset(literal_path(p) for p in patterns if not is_glob(p)), tail, matcher


def _find_globbed(patterns: tuple[str, ...], trees: _Trees, warnings: list[str]) -> tuple[list[str], list[str]]:
    """Expand glob entries by walking their base directories. Returns (files, dirs)."""
    files: list[str] = []
    dirs: list[str] = []
    by_base: dict[str, list[str]] = {}
    for p in patterns:
        if is_glob(p):
            by_base.setdefault(_glob_base(p), []).append(p)
    for base, pats in by_base.items():
        if base == "/" or not os.path.isdir(base):
            if base == "/":
                warnings.append(f"glob(s) {pats} start at / and are not expanded; anchor them in a directory")
            continue
        tree = trees(base)
        for dirpath, dirnames, filenames in tree.entries:
            for name in filenames:
                full = os.path.join(dirpath, name)
                if _matches(full, pats):
                    files.append(full)
            for name in dirnames:
                full = os.path.join(dirpath, name)
                if _matches(full, pats):
                    dirs.append(full)
    return files, dirs


# Protected directories are read-only as a whole: nothing inside them needs its own mount.
_NO_DESCENT = frozenset({".git", ".vscode", ".idea", ".cursor", ".claude"})


def _protected_in(root: str, allow_git_config: bool, trees: _Trees) -> list[str]:
    """Existing always-protected paths under a writable root (at any depth, bounded).

    By default the whole ``.git`` directory is read-only, not just hooks and config: git
    itself rewrites config through a lock file and rename(), and a rename on the host
    silently detaches a bind mount on the replaced file. ``allowGitConfig`` makes ``.git``
    writable except its hooks.
    """
    names = set(PROTECTED_FILES)
    git_rules = (".git/hooks",) if allow_git_config else (".git",)
    dir_rules = tuple(d for d in PROTECTED_DIRS if not d.startswith(".git")) + git_rules
    found: list[str] = []
    tree = trees(root)
    for dirpath, dirnames, filenames in tree.entries:
        if _NO_DESCENT.intersection(os.path.relpath(dirpath, root).split(os.sep)):
            continue
        for name in filenames:
            if name in names:
                found.append(os.path.join(dirpath, name))
        present = set(dirnames).union(filenames)  # listed already: stat only what is there
        for rel in dir_rules:
            if rel.split("/", 1)[0] not in present:
                continue
            candidate = os.path.join(dirpath, rel)
            if os.path.lexists(candidate) and not os.path.islink(candidate):
                found.append(candidate)
    return found


# --- git configuration that names in-tree files ---------------------------------------------

# The user's git runs core.hooksPath and reads include.path / includeIf.*.path: when those name
# a path the kernel can write, the kernel plants hooks or config. Read with the system git at
# a fixed path and a cleared environment: ``git config`` only parses, it executes nothing.
GIT_SEARCH_PATH = "/usr/local/bin:/usr/bin:/bin"
GIT_KEYS = r"^(core\.hookspath|include\.path|includeif\..*\.path)$"
GIT_TIMEOUT = 10
GIT_MAX_FILES = 64  # config files followed per plan (includes of includes)


@dataclass(frozen=True)
class _GitRefs:
    hooks: tuple[str, ...]  # absolute core.hooksPath dirs (relative ones resolved per work tree)
    includes: tuple[str, ...]  # absolute included config files
    warnings: tuple[str, ...]


_GitEntries = list[tuple[str, str, str]]
_git_cache: dict[tuple[str, ...], tuple[tuple[object, ...], _GitEntries | None]] = {}


def _scope_files(scope: list[str]) -> list[str]:
    """The files a scope reads (their stat is the cache key): re-planning a standby at every
    reset must not cost a git process per scope when nothing changed."""
    if scope[0] == "--file":
        return [scope[1]]
    if scope[0] == "--global":
        xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
        return [os.path.expanduser("~/.gitconfig"), os.path.join(xdg, "git", "config")]
    return ["/etc/gitconfig", "/usr/local/etc/gitconfig"]


def _signature(files: list[str]) -> tuple[object, ...]:
    out: list[object] = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def _git_read(git: str, scope: list[str]) -> _GitEntries | None:
    key = (git, *scope, os.path.expanduser("~"))
    signature = _signature(_scope_files(scope))
    cached = _git_cache.get(key)
    if cached is not None and cached[0] == signature:
        return cached[1]
    entries = _git_run(git, scope)
    _git_cache[key] = (signature, entries)
    return entries


def _git_run(git: str, scope: list[str]) -> _GitEntries | None:
    """(origin file, key, value) for the keys above; None when git could not read the config."""
    home = os.path.expanduser("~")
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "LC_ALL": "C"}
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    if os.path.isabs(xdg):  # the user's git reads $XDG_CONFIG_HOME/git/config: so do we
        env["XDG_CONFIG_HOME"] = xdg
    cmd = [git, "config", *scope, "--includes", "--null", "--show-origin", "--get-regexp", GIT_KEYS]
    try:
        done = subprocess.run(cmd, env=env, cwd="/", capture_output=True, timeout=GIT_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode == 1:  # no such key (or no such file)
        return []
    if done.returncode != 0:
        return None
    fields = done.stdout.decode("utf-8", "surrogateescape").split("\0")
    out: _GitEntries = []
    for origin, entry in zip(fields[0::2], fields[1::2], strict=False):
        key, _, value = entry.partition("\n")
        out.append((origin.removeprefix("file:"), key, value))
    return out


def _expand(value: str, base: str) -> str:
    value = os.path.expanduser(value) if value.startswith("~") else value
    return os.path.normpath(os.path.join(base, value))


def git_config_refs(repos: Iterable[str]) -> _GitRefs:
    """Hook dirs and include files named by the system, global and each repo's config.

    ``repos`` are work tree roots (the directory holding ``.git``). A relative hooksPath is
    relative to the work tree, also when it comes from the global config.
    """
    git = shutil.which("git", path=GIT_SEARCH_PATH)
    repos = list(repos)
    if git is None:
        return _GitRefs((), (), ("git not found: hook paths named by git config were not checked",))
    warnings: list[str] = []
    hooks: list[str] = []
    includes: list[str] = []
    global_hooks: list[str] = []
    queue: list[tuple[list[str], str | None]] = [(["--system"], None), (["--global"], None)]
    queue += [(["--file", os.path.join(r, ".git", "config")], r) for r in repos]
    seen: set[str] = set()
    while queue and len(seen) < GIT_MAX_FILES:
        scope, tree = queue.pop(0)
        entries = _git_read(git, scope)
        if entries is None:
            # git itself would refuse this config too, so it runs no hooks from it; say so.
            warnings.append(f"git could not read its config ({' '.join(scope)}); hook paths in it were not checked")
            continue
        for origin, key, value in entries:
            if key == "core.hookspath":
                if os.path.isabs(os.path.expanduser(value)):
                    hooks.append(_expand(value, "/"))
                elif tree is not None:
                    hooks.append(_expand(value, tree))
                else:
                    global_hooks.append(value)  # from system/global: relative to every repo
            else:
                path = _expand(value, os.path.dirname(origin) or "/")
                includes.append(path)
                if path not in seen and os.path.isfile(path):
                    seen.add(path)
                    queue.append((["--file", path], tree))  # includeIf conditions: follow them all
    hooks += [_expand(h, r) for h in global_hooks for r in repos]
    return _GitRefs(tuple(dict.fromkeys(hooks)), tuple(dict.fromkeys(includes)), tuple(warnings))


def _git_protection(
    repos: list[str], writable: list[str], covered: list[str]
) -> tuple[list[str], list[str], list[str], list[str]]:
    """(read-only paths, absent files, absent dirs, warnings) for git-named paths in writable roots.

    A missing path becomes a read-only placeholder at its topmost missing ancestor, so the
    kernel can create neither it nor a directory on the way to it.
    """
    refs = git_config_refs(repos)
    readonly: list[str] = []
    absent_files: list[str] = []
    absent_dirs: list[str] = []
    for path, is_dir in [*((h, True) for h in refs.hooks), *((i, False) for i in refs.includes)]:
        if not any(_under(path, w) and path != w for w in writable) or any(_under(path, c) for c in covered):
            continue  # not writable, or inside a path that is read-only or hidden already
        if os.path.lexists(path):
            readonly.append(path)
            continue
        top = path
        while not os.path.lexists(os.path.dirname(top)):
            top = os.path.dirname(top)
        (absent_dirs if is_dir or top != path else absent_files).append(top)
    return readonly, absent_files, absent_dirs, list(refs.warnings)


def plan_mounts(policy: Policy, paths: SandboxPaths) -> MountPlan:
    """Look at the filesystem and decide exactly what to bind, mask and protect."""
    fs = policy.filesystem
    warnings: list[str] = []

    writable = [literal_path(p) for p in fs.allow_write if not is_glob(p) and os.path.isdir(literal_path(p))]
    for p in fs.allow_write:
        if is_glob(p):
            warnings.append(f"allowWrite glob {p!r} is not supported by bwrap and was ignored")
        elif not os.path.exists(literal_path(p)):
            warnings.append(f"allowWrite {p!r} does not exist and was ignored")

    trees = _Trees()
    globbed_files, globbed_dirs = _find_globbed(fs.deny_read, trees, warnings)
    literal = [literal_path(p) for p in fs.deny_read if not is_glob(p) and os.path.lexists(literal_path(p))]
    deny_files = globbed_files + [p for p in literal if not os.path.isdir(p)]
    deny_dirs = globbed_dirs + [p for p in literal if os.path.isdir(p)]
    # A symlink holds no secret itself (what it points at is checked where it lives), and bwrap
    # cannot mount onto one: masking it would let a kernel-made `.env` link stop every later kernel.
    masked_files = [p for p in deny_files if not _matches(p, fs.allow_read) and not os.path.islink(p)]
    hidden = [p for p in deny_dirs if not _matches(p, fs.allow_read)]
    reallowed = [
        literal_path(p)
        for p in fs.allow_read
        if not is_glob(p) and os.path.exists(literal_path(p)) and any(_under(literal_path(p), d) for d in hidden)
    ]

    # Other programs' sockets, other kernels' state, and ipyfence's own persistent state.
    for d in (*HOST_SOCKET_DIRS, str(paths.runtime_root), str(paths.state_root)):
        if os.path.isdir(d) and not os.path.islink(d) and d != "/tmp":
            hidden.append(d)

    readonly: list[str] = []
    for root in writable:
        readonly += _protected_in(root, fs.allow_git_config, trees)
    readonly += [literal_path(p) for p in fs.deny_write if not is_glob(p) and os.path.exists(literal_path(p))]
    readonly += [str(p) for p in paths.server_install if any(_under(str(p), w) for w in writable)]
    unscanned = _unscanned(trees, paths, writable, hidden)
    sealed, home_rebound, home_dots = _home_profile(writable)
    repos = [os.path.dirname(p) for p in readonly if os.path.basename(p) == ".git"]
    repos += [p.removesuffix("/.git/hooks") for p in readonly if p.endswith("/.git/hooks")]
    git_ro, git_files, git_dirs, git_warnings = _git_protection(
        list(dict.fromkeys(repos)), writable, [*readonly, *hidden, *unscanned, *home_dots]
    )
    readonly += git_ro
    warnings += git_warnings
    # The kernel runs from the server's install: if that lives under a directory the sandbox
    # replaces (a checkout in /tmp, say), bind it back read-only.
    replaced = ["/tmp", *hidden, *unscanned]
    reallowed += [
        str(p)
        for p in paths.server_install
        if any(_under(str(p), d) for d in replaced) and not any(_under(str(p), w) for w in writable)
    ]
    if paths.packages_dir is not None and paths.packages_dir.is_dir():
        reallowed.append(str(paths.packages_dir))
    absent_files, absent_dirs = _absent_placeholders(paths.workspace, writable, fs.allow_git_config)
    absent_files += tuple(p for p in git_files if p not in absent_files)
    absent_dirs += tuple(p for p in git_dirs if p not in absent_dirs)
    pinned = _pinned([*readonly, *absent_files, *absent_dirs], [*writable, *home_rebound], sealed)
    rebound = [*writable, *reallowed]
    sockets = _sockets(trees, policy, [*replaced, *masked_files], rebound)
    sockets = tuple(p for p in sockets if not _under(p, str(paths.kernel_dir)))  # the kernel's own (bridge)

    return MountPlan(
        writable=tuple(dict.fromkeys(writable)),
        hidden_dirs=tuple(dict.fromkeys(hidden)),
        masked_files=tuple(dict.fromkeys(masked_files)),
        readonly=tuple(dict.fromkeys(readonly)),
        reallowed=tuple(dict.fromkeys(reallowed)),
        warnings=tuple(warnings),
        absent_files=absent_files,
        absent_dirs=absent_dirs,
        pinned=pinned,
        sealed=sealed,
        rebound=home_rebound,
        sealed_entries=home_dots,
        unscanned=unscanned,
        sockets=sockets,
        proc_readonly=tuple(p for p in PROC_READONLY if os.path.exists(p)),
        proc_masked=tuple(p for p in PROC_MASKED if os.path.exists(p)),
    )


# $HOME inside a writable root (``--workspace ~``): far more than the rc files runs from it
# (~/.config/{git,fish,autostart,systemd}, ~/.local/bin on PATH, ~/.ssh/config, site-packages in
# ~/.local/lib, editor and agent configs). No list is complete, so the home is sealed instead:
# read-only at its root, every dot entry read-only, only non-dot entries bound back writable.
HOME_KEPT_READONLY = frozenset({"bin"})  # ~/bin is on PATH via ~/.profile


def _home_profile(writable: list[str]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(sealed, rebound writable, dot entries) when $HOME lies inside a writable root."""
    home = os.path.realpath(os.path.expanduser("~"))
    if home == "/" or not any(_under(home, w) for w in writable):
        return (), (), ()
    rebound: list[str] = []
    dots: list[str] = []
    try:
        with os.scandir(home) as it:
            for entry in sorted(it, key=lambda e: e.name):
                if entry.name.startswith("."):
                    dots.append(entry.path)
                elif entry.name in HOME_KEPT_READONLY or entry.is_symlink():
                    continue
                elif entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False):
                    rebound.append(entry.path)
    except OSError:
        pass  # unreadable home: sealed as a whole, nothing bound back
    return (home,), tuple(rebound), tuple(dots)


def _pinned(protected: Iterable[str], writable: list[str], sealed: Iterable[str] = ()) -> tuple[str, ...]:
    """Every directory strictly between a writable root and a protected path inside it.

    Bound onto itself, each becomes a mount point, and rename() of a mount point fails
    (EBUSY): otherwise ``mv sub sub2`` carries the read-only ``sub/.git`` away and the kernel
    makes a fresh ``sub/.git`` with hooks.
    """
    out: set[str] = set()
    for path in protected:
        roots = [w for w in writable if _under(path, w) and path != w]
        if not roots:
            continue
        root = max(roots, key=len)
        if any(_under(path, d) and len(d) > len(root) for d in sealed):
            continue  # inside a read-only sealed dir (a dot dir of ~): nothing to pin, nothing writable
        parent = os.path.dirname(path)
        while parent != root and _under(parent, root):
            out.add(parent)
            parent = os.path.dirname(parent)
    return tuple(sorted(out, key=lambda p: (p.count("/"), p)))


def _unscanned(trees: _Trees, paths: SandboxPaths, writable: list[str], hidden: list[str]) -> tuple[str, ...]:
    """Subtrees a scan did not finish: hidden, or a refusal when that cannot be done safely."""
    out: list[str] = []
    for tree in trees.all():
        out += [d for d in tree.unfinished if not any(_under(d, h) for h in hidden)]
    if not out:
        return ()
    needed = [str(paths.workspace), *writable, str(paths.kernel_dir)]
    fatal = [d for d in out if any(_under(n, d) for n in needed)]
    if fatal or len(out) > UNSCANNED_CAP:
        biggest = _biggest(trees)
        raise SandboxError(
            f"the workspace scan for secrets and protected files stopped at {SCAN_LIMIT} entries and "
            + (
                f"cannot hide {fatal[0]} (the kernel needs it)"
                if fatal
                else f"left {len(out)} directories unscanned (at most {UNSCANNED_CAP} can be hidden)"
            )
            + f"; the kernel was not started. Largest directories: {', '.join(biggest)}. "
            "Remove files there, or raise the limit with IPYFENCE_SCAN_LIMIT."
        )
    return tuple(dict.fromkeys(out))


def _biggest(trees: _Trees, n: int = 3) -> list[str]:
    sizes = [(len(d) + len(f), p) for t in trees.all() for p, d, f in t.entries]
    return [f"{p} ({size} entries)" for size, p in sorted(sizes, reverse=True)[:n]]


# Well-known agent sockets under $HOME: each lets its holder sign, decrypt or run containers.
HOME_SOCKETS = (".gnupg/S.*", ".docker/run/docker.sock", ".1password/agent.sock", ".ssh/agent*", ".ssh/agent*/*")


def _agent_socket_candidates(environ: dict[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    out: list[str] = []
    if env.get("SSH_AUTH_SOCK"):
        out.append(env["SSH_AUTH_SOCK"])
    docker = env.get("DOCKER_HOST", "")
    if docker.startswith("unix://"):
        out.append(docker[len("unix://") :])
    if env.get("GPG_AGENT_INFO"):
        out.append(env["GPG_AGENT_INFO"].split(":", 1)[0])
    home = os.path.expanduser("~")
    for pattern in HOME_SOCKETS:
        out += wcglob.glob(wcglob.escape(home) + "/" + pattern, flags=GLOB_FLAGS)
    return out


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)  # follows links: the bind would too
    except OSError:
        return False


def _visible(path: str, replaced: list[str], rebound: list[str]) -> bool:
    """Is ``path`` still the host's file in the sandbox (the deepest mount over it decides)?"""
    hide = max((len(d) for d in replaced if _under(path, d)), default=-1)
    show = max((len(d) for d in rebound if _under(path, d)), default=-1)
    return show >= hide


def _sockets(trees: _Trees, policy: Policy, replaced: list[str], rebound: list[str]) -> tuple[str, ...]:
    """Host sockets the kernel could connect to: the scan's finds plus the well-known agents.

    Read-only mounts do not stop connect(), so each is masked with /dev/null. Sockets under a
    hidden or replaced dir (/tmp, /run, the kernel's own dir) are gone already unless a
    writable root binds them back; allowUnixSockets entries stay.
    """
    allowed = {os.path.realpath(literal_path(p)) for p in policy.network.allow_unix_sockets}
    found: list[str] = [s for t in trees.all() for s in t.sockets]
    found += [os.path.realpath(p) for p in _agent_socket_candidates() if os.path.isabs(p)]
    out = [
        p
        for p in dict.fromkeys(found)
        if _is_socket(p) and p not in allowed and os.path.realpath(p) not in allowed and _visible(p, replaced, rebound)
    ]
    return tuple(out)


def _absent_placeholders(
    workspace: Path, writable: list[str], allow_git_config: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Protected names missing at the workspace root (only when the workspace is writable)."""
    ws = str(workspace)
    if not any(_under(ws, w) for w in writable):
        return (), ()
    file_names: tuple[str, ...] = ROOT_PLACEHOLDER_FILES
    if os.path.realpath(os.path.expanduser("~")) == os.path.realpath(ws):
        file_names += HOME_PLACEHOLDER_FILES
    dir_names = tuple(d for d in ROOT_PLACEHOLDER_DIRS if not (d == ".git" and allow_git_config))
    files = tuple(os.path.join(ws, n) for n in file_names if not os.path.lexists(os.path.join(ws, n)))
    dirs = tuple(os.path.join(ws, n) for n in dir_names if not os.path.lexists(os.path.join(ws, n)))
    return files, dirs
