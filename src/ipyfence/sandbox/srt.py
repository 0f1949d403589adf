"""Render a policy into sandbox-runtime (``srt``) settings, argv and environment. Pure.

No subprocess, no ``which``: the caller (``srt_launch``) finds the binaries and writes the
settings file. The same ``Policy`` and ``MountPlan`` that drive the bwrap backend drive
this one, for two target platforms:

- ``linux``: srt runs bubblewrap (own user, pid and network namespaces, fresh /proc) and
  a seccomp filter that blocks creating AF_UNIX sockets, plus a filtering HTTP/SOCKS proxy
  reached through socat bridges.
- ``darwin``: srt writes a Seatbelt profile for ``sandbox-exec``. There is no network
  namespace: loopback and unix sockets are filtered by the profile. This path is verified
  only by snapshot tests (CI runs Linux).

Gaps in srt that ipyfence fills here:

- srt passes its own environment to the command unchanged, so ipyfence starts srt with
  only the kernel's environment (``KERNEL_ENV_`` set + minimal base) and the PATH srt
  needs to find node, bwrap, socat and rg.
- srt only knows the user's rules; ipyfence adds its ``.env`` masks (globs and the files
  found at launch), hides its own state and other kernels' directories, hides host socket
  directories (Linux), and adds the always-protected write paths it found.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ipyfence.errors import SandboxError
from ipyfence.policy import Policy
from ipyfence.sandbox.bwrap import LaunchOptions, limits_prefix
from ipyfence.sandbox.plan import GIT_CONFIG, HOST_SOCKET_DIRS, PROTECTED_DIRS, PROTECTED_FILES, MountPlan, SandboxPaths

Platform = Literal["linux", "darwin"]

# Top-level srt keys that only mean something on one platform. Passed through either way
# (srt ignores them), but the user is told they have no effect.
SRT_GLOB_CHARS = frozenset("*?[]{}")  # paths srt would read as globs
DARWIN_ONLY_TOP = frozenset({"allowPty", "allowAppleEvents", "enableWeakerNetworkIsolation"})
DARWIN_ONLY_NET = frozenset({"allowMachLookup"})
LINUX_ONLY_TOP = frozenset(
    {"seccomp", "bwrapPath", "socatPath", "enableWeakerNestedSandbox", "mandatoryDenySearchDepth"}
)
WINDOWS_ONLY_TOP = frozenset({"windows"})


@dataclass(frozen=True)
class SrtRender:
    """Everything needed to start one process under srt."""

    settings: dict[str, Any]  # contents of the --settings JSON file
    argv: list[str]  # full command line, srt included
    env: dict[str, str]  # environment of the srt process (and, through it, of the kernel)


def srt_dir(paths: SandboxPaths) -> str:
    """srt's own temp dir for this kernel (its socat bridge sockets live here).

    A sibling of the kernel dir under the runtime root: outside the kernel's write reach,
    and re-allowed read-only on Linux so the in-sandbox socat can connect to the bridge.
    """
    return str(paths.runtime_root / f"{paths.kernel_dir.name}.srt")


def settings_path(paths: SandboxPaths) -> str:
    """Where the rendered settings go: in the runtime root, which the kernel cannot see."""
    return str(paths.runtime_root / f"{paths.kernel_dir.name}.srt.json")


def kernel_tmpdir(paths: SandboxPaths) -> str:
    """The kernel's TMPDIR. srt overrides TMPDIR in the sandbox with CLAUDE_CODE_TMPDIR."""
    return str(paths.kernel_dir / "tmp")


