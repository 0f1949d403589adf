"""Does the kernel's runtime still import with these directories in front? Asked in the sandbox.

A throwaway process, launched exactly like a kernel (same policy, same environment, no
network), imports what a kernel imports to start and to serve mcptools, then reports which
of those modules came from somewhere other than the server's own install. Used before new
files move into the package dir, when a kernel failed to start (is the package dir the
cause?), and by ``ipyfence doctor``. The imported code is untrusted (it is whatever is in
the package dir), which is why this never runs outside the sandbox the kernel would get.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ipyfence.errors import SandboxError
from ipyfence.packages.layout import dist_name_version
from ipyfence.packages.manage import owner_of, tops_of
from ipyfence.packages.proctail import drain_tail
from ipyfence.packages.runtime_pins import Shadow, shadowing, top_level_names
from ipyfence.sandbox import bwrap
from ipyfence.sandbox.cgroups import Cgroups
from ipyfence.sandbox.launch import args_file, base_env, build_launch, kernel_paths, with_args_fd
from ipyfence.sandbox.plan import default_server_install
from ipyfence.settings import Settings

log = logging.getLogger(__name__)

CHECK_TIMEOUT = 120.0  # seconds; the imports take about a second
OUTPUT_KEEP = 64_000
MARKER = "IPYFENCE-RUNTIME-CHECK "

# Runs inside the sandbox. Only the last line (after MARKER) is read; everything before it
# (warnings, prints of imported code) is kept for the error message.
CHECK_SCRIPT = r"""
import json, os, sys, traceback
trusted = [os.path.realpath(p) for p in os.environ.pop("IPYFENCE_CHECK_TRUSTED").split(os.pathsep) if p]
attempted = {name.partition(".")[0] for name in sys.modules}  # imported before this script ran


class Recorder:
    # First on sys.meta_path: sees every import the runtime tries, including optional ones that fail.
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        attempted.add(fullname.partition(".")[0])
        return None


sys.meta_path.insert(0, Recorder)
result = {"ok": True, "error": "", "foreign": {}}
try:
    import ipykernel.kernelapp, ipykernel.ipkernel, ipykernel.zmqshell, pydantic, ipyfence.mcptools.client
    import ipyfence.pipguard
except BaseException:
    result["ok"] = False
    result["error"] = "".join(traceback.format_exc(limit=-6).splitlines(True)[-40:])
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if not path or "." in name:
        continue
    real = os.path.realpath(path)
    if not any(real == t or real.startswith(t + os.sep) for t in trusted):
        result["foreign"][name] = path
result["attempted"] = sorted(attempted)
print("\n" + MARKER + json.dumps(result), flush=True)
""".replace("MARKER", repr(MARKER))


@dataclass(frozen=True)
class CheckResult:
    ok: bool  # the runtime imported
    error: str  # the traceback's tail when it did not
    foreign: dict[str, str] = field(default_factory=dict)  # top-level module -> file outside the server install
    output: str = ""  # what the process printed (for a failure that is not an import error)
    attempted: frozenset[str] = frozenset()  # every top-level name imported or tried during start-up

    def summary(self) -> str:
        parts = []
        if not self.ok:
            parts.append(f"importing the kernel's runtime fails: {last_error(self.error or self.output)}")
        if self.foreign:
            shown = ", ".join(f"{m} ({p})" for m, p in sorted(self.foreign.items()))
            parts.append(f"runtime modules load from outside the server's install: {shown}")
        return "; ".join(parts)

    @property
    def healthy(self) -> bool:
        return self.ok and not self.foreign


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")


def last_error(text: str) -> str:
    """The last line of a traceback (the exception), with the file it was raised in."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "(no output)"
    raised = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
    files = [ln for ln in lines if ln.startswith('File "') and "<frozen" not in ln]
    where = f" (raised in {files[-1].split(chr(34))[1]})" if files else ""
    return (raised or lines)[-1][:500] + where


