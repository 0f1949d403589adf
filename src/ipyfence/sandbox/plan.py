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
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wcmatch import glob as wcglob

from ipyfence.errors import SandboxError
from ipyfence.policy import Policy, is_glob

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


def placeholder_names() -> frozenset[str]:
    """Every name ipyfence may create as an empty read-only placeholder (clean-up removes only these)."""
    return frozenset({*ROOT_PLACEHOLDER_DIRS, *ROOT_PLACEHOLDER_FILES, *HOME_PLACEHOLDER_FILES})


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

# With $HOME inside a writable root, these non-dot entries of $HOME stay read-only too (on PATH).
HOME_READONLY_NAMES = frozenset({"bin"})

# Host directories that hold other programs' unix sockets (docker, dbus, ssh-agent, other
# ipyfence servers). Path sockets stay connectable across a network namespace, so hide them.
HOST_SOCKET_DIRS = ("/run", "/var/run", "/tmp", "/var/tmp", "/dev/shm")

# Directory entries looked at per writable root. A scan that cannot finish fails closed: the kernel
# does not start (it could otherwise start with deeper .env files unmasked after a kernel flooded the
# workspace). IPYFENCE_SCAN_LIMIT raises (or, in tests, lowers) it.
SCAN_LIMIT = int(os.environ.get("IPYFENCE_SCAN_LIMIT", "") or 200_000)
GLOB_FLAGS = wcglob.GLOBSTAR | wcglob.DOTGLOB | wcglob.FORCEUNIX


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
    pinned: tuple[str, ...] = ()  # ancestors of protected paths, bound onto themselves: a mount cannot be renamed
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
    complete: bool  # False: the limit was hit and deeper entries are missing


class _Trees:
    """Walk each root once per plan: the deny-read and protected-path scans share the listing."""

    def __init__(self) -> None:
        self._trees: dict[str, _Tree] = {}

    def __call__(self, root: str) -> _Tree:
        if root not in self._trees:
            self._trees[root] = _list_tree(root, SCAN_LIMIT)
        return self._trees[root]


def _list_tree(root: str, limit: int) -> _Tree:
    entries: list[tuple[str, list[str], list[str]]] = []
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        entries.append((dirpath, dirnames, filenames))
        seen += len(dirnames) + len(filenames)
        if seen > limit:
            return _Tree(tuple(entries), complete=False)
    return _Tree(tuple(entries), complete=True)


def raise_incomplete(root: str, tree: _Tree) -> None:
    """Fail closed: a scan that stopped early cannot say which secret files to mask."""
    biggest = sorted(tree.entries, key=lambda e: len(e[1]) + len(e[2]), reverse=True)[:3]
    where = ", ".join(f"{os.path.relpath(d, root)} ({len(ds) + len(fs)} entries)" for d, ds, fs in biggest)
    raise SandboxError(
        f"the workspace scan of {root} stopped after {SCAN_LIMIT} entries, so ipyfence cannot find every "
        f".env file to mask and will not start a kernel without them. Largest directories seen: {where}. "
        "Remove files there, or raise the limit with the environment variable IPYFENCE_SCAN_LIMIT."
    )


def _glob_base(pattern: str) -> str:
    """The longest leading directory of ``pattern`` without glob characters."""
    parts = pattern.split("/")
    base: list[str] = []
    for part in parts[:-1]:
        if is_glob(part):
            break
        base.append(part)
    return "/".join(base) or "/"


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
    return frozenset(p for p in patterns if not is_glob(p)), tail, matcher


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
        if not tree.complete:
            raise_incomplete(base, tree)
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


# When a repository's git config cannot be read, these conventional hook directories are protected anyway.
FALLBACK_HOOK_DIRS = (".githooks", ".husky")
GIT_TIMEOUT = 10.0  # seconds for one `git config` read


