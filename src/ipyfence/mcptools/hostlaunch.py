"""Where and how a registered stdio MCP server starts on the host: never from kernel-writable paths.

Registered servers run on the host, unsandboxed. The workspace is kernel-writable from the first
cell, so a server started *in* it would run kernel-planted code: ``python -m pkg`` puts the cwd
first on ``sys.path``, ``npx``/``uvx``/``node`` resolve ``node_modules``, ``pyproject.toml``,
``.npmrc``, ``uv.toml`` … from the cwd. So every server starts in a private directory of the
workspace's state dir (hidden from kernels), with a PATH that has no relative or kernel-writable
entry, and a command, ``cwd`` or loader variable that points into a kernel-writable root is
refused — unless the user started ipyfence with ``--allow-workspace-servers`` (a trust decision:
such a server runs whatever the kernel wrote there).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ipyfence.errors import ToolInputError

OPT_IN_FLAG = "--allow-workspace-servers"

# Variables that make an interpreter or tool load code or configuration from the paths they name.
LOADER_VARS = frozenset(
    {
        "PATH",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "PYTHONUSERBASE",
        "PYTHONPYCACHEPREFIX",
        "NODE_PATH",
        "NODE_OPTIONS",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "BASH_ENV",
        "ENV",
        "ZDOTDIR",
        "PERL5LIB",
        "PERL5OPT",
        "RUBYLIB",
        "RUBYOPT",
        "GEM_HOME",
        "GEM_PATH",
        "HOME",
        "XDG_CONFIG_HOME",
        "GIT_DIR",
        "GIT_EXEC_PATH",
        "GIT_CONFIG_GLOBAL",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
    }
)
LOADER_PREFIXES = ("npm_config_", "NPM_CONFIG_", "UV_", "PIP_", "PYTHON", "NODE_", "DENO_", "BUN_", "GIT_CONFIG")


@dataclass(frozen=True)
class HostLaunch:
    """The working directory and base environment for one registered stdio server."""

    cwd: Path
    path: str  # the PATH it inherits, without relative or kernel-writable entries


def _inside(path: str, roots: Iterable[str]) -> bool:
    real = os.path.realpath(path)
    for root in roots:
        r = os.path.realpath(root)
        if real == r or real.startswith(r.rstrip("/") + "/"):
            return True
    return False


def _under(path: str, roots: Iterable[str]) -> bool:
    """Kernel-writable: inside a writable root, and not in the server's own install (always read-only
    in the sandbox, also when it lives inside the workspace, e.g. a checkout's .venv)."""
    from ipyfence.sandbox.plan import default_server_install

    return _inside(path, roots) and not _inside(path, (str(p) for p in default_server_install()))


def safe_path(path: str, roots: Iterable[str]) -> str:
    """PATH without empty, relative or kernel-writable entries (they would resolve the command)."""
    roots = list(roots)
    kept = [p for p in path.split(os.pathsep) if p and os.path.isabs(p) and not _under(p, roots)]
    return os.pathsep.join(dict.fromkeys(kept))


def _mentions(value: str, roots: Iterable[str], base: Path) -> str | None:
    """The first path in ``value`` (split like PATH, or ``--opt=path``) that lies in a writable root."""
    for part in value.replace("=", os.pathsep).split(os.pathsep):
        part = part.strip()
        if not part:
            continue
        candidate = part if os.path.isabs(part) else (str(base / part) if "/" in part or part == "." else None)
        if candidate is not None and _under(candidate, roots):
            return part
    return None


def check(
    name: str,
    command: str,
    env: Mapping[str, str],
    cwd: str | None,
    *,
    workspace: Path,
    roots: Iterable[str],
    private_dir: Path,
    allow_workspace: bool,
    host_path: str,
) -> HostLaunch:
    """Decide where the server starts; refuse what would run kernel-writable code (``ToolInputError``)."""
    roots = [str(workspace), *roots]

    def refuse(what: str) -> ToolInputError:
        return ToolInputError(
            f"register_mcp_server {name!r}: {what}, which the sandboxed kernel can write: the server runs on the "
            f"host, unsandboxed, so it would run whatever the kernel put there. Install the server outside the "
            f"workspace, or (a trust decision) start ipyfence with {OPT_IN_FLAG}."
        )

    if cwd is not None:
        where = Path(cwd) if os.path.isabs(cwd) else workspace / cwd
        if not allow_workspace and _under(str(where), roots):
            raise refuse(f"cwd {cwd!r} is inside a writable root")
        run_dir = where
    else:
        run_dir = private_dir
    path = env.get("PATH", host_path) if allow_workspace else safe_path(env.get("PATH", host_path), roots)
    if "/" in command and not os.path.isabs(command):
        if not allow_workspace:
            raise refuse(f"the command {command!r} is a relative path (it would resolve in the workspace)")
        resolved: str | None = str(run_dir / command)
    else:
        resolved = command if os.path.isabs(command) else shutil.which(command, path=path)
    if resolved is not None and not allow_workspace and _under(resolved, roots):
        raise refuse(f"the command {command!r} resolves to {resolved}")
    if not allow_workspace:
        for key, value in env.items():
            if key in LOADER_VARS or key.startswith(LOADER_PREFIXES):
                hit = _mentions(value, roots, run_dir)
                if hit is not None:
                    raise refuse(f"env {key} names {hit!r}")
    return HostLaunch(cwd=run_dir, path=path)
