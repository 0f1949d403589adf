"""Keep ipyfence's placeholder files out of ``git status`` while a server runs.

An absent ``.mcp.json`` at the workspace root gets an empty read-only placeholder file (so the kernel
cannot plant an MCP server config there). Empty placeholder directories never show in git, but that
file would, and ``git add -A`` would commit it. So while the server runs, the repository's
``.git/info/exclude`` (local to the clone, never committed) carries one marked block naming the
placeholder files; it is removed again at exit. Written through directory descriptors without
following links, like every host write near the workspace.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from ipyfence import safefs
from ipyfence.errors import IpyfenceError

log = logging.getLogger(__name__)

BEGIN = "# >>> ipyfence placeholders (removed when the ipyfence server exits)"
END = "# <<< ipyfence placeholders"


def _repo_of(workspace: Path) -> Path | None:
    """The work tree root whose ``.git`` is a directory, at or above the workspace."""
    for candidate in (workspace, *workspace.parents):
        git = candidate / ".git"
        # A real repository (not ipyfence's own empty .git placeholder): it has a HEAD.
        if git.is_dir() and not git.is_symlink() and (git / "HEAD").is_file():
            return candidate
    return None


def _without_block(text: str) -> str:
    lines, keep, inside = text.splitlines(keepends=True), [], False
    for line in lines:
        if line.rstrip("\n") == BEGIN:
            inside = True
        elif line.rstrip("\n") == END and inside:
            inside = False
        elif not inside:
            keep.append(line)
    return "".join(keep)


def _rewrite(repo: Path, block: list[str]) -> None:
    try:
        with safefs.opened_dir(repo, ".git/info", create=True) as info:
            try:
                fd = os.open("exclude", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=info)
                with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as f:
                    text = f.read(1024 * 1024)
            except FileNotFoundError:
                text = ""
            text = _without_block(text)
            if block:
                text = text + ("" if not text or text.endswith("\n") else "\n") + "\n".join([BEGIN, *block, END]) + "\n"
            safefs.write_file(info, "exclude", text.encode("utf-8"))
    except (OSError, IpyfenceError) as exc:
        log.warning("could not update %s/.git/info/exclude: %s", repo, exc)


def exclude(workspace: Path, placeholder_files: list[str]) -> None:
    """Name the placeholder files in the repository's local exclude list (idempotent)."""
    repo = _repo_of(workspace)
    if repo is None:
        return
    rels = sorted({"/" + os.path.relpath(p, repo) for p in placeholder_files if Path(p).is_relative_to(repo)})
    if rels:
        _rewrite(repo, rels)


def restore(workspace: Path) -> None:
    """Remove ipyfence's block again (at server exit)."""
    repo = _repo_of(workspace)
    if repo is not None:
        with contextlib.suppress(Exception):
            _rewrite(repo, [])