async def check_runtime(
    settings: Settings,
    runtime_root: Path,
    *,
    front: tuple[Path, ...] = (),
    with_packages_dir: bool = True,
    writable: tuple[Path, ...] = (),
    cgroups: Cgroups | None = None,
) -> CheckResult:
    """Import the runtime in a throwaway sandboxed process with ``front`` first on PYTHONPATH.

    With ``cgroups`` the process runs under the kernel's process and memory limits too (the
    imported code is untrusted; rlimits alone do not bound the number of processes of root).
    """
    work = Path(tempfile.mkdtemp(prefix="check-", dir=runtime_root))
    try:
        groups = cgroups.for_kernel(f"k-{work.name}") if cgroups is not None else None
    except OSError as exc:  # the hierarchy worked for the kernels: refuse rather than run unlimited
        shutil.rmtree(work, ignore_errors=True)
        raise SandboxError(f"could not set up cgroup limits for the runtime check: {exc}") from None
    try:
        for sub in ("home", "ipython", "mpl", "jupyter"):
            (work / sub).mkdir(mode=0o700)
        env = base_env(settings, work, secrets.token_hex(16))
        entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if not with_packages_dir:
            entries = [p for p in entries if p != str(settings.packages_dir)]
        env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in front), *entries])
        env["IPYFENCE_CHECK_TRUSTED"] = os.pathsep.join(str(p) for p in default_server_install())
        paths = kernel_paths(settings, work, runtime_root)
        # The kernel's launch: no network, the kernel's policy; staging is bound so it can be read.
        options = bwrap.LaunchOptions(die_with_stdin=True, extra_writable=tuple(str(p) for p in writable))
        launch = await asyncio.to_thread(
            build_launch, settings, paths, env, [sys.executable, "-c", CHECK_SCRIPT], options=options
        )
        argv = groups.wrap(launch.argv) if groups is not None else launch.argv
        args_path = work.parent / f"{work.name}.args"
        argv = with_args_fd(argv, args_file(launch, args_path))
        code, output = await _run(argv, launch.env, work, lifeline=launch.backend == "bwrap")
    finally:
        (work.parent / f"{work.name}.args").unlink(missing_ok=True)
        if groups is not None:
            await asyncio.to_thread(groups.remove)
        shutil.rmtree(work, ignore_errors=True)
    return parse_output(code, output)


def parse_output(code: int, output: str) -> CheckResult:
    head, sep, tail = output.rpartition(MARKER)
    if not sep:
        return CheckResult(False, "", {}, output.strip()[-2000:] or f"(the check exited with code {code})")
    try:
        data = json.loads(tail.strip().splitlines()[0])
        attempted = frozenset(str(n) for n in data.get("attempted", ()))
        return CheckResult(bool(data["ok"]), str(data["error"]), dict(data["foreign"]), head.strip()[-2000:], attempted)
    except (ValueError, KeyError, IndexError, TypeError):
        return CheckResult(False, "", {}, output.strip()[-2000:])


async def _run(argv: list[str], env: dict[str, str], cwd: Path, *, lifeline: bool) -> tuple[int, str]:
    # Under bwrap the sandbox dies when its stdin pipe closes (see bwrap.STDIN_WATCH): keep the
    # write end until the process is done, so a server that dies takes the check with it.
    read_end, write_end = os.pipe() if lifeline else (subprocess.DEVNULL, None)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            cwd=str(cwd),
            stdin=read_end,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        if write_end is not None:
            os.close(read_end)
    assert proc.stdout is not None
    buf = bytearray()
    try:
        await asyncio.wait_for(drain_tail(proc, buf, OUTPUT_KEEP), CHECK_TIMEOUT)
    except TimeoutError:
        buf.extend(f"\n(the check did not finish within {CHECK_TIMEOUT:.0f}s)".encode())
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(BaseException):
                await asyncio.shield(proc.wait())
        if write_end is not None:
            os.close(write_end)
    return proc.returncode or 0, buf.decode(errors="replace")


# Run by the interpreter at start-up from anywhere on sys.path, before any import we can see.
STARTUP_HOOKS = frozenset({"sitecustomize", "usercustomize"})
SCRIPT_GROUPS = frozenset({"console_scripts", "gui_scripts"})