def _git_config_paths(git: str, args: list[str]) -> list[str] | None:
    """Values of a `git config --null` query; [] when unset, None when git failed (fail closed)."""
    import subprocess

    env = {"PATH": "/usr/bin:/bin", "HOME": os.path.expanduser("~"), "LANG": "C"}
    try:
        proc = subprocess.run(
            [git, "config", "--null", *args], capture_output=True, timeout=GIT_TIMEOUT, env=env, cwd="/", check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode == 1:  # the key is not set
        return []
    if proc.returncode != 0:
        return None
    out = proc.stdout.decode("utf-8", errors="replace").split("\0")
    if "--get-regexp" in args:  # "key\nvalue" records
        return [item.split("\n", 1)[1] for item in out if "\n" in item]
    return [item for item in out if item]


def git_hook_paths(repos: list[str], writable: list[str], warnings: list[str]) -> list[str]:
    """Paths inside writable roots that the repos' git config makes git run or read as config:
    ``core.hooksPath`` (relative to the work tree) and ``include``/``includeIf`` files. `git config`
    only reads; it runs nothing. A config that cannot be read protects the usual hook dirs instead."""
    import shutil

    from ipyfence.mcptools.hostlaunch import safe_path

    found: list[str] = []
    git = shutil.which("git", path=safe_path(os.environ.get("PATH", "/usr/bin:/bin"), writable))
    global_hooks = (_git_config_paths(git, ["--global", "--get-all", "core.hooksPath"]) or []) if git and repos else []
    for repo in repos:
        config = os.path.join(repo, ".git", "config")
        if not os.path.isfile(config):
            continue
        hooks = _git_config_paths(git, ["--file", config, "--includes", "--get-all", "core.hooksPath"]) if git else None
        includes = (
            _git_config_paths(git, ["--file", config, "--get-regexp", r"^include(if\..+)?\.path$"]) if git else None
        )
        if hooks is None or includes is None:
            warnings.append(f"cannot read {config}: protecting {', '.join(FALLBACK_HOOK_DIRS)} in {repo} instead")
            found += [os.path.join(repo, d) for d in FALLBACK_HOOK_DIRS]
            continue
        for value in [*hooks, *global_hooks]:
            found.append(os.path.normpath(os.path.join(repo, os.path.expanduser(value))))
        for value in includes:
            found.append(os.path.normpath(os.path.join(os.path.dirname(config), os.path.expanduser(value))))
    return [p for p in dict.fromkeys(found) if any(_under(p, w) for w in writable)]


def plan_mounts(policy: Policy, paths: SandboxPaths) -> MountPlan:
    """Look at the filesystem and decide exactly what to bind, mask and protect."""
    fs = policy.filesystem
    warnings: list[str] = []

    writable = [p for p in fs.allow_write if not is_glob(p) and os.path.isdir(p)]
    for p in fs.allow_write:
        if is_glob(p):
            warnings.append(f"allowWrite glob {p!r} is not supported by bwrap and was ignored")
        elif not os.path.exists(p):
            warnings.append(f"allowWrite {p!r} does not exist and was ignored")

    # --workspace ~ (or a parent of it): the home root itself is read-only, so no new start-up file
    # (.bash_aliases, .config/…, .local/bin, .ssh/config, systemd units, autostart) can be created or
    # renamed into place, every dot entry stays read-only, and only the existing non-dot directories
    # and files (except bin/, which .profile puts on PATH) are bound back writable.
    home = os.path.realpath(os.path.expanduser("~"))
    home_rule = os.path.isdir(home) and any(_under(home, w) for w in writable)
    home_writable: list[str] = []
    if home_rule:
        with os.scandir(home) as entries:
            for entry in entries:
                if entry.name.startswith(".") or entry.name in HOME_READONLY_NAMES or entry.is_symlink():
                    continue
                if entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False):
                    home_writable.append(entry.path)

    trees = _Trees()
    globbed_files, globbed_dirs = _find_globbed(fs.deny_read, trees, warnings)
    literal = [p for p in fs.deny_read if not is_glob(p) and os.path.lexists(p)]
    deny_files = globbed_files + [p for p in literal if not os.path.isdir(p)]
    deny_dirs = globbed_dirs + [p for p in literal if os.path.isdir(p)]
    masked_files = [p for p in deny_files if not _matches(p, fs.allow_read)]
    hidden = [p for p in deny_dirs if not _matches(p, fs.allow_read)]
    reallowed = [p for p in fs.allow_read if not is_glob(p) and os.path.exists(p) and any(_under(p, d) for d in hidden)]

    # Other programs' sockets, other kernels' state, and ipyfence's own persistent state.
    for d in (*HOST_SOCKET_DIRS, str(paths.runtime_root), str(paths.state_root)):
        if os.path.isdir(d) and not os.path.islink(d) and d != "/tmp":
            hidden.append(d)

    readonly: list[str] = []
    for root in writable:
        readonly += _protected_in(root, fs.allow_git_config, trees)
        if not trees(root).complete:
            raise_incomplete(root, trees(root))
    repos = [os.path.dirname(p) for p in readonly if os.path.basename(p) == ".git" and os.path.isdir(p)]
    repos += [os.path.dirname(os.path.dirname(p)) for p in readonly if p.endswith("/.git/hooks")]  # allowGitConfig
    hook_paths = git_hook_paths(repos, writable, warnings)
    readonly += [p for p in hook_paths if os.path.lexists(p) and not os.path.islink(p)]
    git_absent = [p for p in hook_paths if not os.path.lexists(p)]
    readonly += [p for p in fs.deny_write if not is_glob(p) and os.path.exists(p)]
    if home_rule:
        readonly.append(home)
    readonly += [str(p) for p in paths.server_install if any(_under(str(p), w) for w in writable)]
    # The kernel runs from the server's install: if that lives under a directory the sandbox
    # replaces (a checkout in /tmp, say), bind it back read-only.
    replaced = ["/tmp", *hidden]
    reallowed += [
        str(p)
        for p in paths.server_install
        if any(_under(str(p), d) for d in replaced) and not any(_under(str(p), w) for w in writable)
    ]
    if paths.packages_dir is not None and paths.packages_dir.is_dir():
        reallowed.append(str(paths.packages_dir))
    absent_files, absent_dirs = _absent_placeholders(paths.workspace, writable, fs.allow_git_config)
    if home_rule:  # the home root is read-only as a whole: no placeholders needed (or left) there
        absent_files = tuple(p for p in absent_files if os.path.dirname(p) != home)
        absent_dirs = tuple(p for p in absent_dirs if os.path.dirname(p) != home)
        writable += home_writable
    absent_dirs += tuple(p for p in git_absent if p not in absent_dirs)  # e.g. a hooksPath not made yet

    # A protected path's ancestors are pinned: otherwise the kernel renames `sub` away (its read-only
    # `sub/.git` moves with it, on the host too) and plants a fresh `sub/.git/hooks` the user's git runs.
    pinned: list[str] = []
    for path in readonly:
        owner = next((w for w in writable if _under(path, w) and path != w), None)
        parent = os.path.dirname(path)
        while owner is not None and parent != owner and _under(parent, owner):
            pinned.append(parent)
            parent = os.path.dirname(parent)
    return MountPlan(
        writable=tuple(dict.fromkeys(writable)),
        hidden_dirs=tuple(dict.fromkeys(hidden)),
        masked_files=tuple(dict.fromkeys(masked_files)),
        readonly=tuple(dict.fromkeys(readonly)),
        reallowed=tuple(dict.fromkeys(reallowed)),
        warnings=tuple(warnings),
        absent_files=absent_files,
        absent_dirs=absent_dirs,
        pinned=tuple(sorted(set(pinned))),
        proc_readonly=tuple(p for p in PROC_READONLY if os.path.exists(p)),
        proc_masked=tuple(p for p in PROC_MASKED if os.path.exists(p)),
    )


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
