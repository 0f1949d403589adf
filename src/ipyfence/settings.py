"""Frozen server settings, built once from CLI flags, the environment and the workspace ``.env``."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dotenv import dotenv_values

from ipyfence.errors import ConfigError
from ipyfence.policy import Policy, load_policy, resolve_paths

log = logging.getLogger(__name__)

KERNEL_ENV_PREFIX = "KERNEL_ENV_"
Backend = Literal["auto", "bwrap", "srt"]


@dataclass(frozen=True)
class Settings:
    workspace: Path  # absolute, resolved workspace directory
    sandbox: bool  # False only with an explicit --no-sandbox
    backend: Backend  # requested sandbox backend
    profile: str  # profile name under sandbox-profiles/
    sandbox_config: Path | None  # srt-format JSON layered over the profile
    policy: Policy  # profile + config, paths resolved against the workspace
    host_env: Mapping[str, str] = field(repr=False)  # server env + workspace .env, for ${VAR} substitution
    kernel_env: Mapping[str, str] = field(repr=False)  # KERNEL_ENV_* with the prefix stripped
    state_root: Path = Path()  # ipyfence's persistent state for all workspaces (hidden from kernels)
    standby: bool = True  # keep a pre-started kernel for fast reset()
    allow_workspace_servers: bool = False  # trust decision: registered servers may start from kernel-writable paths

    @property
    def state_dir(self) -> Path:
        """Persistent state of this workspace: registry, installed packages, pip cache."""
        digest = hashlib.sha256(str(self.workspace).encode()).hexdigest()[:12]
        return self.state_root / "workspaces" / f"{self.workspace.name or 'root'}-{digest}"

    @property
    def packages_dir(self) -> Path:
        return self.state_dir / "site-packages"


def default_state_root(environ: Mapping[str, str]) -> Path:
    if environ.get("IPYFENCE_STATE_DIR"):
        return Path(environ["IPYFENCE_STATE_DIR"]).expanduser().resolve()
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base).resolve() / "ipyfence"


MAX_DOTENV_BYTES = 256 * 1024  # a workspace .env larger than this is ignored (with a warning)


def read_dotenv(workspace: Path) -> dict[str, str]:
    """The workspace ``.env``, read once at server start, as literal values.

    The kernel can write the workspace (and may have created this file), so the file is data,
    never instructions: no ``${VAR}`` interpolation (python-dotenv would pull other variables of
    the server's environment into it, and so into the kernel), no symlinks (it would choose
    which file is read), only a regular file of bounded size (a FIFO or /dev/zero would hang or
    exhaust the server). Anything else is ignored with a warning, never a failed start.
    """
    path = workspace / ".env"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("ignoring %s: cannot open it without following links (%s)", path, exc.strerror)
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            log.warning("ignoring %s: not a regular file", path)
            return {}
        if st.st_size > MAX_DOTENV_BYTES:
            log.warning("ignoring %s: larger than %d KiB", path, MAX_DOTENV_BYTES // 1024)
            return {}
        raw = os.read(fd, MAX_DOTENV_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        log.warning("ignoring %s: not UTF-8 (%s)", path, exc.reason)
        return {}
    try:
        values = dotenv_values(stream=io.StringIO(text), interpolate=False)
    except Exception as exc:  # the parser is lenient, but a bad file must never stop the server
        log.warning("ignoring %s: cannot parse it (%s)", path, exc)
        return {}
    return {k: v for k, v in values.items() if v is not None}


def split_env(server_env: Mapping[str, str], dotenv: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(host_env, kernel_env). The server's own environment wins over ``.env``, as with python-dotenv."""
    host_env = {**dotenv, **server_env}
    kernel_env = {
        key[len(KERNEL_ENV_PREFIX) :]: value
        for key, value in host_env.items()
        if key.startswith(KERNEL_ENV_PREFIX) and len(key) > len(KERNEL_ENV_PREFIX)
    }
    return host_env, kernel_env


def resolve_workspace(workspace: str | Path) -> Path:
    """The absolute workspace; a missing one is created (as ipybox does), ``/`` and files are refused."""
    path = Path(workspace).expanduser()
    if not path.exists() and not path.is_symlink():
        try:
            path.mkdir(parents=True)
        except OSError as exc:
            raise ConfigError(f"workspace {str(workspace)!r} does not exist and cannot be created: {exc}") from None
        log.info("created the workspace %s", path.resolve())
    if not path.is_dir():
        raise ConfigError(f"workspace {str(workspace)!r} is not a directory")
    resolved = path.resolve()
    if resolved == Path(resolved.anchor):
        # The kernel could write every file on the machine: never a sensible sandbox.
        raise ConfigError(
            f"workspace {str(workspace)!r} is the filesystem root {str(resolved)!r}; "
            "choose a project directory (the kernel may write everything in its workspace)"
        )
    return resolved


def build_settings(
    workspace: str | Path,
    *,
    sandbox: bool = True,
    backend: Backend = "auto",
    profile: str = "default",
    sandbox_config: Path | None = None,
    environ: Mapping[str, str] | None = None,
    standby: bool = True,
    allow_workspace_servers: bool = False,
) -> Settings:
    env = dict(os.environ if environ is None else environ)
    ws = resolve_workspace(workspace)
    policy = resolve_paths(load_policy(profile, sandbox_config), ws)
    host_env, kernel_env = split_env(env, read_dotenv(ws))
    return Settings(
        workspace=ws,
        sandbox=sandbox,
        backend=backend,
        profile=profile,
        sandbox_config=sandbox_config,
        policy=policy,
        host_env=host_env,
        kernel_env=kernel_env,
        state_root=default_state_root(env),
        standby=standby,
        allow_workspace_servers=allow_workspace_servers,
    )


def platform_backend(settings: Settings) -> Literal["bwrap", "srt"]:
    """The backend ``auto`` means here: srt on macOS, or on Linux when domains are allowed."""
    if settings.backend != "auto":
        return settings.backend
    if sys.platform == "darwin" or settings.policy.network.allowed_domains:
        return "srt"
    return "bwrap"