def may_change_start(staging: Path, packages_dir: Path, attempted: frozenset[str]) -> bool:
    """Could moving ``staging`` in change what a kernel does while it starts?

    Only through a name start-up imports or tries (``attempted``, recorded by the check), a
    start-up hook, or entry points (plugins are looked up by group, from any dist-info on
    the path). Distributions that the move replaces count too: removing them changes what
    those names resolve to.
    """
    names = top_level_names(staging)
    staged = {dist_name_version(p)[0] for p in staging.glob("*.dist-info")}
    names |= tops_of(packages_dir, staged)
    if names & (attempted | STARTUP_HOOKS):
        return True
    for info in staging.glob("*.dist-info"):
        try:
            text = (info / "entry_points.txt").read_text(errors="replace")
        except OSError:
            continue
        groups = {ln.strip()[1:-1].strip() for ln in text.splitlines() if ln.strip().startswith("[")}
        if groups - SCRIPT_GROUPS:
            return True
    return False


# --- is the package dir why a kernel cannot start? ----------------------------------------------


@dataclass(frozen=True)
class Diagnosis:
    packages_dir: Path
    shadows: list[Shadow]  # files in the package dir that shadow the runtime (a static look)
    with_dir: CheckResult | None  # None: not run (no sandbox could be built)
    without_dir: CheckResult | None
    owners: dict[str, str]  # shadow entry -> the distribution in the package dir that owns it

    @property
    def broken_by_dir(self) -> bool:
        """The runtime does not import because of the package dir (the reason a kernel cannot start)."""
        if self.with_dir is None:  # no sandbox to import in: judge by the files
            return bool(self.shadows)
        if self.with_dir.ok:
            return False
        if self.without_dir is not None and self.without_dir.ok:
            return True
        return str(self.packages_dir) in self.with_dir.error

    @property
    def problems(self) -> bool:
        """Anything to repair: a broken import, or files that shadow the runtime even if it still imports."""
        base = os.path.realpath(self.packages_dir) + os.sep
        loaded = self.with_dir.foreign.values() if self.with_dir is not None else ()
        return self.broken_by_dir or bool(self.shadows) or any(os.path.realpath(p).startswith(base) for p in loaded)

    def fixes(self) -> list[str]:
        """What to run or delete, one item per shadowing entry."""
        out = []
        for s in self.shadows:
            owner = self.owners.get(s.entry)
            if owner:
                out.append(f"uninstall_package({owner!r})")
            else:
                name = s.entry.split(".", 1)[0] if not (self.packages_dir / s.entry).is_dir() else s.entry
                out.append(f"uninstall_package({name!r}) (or delete {self.packages_dir / s.entry})")
        return out

    def describe(self) -> str:
        where = f"the workspace's package dir {self.packages_dir}"
        parts = []
        if self.shadows:
            shown = ", ".join(
                f"{s.entry}"
                + (f" (from {self.owners[s.entry]})" if s.entry in self.owners else " (not installed by pip)")
                + f" shadows {s.owner}"
                for s in self.shadows
            )
            parts.append(f"{where} holds files that shadow the kernel's own runtime: {shown}")
        if self.with_dir is not None and not self.with_dir.healthy:
            extra = "" if self.without_dir is None or not self.without_dir.ok else " (it works without that dir)"
            parts.append(f"with it on the path, {self.with_dir.summary()}{extra}")
        text = "; ".join(parts) or f"{where} is involved"
        fixes = self.fixes()
        if fixes:
            text += ". Fix: " + ", then ".join(fixes)
        else:
            text += ". Fix: see list_packages() and remove the package that broke it with uninstall_package(name)"
        return text + "."


async def diagnose(settings: Settings, runtime_root: Path, cgroups: Cgroups | None = None) -> Diagnosis:
    """Look at the package dir statically, then import the runtime with and without it."""
    packages_dir = settings.packages_dir
    shadows = shadowing(packages_dir)
    owners = {s.entry: o for s in shadows if (o := owner_of(packages_dir, s.entry))}
    with_dir: CheckResult | None = None
    without_dir: CheckResult | None = None
    try:
        with_dir = await check_runtime(settings, runtime_root, cgroups=cgroups)
        if not with_dir.healthy:
            without_dir = await check_runtime(settings, runtime_root, with_packages_dir=False, cgroups=cgroups)
    except Exception as exc:  # no sandbox to run it in: the static look must do
        log.warning("could not run the sandboxed runtime check: %s", exc)
    return Diagnosis(packages_dir, shadows, with_dir, without_dir, owners)