def _dedupe(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _unix_socket_settings(policy: Policy, paths: SandboxPaths, platform: Platform) -> dict[str, Any]:
    """How the kernel's ZMQ ``ipc`` channels and the tool bridge get through srt.

    The kernel *binds* its five channel sockets in ``kernel_dir`` (the host connects to
    them), and *connects* to ``kernel_dir/bridge.sock``, where the host listens.

    - Linux: srt's seccomp filter refuses ``socket(AF_UNIX, ...)`` outright and cannot
      filter by path, so the only setting that lets ZMQ ipc work is
      ``allowAllUnixSockets``. (TCP is no alternative: the sandbox has its own network
      namespace with no route to the host.) What the kernel could then reach is bounded
      by what it can *see*: abstract sockets belong to the host's network namespace, which
      the kernel is not in, and path sockets of other programs are hidden by denying
      reads of /run, /var/run, /tmp, /var/tmp, /dev/shm, the runtime root and the state
      root (see ``_deny_read``). ``allowUnixSockets`` is ignored by srt on Linux.
    - macOS: Seatbelt filters unix sockets by path (``subpath``), so allow exactly the
      kernel's private directory, which holds only its own channel sockets and
      bridge.sock (the ZMQ ipc socket names are chosen by jupyter_client after this
      renders, so the directory is the narrowest stable rule). ``allowLocalBinding``
      stays off: ipc needs no TCP port.
    """
    if platform == "linux":
        return {"allowAllUnixSockets": True}
    out: dict[str, Any] = {"allowUnixSockets": _dedupe([str(paths.kernel_dir), *policy.network.allow_unix_sockets])}
    if policy.network.allow_all_unix_sockets:
        out["allowAllUnixSockets"] = True
    return out


def _deny_read(policy: Policy, plan: MountPlan, platform: Platform) -> list[str]:
    hidden = list(plan.hidden_dirs)
    if platform == "linux":
        # srt mounts an empty, private tmpfs over a read-denied directory: for /tmp that is
        # the same private /tmp the bwrap backend gives, and it hides host sockets in it.
        hidden.append("/tmp")
    else:
        # Seatbelt filters unix sockets by path already, and /var/run holds things macOS
        # programs need (mDNSResponder): keep the socket dirs visible there.
        hidden = [d for d in hidden if d not in HOST_SOCKET_DIRS]
    # Globs stay globs: srt expands them with ripgrep at launch (Linux) or matches them
    # natively (macOS). The files the plan found are listed as well, in case srt's own
    # expansion differs from ipyfence's (depth, ignore files).
    return _dedupe([*policy.filesystem.deny_read, *plan.masked_files, *hidden, *plan.unscanned, *plan.sockets])


def _allow_read(policy: Policy, plan: MountPlan, paths: SandboxPaths, platform: Platform) -> list[str]:
    out = [*policy.filesystem.allow_read, *plan.reallowed, str(paths.kernel_dir)]
    if platform == "linux":
        out.append(srt_dir(paths))  # the socat bridge socket, bound in before the runtime root is hidden
    return _dedupe(out)


def _protected_globs(roots: Sequence[str], allow_git_config: bool) -> list[str]:
    """macOS only: Seatbelt matches globs at access time, so protect paths that do not exist yet."""
    names = [*PROTECTED_FILES, *PROTECTED_DIRS, *(() if allow_git_config else (GIT_CONFIG,))]
    return [f"{root.rstrip('/')}/**/{name}" for root in roots for name in names]


def _deny_write(policy: Policy, plan: MountPlan, user_roots: Sequence[str], platform: Platform) -> list[str]:
    # srt cannot bind a directory onto itself, so the ancestors bwrap pins against rename() are
    # made read-only as a whole instead: fail closed (nested repos' parents become read-only).
    out = [*policy.filesystem.deny_write, *plan.readonly, *plan.absent_files, *plan.absent_dirs, *plan.pinned]
    out += list(plan.unscanned)
    # srt cannot seal $HOME and bind entries back: its existing dot entries are read-only, but
    # new top-level names can still be created there (the classic rc files get placeholders).
    out += list(plan.sealed_entries)
    if platform == "darwin":
        out += _protected_globs(user_roots, policy.filesystem.allow_git_config)
    # On Linux srt drops write globs (bwrap needs real paths); the existing protected paths
    # are in plan.readonly and srt adds its own mandatory denies (found with ripgrep).
    return _dedupe(out)


def render_settings(
    policy: Policy, plan: MountPlan, paths: SandboxPaths, platform: Platform, options: LaunchOptions | None = None
) -> dict[str, Any]:
    """The srt settings document for one kernel."""
    options = options or LaunchOptions()
    net = policy.network
    writable = _dedupe([*plan.writable, *options.extra_writable, str(paths.kernel_dir)])
    globby = [p for p in (*writable, str(paths.workspace)) if any(ch in p for ch in SRT_GLOB_CHARS)]
    if globby:
        # srt reads such paths as globs (and drops write globs on Linux): its rules would not
        # mean what the plan says. Refuse rather than run with rules that never match.
        raise SandboxError(
            f"the srt backend cannot express the path {globby[0]!r}: it contains glob characters "
            f"({' '.join(sorted(SRT_GLOB_CHARS))}). Use --sandbox-backend bwrap, or rename the directory."
        )
    network: dict[str, Any] = {
        "allowedDomains": list(net.allowed_domains),
        "deniedDomains": list(net.denied_domains),
        "allowLocalBinding": net.allow_local_binding,
        **_unix_socket_settings(policy, paths, platform),
    }
    network.update({k: v for k, v in net.srt_extra.items() if k not in network})
    filesystem: dict[str, Any] = {
        "denyRead": _deny_read(policy, plan, platform),
        "allowRead": _allow_read(policy, plan, paths, platform),
        "allowWrite": writable,
        "denyWrite": _deny_write(policy, plan, plan.writable, platform),
        "allowGitConfig": policy.filesystem.allow_git_config,
    }
    extra = {k: v for k, v in policy.srt_extra.items() if k not in ("network", "filesystem")}
    return {"network": network, "filesystem": filesystem, **extra}


def render_argv(
    policy: Policy, argv: Sequence[str], paths: SandboxPaths, platform: Platform, *, srt: str = "srt"
) -> list[str]:
    """srt's command line.

    Linux wraps srt so that it always gets to clean up: srt stubs non-existent protected
    paths in the workspace with empty files and removes them when its command exits, and it
    runs host-side socat bridges. jupyter_client kills a kernel with SIGKILL to its process
    group, which srt cannot catch. So the process jupyter_client sees is ``setsid -f -w``
    (dies with the server via ``--pdeathsig KILL``); srt runs in its own session under it
    and gets SIGTERM (``--pdeathsig TERM``) when it dies, which srt handles by stopping the
    sandbox, removing its stubs and bridges, and exiting.

    On Linux srt also runs from the kernel's private dir (``env -C``), and the kernel is
    moved back to the workspace inside the sandbox: srt stubs its mandatory denies for
    *missing* files (.bashrc, .gitconfig, .mcp.json, a ``.vscode`` file, a ``.claude`` dir,
    ...) in its current directory, and in the workspace those stubs show up in ``git
    status`` and block editors while the kernel runs. Existing protected paths in the
    workspace come from ipyfence's own plan (``plan.readonly``), as with bwrap.

    ``--`` ends srt's options, so the kernel's own ``-m``/``-f`` are not taken as srt's.
    """
    cmd = [srt, "--settings", settings_path(paths), "--"]
    if platform == "linux":
        wrapper = ["setpriv", "--pdeathsig", "KILL", "--", "setsid", "-f", "-w"]
        wrapper += ["setpriv", "--pdeathsig", "TERM", "--", "env", "-C", str(paths.kernel_dir)]
        inside = ["env", "-C", str(paths.workspace), *limits_prefix(policy.limits)]
        return [*wrapper, *cmd, *inside, *argv]
    return [*cmd, *argv]


def render_env(env: Mapping[str, str], paths: SandboxPaths, tool_dirs: Sequence[str] = ()) -> dict[str, str]:
    """srt's environment, which srt hands on to the kernel (plus its proxy variables).

    Only the kernel's own ``env`` and what srt itself needs: PATH extended by the
    directories of node/srt/bwrap/socat/rg, TMPDIR for srt's own bridge sockets, and
    CLAUDE_CODE_TMPDIR, which srt turns into the kernel's TMPDIR (its private tmp dir).
    """
    out = dict(env)
    path = [p for p in out.get("PATH", "").split(os.pathsep) if p]
    out["PATH"] = os.pathsep.join(_dedupe([*path, *tool_dirs]))
    out["TMPDIR"] = srt_dir(paths)
    out["CLAUDE_CODE_TMPDIR"] = kernel_tmpdir(paths)
    return out


def render(
    policy: Policy,
    plan: MountPlan,
    paths: SandboxPaths,
    env: Mapping[str, str],
    argv: Sequence[str],
    *,
    platform: Platform,
    srt: str = "srt",
    tool_dirs: Sequence[str] = (),
    options: LaunchOptions | None = None,
) -> SrtRender:
    """Policy + plan + kernel command → srt settings, argv and environment."""
    return SrtRender(
        settings=render_settings(policy, plan, paths, platform, options),
        argv=render_argv(policy, argv, paths, platform, srt=srt),
        env=render_env(env, paths, tool_dirs),
    )


def key_warnings(policy: Policy, platform: Platform) -> list[str]:
    """Settings that srt will not honour on ``platform``, or that weaken the sandbox."""
    found: list[str] = []
    top, net = policy.srt_extra, policy.network.srt_extra
    other = "macOS" if platform == "linux" else "Linux"
    unused_top = (DARWIN_ONLY_TOP if platform == "linux" else LINUX_ONLY_TOP) | WINDOWS_ONLY_TOP
    unused_net = DARWIN_ONLY_NET if platform == "linux" else frozenset()
    for key in sorted(unused_top & top.keys()):
        where = "Windows" if key in WINDOWS_ONLY_TOP else other
        found.append(f"srt setting {key!r} only applies on {where}; it has no effect here")
    for key in sorted(unused_net & net.keys()):
        found.append(f"srt setting 'network.{key}' only applies on {other}; it has no effect here")
    if platform == "linux" and policy.network.allow_unix_sockets:
        found.append(
            "network.allowUnixSockets has no effect on Linux (seccomp cannot filter by path); the kernel may "
            "connect to any unix socket it can see, which ipyfence limits by hiding host socket directories"
        )
    if platform == "linux" and top.get("enableWeakerNestedSandbox"):
        found.append(
            "enableWeakerNestedSandbox binds the host's /proc into the sandbox: the kernel can read other "
            "processes' command lines and environments"
        )
    if platform == "darwin" and top.get("enableWeakerNetworkIsolation"):
        found.append("enableWeakerNetworkIsolation lets the kernel reach com.apple.trustd.agent")
    for key in ("httpProxyPort", "socksProxyPort"):
        if key in net:
            found.append(f"network.{key} replaces srt's filtering proxy: domain filtering is up to that proxy")
    if platform == "darwin":
        limits = policy.limits
        if any(
            (limits.memory_mb, limits.max_processes, limits.cpu_seconds, limits.max_file_size_mb, limits.open_files)
        ):
            found.append("resource limits (limits.*) are not enforced on macOS")
    return found
