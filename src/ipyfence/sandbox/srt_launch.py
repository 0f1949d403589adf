"""The impure half of the srt backend: find the binaries, write the settings file, probe.

``srt.py`` renders; this module touches the machine. The settings file is written into
the runtime root (hidden from every kernel), never into the kernel's own directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from ipyfence.errors import SandboxUnavailableError
from ipyfence.policy import Policy
from ipyfence.sandbox import srt
from ipyfence.sandbox.bwrap import LaunchOptions
from ipyfence.sandbox.launch import Launch, trusted_path
from ipyfence.sandbox.plan import SandboxPaths, plan_mounts
from ipyfence.settings import Settings

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 60.0
# install_package's pip under srt: reach the package index through srt's proxy, not
# the whole network (srt always puts the kernel in its own network namespace on Linux).
PACKAGE_INDEX_DOMAINS = ("pypi.org", "files.pythonhosted.org")
SRT_FIX = "npm install -g @anthropic-ai/sandbox-runtime   (needs Node.js >= 20)"


def target_platform() -> srt.Platform:
    return "darwin" if sys.platform == "darwin" else "linux"


def find_srt() -> str:
    found = shutil.which("srt", path=trusted_path())
    if not found:
        raise SandboxUnavailableError(
            "sandbox-runtime (srt) is not installed, so the kernel cannot be sandboxed with the srt backend.\n"
            f"  fix: {SRT_FIX}\n"
            "  check: ipyfence doctor\n"
            "  (on Linux, --sandbox-backend bwrap works without srt unless the policy allows network domains)"
        )
    return found


def tool_dirs(srt_path: str) -> list[str]:
    """Directories srt must find on PATH: node (srt's interpreter), bwrap, socat, rg."""
    dirs = [os.path.dirname(os.path.realpath(srt_path)), os.path.dirname(srt_path)]
    for name in ("node", "bwrap", "socat", "rg", "setpriv", "setsid", "prlimit"):
        found = shutil.which(name, path=trusted_path())
        if found:
            dirs.append(os.path.dirname(found))
    return list(dict.fromkeys(d for d in dirs if d))


def _with_index_domains(policy: Policy) -> Policy:
    from dataclasses import replace

    net = policy.network
    domains = net.allowed_domains + tuple(d for d in PACKAGE_INDEX_DOMAINS if d not in net.allowed_domains)
    return replace(policy, network=replace(net, allowed_domains=domains))


def build(
    settings: Settings,
    paths: SandboxPaths,
    env: Mapping[str, str],
    argv: Sequence[str],
    *,
    options: LaunchOptions | None = None,
) -> Launch:
    """The srt launch of ``argv``: settings written, binaries found, nothing started."""
    options = options or LaunchOptions()
    srt_path = find_srt()
    policy = _with_index_domains(settings.policy) if options.network else settings.policy
    plan = plan_mounts(policy, paths)
    rendered = srt.render(
        policy,
        plan,
        paths,
        env,
        argv,
        platform=target_platform(),
        srt=srt_path,
        tool_dirs=tool_dirs(srt_path),
        options=options,
    )
    if paths.runtime_root.is_dir():
        write_settings(rendered.settings, paths)
    # else: a dry render (--print-policy names a runtime root that is never created).
    return Launch(argv=rendered.argv, env=rendered.env, plan=plan, backend="srt")


def write_settings(settings: dict[str, object], paths: SandboxPaths) -> Path:
    """Write the settings file (0600) and create srt's and the kernel's temp dirs."""
    Path(srt.srt_dir(paths)).mkdir(mode=0o700, parents=True, exist_ok=True)
    Path(srt.kernel_tmpdir(paths)).mkdir(mode=0o700, parents=True, exist_ok=True)
    target = Path(srt.settings_path(paths))
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(settings, fh, indent=2)
    return target


def _missing_tools(platform: srt.Platform) -> list[str]:
    needed = {
        "linux": {
            "bwrap": "sudo apt-get install bubblewrap",
            "socat": "sudo apt-get install socat",
            "rg": "sudo apt-get install ripgrep",
            "setpriv": "sudo apt-get install util-linux",
            "setsid": "sudo apt-get install util-linux",
            "prlimit": "sudo apt-get install util-linux",
        },
        "darwin": {
            "sandbox-exec": "part of macOS; it cannot be missing on a normal install",
            "rg": "brew install ripgrep",
        },
    }[platform]
    return [f"{name} (fix: {fix})" for name, fix in needed.items() if shutil.which(name) is None]


def preflight(settings: Settings) -> None:
    """Check that srt and its helpers are here and that srt accepts the rendered settings.

    Raises ``SandboxUnavailableError`` with a fix-it message; logs settings srt will not
    honour on this platform.
    """
    platform = target_platform()
    srt_path = find_srt()
    missing = _missing_tools(platform)
    if missing:
        raise SandboxUnavailableError(
            "the srt sandbox backend needs tools that are not installed:\n  "
            + "\n  ".join(missing)
            + "\n  check: ipyfence doctor"
        )
    if settings.backend == "auto" and platform == "linux":
        log.info("sandbox backend: srt (auto), because the policy allows network domains through srt's proxy")
    for line in srt.key_warnings(settings.policy, platform):
        log.warning("srt backend: %s", line)
    probe(settings, srt_path)


def probe(settings: Settings, srt_path: str) -> None:
    """Run ``true`` under the real rendered settings: srt validates them and builds the sandbox."""
    from ipyfence.sandbox.launch import kernel_paths

    runtime_root = Path(tempfile.mkdtemp(prefix="ipyfence-probe-"))
    try:
        kernel_dir = runtime_root / "k0"
        kernel_dir.mkdir(mode=0o700)
        paths = kernel_paths(settings, kernel_dir, runtime_root)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(kernel_dir), "LANG": "C.UTF-8"}
        plan = plan_mounts(settings.policy, paths)
        rendered = srt.render(
            settings.policy,
            plan,
            paths,
            env,
            ["true"],
            platform=target_platform(),
            srt=srt_path,
            tool_dirs=tool_dirs(srt_path),
        )
        write_settings(rendered.settings, paths)
        try:
            proc = subprocess.run(
                rendered.argv,
                env=rendered.env,
                cwd=settings.workspace,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailableError(f"srt could not be started: {exc}\n  check: ipyfence doctor") from None
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip()[-1500:]
            raise SandboxUnavailableError(
                f"srt refused the sandbox settings or could not build the sandbox (exit {proc.returncode}):\n"
                f"{detail}\n"
                "  (settings come from the profile and --sandbox-config; `ipyfence --print-policy` shows them)"
            )
    finally:
        shutil.rmtree(runtime_root, ignore_errors=True)
