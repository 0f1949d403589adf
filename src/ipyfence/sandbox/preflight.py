"""Probes of the machine: is each sandbox prerequisite there, and how to fix it if not.

Separate from rendering: this module runs things, renderers never do.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipyfence.settings import Settings

PROBE_TIMEOUT = 15.0


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str  # version or what went wrong
    fix: str = ""  # how to fix it, when not ok
    required: bool = True  # False: only some features need it


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _version(argv: list[str]) -> str:
    code, out = _run(argv)
    return out.splitlines()[0] if code == 0 and out else "present"


USERNS_FIX = (
    "enable unprivileged user namespaces: `sudo sysctl -w kernel.unprivileged_userns_clone=1` (Debian) or, on "
    "Ubuntu 24.04+, `sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (or an AppArmor profile for bwrap)"
)


def check_bwrap() -> Check:
    path = shutil.which("bwrap")
    if path is None:
        return Check("bwrap", False, "not found", "sudo apt-get install bubblewrap")
    probe = [path, "--unshare-user", "--unshare-pid", "--unshare-net", "--die-with-parent", "--cap-drop", "ALL"]
    probe += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--", "true"]
    code, out = _run(probe)
    if code != 0:
        return Check("bwrap", False, f"{path} cannot create namespaces: {out[:300]}", USERNS_FIX)
    return Check("bwrap", True, f"{_version([path, '--version'])} ({path}); namespaces work")


def check_tool(name: str, fix: str, *, required: bool, version_flag: str = "--version") -> Check:
    path = shutil.which(name)
    if path is None:
        return Check(name, False, "not found", fix, required)
    return Check(name, True, f"{_version([path, version_flag])} ({path})", required=required)


def check_kernel_python() -> Check:
    code, out = _run([sys.executable, "-c", "import ipykernel, sys; print(ipykernel.__version__)"])
    if code != 0:
        return Check("ipykernel", False, out[-300:], f"{sys.executable} -m pip install ipykernel")
    return Check("ipykernel", True, f"ipykernel {out} ({sys.executable})")


def checks(platform: str = sys.platform) -> list[Check]:
    found = [check_kernel_python()]
    if platform == "darwin":
        found.append(check_tool("sandbox-exec", "part of macOS; cannot be missing on a normal install", required=True))
    else:
        found.append(check_bwrap())
        found.append(check_tool("prlimit", "sudo apt-get install util-linux", required=True))
        found.append(check_tool("setpriv", "sudo apt-get install util-linux", required=True))
    srt_required = platform == "darwin"
    found.append(check_tool("srt", "npm install -g @anthropic-ai/sandbox-runtime", required=srt_required))
    if platform != "darwin":
        found.append(
            check_tool("socat", "sudo apt-get install socat (needed by srt)", required=False, version_flag="-V")
        )
    found.append(check_tool("rg", "sudo apt-get install ripgrep (needed by srt)", required=False))
    return found


def check_packages(settings: Settings) -> Check:
    """Does the kernel's runtime still import with the workspace's package dir first on the path?

    Imports run in the sandbox the kernel would get (installed code is untrusted); when no
    sandbox can be built, only the static look at the directory's files is reported.
    """
    import asyncio
    import shutil as _shutil
    import tempfile

    from ipyfence.packages.runtime_check import diagnose

    name = "package dir"
    if not settings.packages_dir.is_dir():
        return Check(name, True, f"{settings.packages_dir} (nothing installed yet)")
    root = Path(tempfile.mkdtemp(prefix="ipyfence-doctor-"))
    try:
        found = asyncio.run(diagnose(settings, root))
    finally:
        _shutil.rmtree(root, ignore_errors=True)
    how = "imports checked in the sandbox" if found.with_dir is not None else "files checked (no sandbox to import in)"
    if not found.problems and (found.with_dir is None or found.with_dir.healthy):
        return Check(name, True, f"{settings.packages_dir}: the kernel's runtime is not shadowed ({how})")
    if not found.problems:
        assert found.with_dir is not None
        return Check(
            name,
            False,
            f"the kernel's runtime does not import cleanly, and not because of the package dir: "
            f"{found.with_dir.summary()}",
            "reinstall ipyfence (the server's own environment is damaged), or check KERNEL_ENV_PYTHONPATH",
        )
    fixes = found.fixes()
    fix = (
        "call " + ", then ".join(fixes) + " from the agent"
        if fixes
        else "call list_packages() and uninstall_package(name) for the package that broke it"
    )
    return Check(name, False, found.describe(), fix + f", or delete {settings.packages_dir} to start afresh")


def require_bwrap() -> None:
    """Raise a fix-it error unless bwrap can really build a sandbox here."""
    from ipyfence.errors import SandboxUnavailableError

    check = check_bwrap()
    if not check.ok:
        raise SandboxUnavailableError(
            f"cannot start the sandbox: bwrap {check.detail}\n  fix: {check.fix}\n"
            "  check: ipyfence doctor\n  (ipyfence never falls back to running unsandboxed; --no-sandbox opts out)"
        )
