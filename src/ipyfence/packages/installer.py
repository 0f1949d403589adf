"""install_package: pip resolves and builds inside the sandbox; the server only moves files.

Two sandboxed pip runs, both with the kernel's filesystem policy, rlimits and (a cgroup of its
own with) its cgroup limits, within one ``limits.installSeconds`` budget, started in pip's
private directory with ``-P``/PYTHONSAFEPATH (nothing the kernel writes is on sys.path).
Under bwrap pip has its own network namespace and reaches only the configured package index
through packages/proxy.py:

1. ``pip install --dry-run --report`` with the package directory on PYTHONPATH, so pip
   counts what the kernel can already import (user packages over the server's venv) as
   satisfied. ``--target`` would ignore installed packages and reinstall ipykernel's and
   pydantic's dependencies over the server's copies.
2. ``pip install --target STAGING --no-deps PINS`` for exactly what step 1 chose. Build
   code (setup.py, backends) runs in both steps; it can write only the staging directory,
   the pip cache and its private home and tmp, never the package directory.

Both runs get a constraints file pinning the kernel's own runtime (ipykernel, pydantic and
their dependencies: ``runtime_pins``) to the server's versions, so a request that needs
another version of one of them fails to resolve, and says so in one sentence. Before the
staged files move in, a throwaway sandboxed process imports the kernel's runtime with
staging in front of the package directory, and staging is checked for files that would
shadow a runtime module: a package that would stop the kernel from starting is refused and
the package directory is left untouched.

Then, with the kernel session's lock held (no cell runs), the staged files are moved into
the package directory and the running kernel's import caches are invalidated.
``list_packages`` and ``uninstall_package`` (``manage``) show and repair the directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from ipyfence.errors import KernelError, KernelStartError, PackageInstallError
from ipyfence.kernel import KernelSession
from ipyfence.packages.layout import Replaced, install_staged
from ipyfence.packages.manage import check_name, list_installed, owner_of, render_listing, uninstall
from ipyfence.packages.pipenv import pip_env
from ipyfence.packages.proctail import drain_tail
from ipyfence.packages.proxy import IndexProxy, allowed_destinations, upstream_proxies
from ipyfence.packages.runtime_check import CheckResult, check_runtime, diagnose, last_error, may_change_start
from ipyfence.packages.runtime_pins import explain_conflict, runtime_dists, shadowing, write_constraints
from ipyfence.packages.spec import PackageSpec, parse_spec
from ipyfence.sandbox import bwrap
from ipyfence.sandbox.cgroups import KernelGroups
from ipyfence.sandbox.launch import args_file, build_launch, kernel_paths, sandboxed_exec, with_args_fd
from ipyfence.settings import Settings, platform_backend

log = logging.getLogger(__name__)

REPORT_MAX_BYTES = 16 * 1024 * 1024  # pip's --report for even a large dependency tree is far smaller
PROXY_SOCKET = "index-proxy.sock"  # in pip's private dir: the sandbox's only way out
OUTPUT_KEEP = 64_000  # bytes of pip output kept while it runs (the tail)
ERROR_CHARS = 3000  # characters of pip output shown in an error
REFRESH_TIMEOUT = 10.0  # seconds for the kernel to invalidate its import caches


class PackageInstaller:
    """One install at a time; each install holds the kernel lock only while files move."""

    def __init__(self, settings: Settings, session: KernelSession) -> None:
        self.settings = settings
        self.session = session
        self._lock = asyncio.Lock()
        self._deadline: tuple[Path, float] | None = None  # (pip's private dir, monotonic deadline)

    @property
    def cache_dir(self) -> Path:
        return self.settings.state_dir / "pip-cache"

    async def install(self, package_name: str) -> str:
        spec = parse_spec(package_name)
        async with self._lock:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            self.settings.packages_dir.mkdir(parents=True, exist_ok=True)
            # Private dir (home, tmp, report) is hidden from kernels under the runtime root;
            # staging sits next to the package directory so the final move is a rename.
            work = Path(tempfile.mkdtemp(prefix="pip-", dir=self.session.factory.runtime_root))
            staging = Path(tempfile.mkdtemp(prefix="staging-", dir=self.settings.state_dir))
            try:
                return await self._install(spec, work, staging)
            finally:
                shutil.rmtree(work, ignore_errors=True)
                shutil.rmtree(staging, ignore_errors=True)

    async def _install(self, spec: PackageSpec, work: Path, staging: Path) -> str:
        started = time.monotonic()
        report = work / "report.json"
        # What the kernel's start-up imports with the package dir as it is, learnt while pip
        # resolves (it overlaps with the dry run): it decides whether staged files need the
        # sandboxed start check (_check_before_move_in).
        root, groups = self.session.factory.runtime_root, self.session.factory.cgroups
        baseline = asyncio.ensure_future(check_runtime(self.settings, root, cgroups=groups))
        try:
            # The kernel's runtime stays at the server's versions (see runtime_pins), in both runs.
            pinned = ["--constraint", str(write_constraints(work / "constraints.txt"))]
            try:
                # --verbose cancels one --quiet: pip names both sides of a conflict only at normal verbosity.
                dry_run = ["--verbose", "--dry-run", "--report", str(report), *pinned]
                await self._pip(spec, work, dry_run, [spec.text], writable=())
            except PackageInstallError as exc:
                raise PackageInstallError(explain_conflict(spec.text, str(exc)) or str(exc)) from None
            items = _report_items(report)
            if not items:
                return _already_satisfied(spec, self.settings.packages_dir)
            _refuse_runtime_items(spec, items, self.settings.packages_dir)
            pins = [_pin(item) for item in items]
            await self._pip(spec, work, ["--target", str(staging), "--no-deps", *pinned], pins, writable=(staging,))
            await self._check_before_move_in(spec, staging, await baseline)
        finally:
            if not baseline.done():
                baseline.cancel()
            with contextlib.suppress(BaseException):
                await baseline
        async with self.session.lock:
            replaced = install_staged(staging, self.settings.packages_dir)
            await self._refresh_kernel()
        log.info("installed %s in %.1fs", spec.text, time.monotonic() - started)
        return _success_message(items, replaced)

    async def _check_before_move_in(self, spec: PackageSpec, staging: Path, baseline: CheckResult) -> None:
        """Refuse staged files that would shadow the kernel's runtime or stop it from starting.

        The sandboxed start check runs unless the staged files cannot take part in start-up:
        none of their import names is one the start-up imports or tries (``baseline``, from
        the package dir as it is), they carry no ``sitecustomize`` and no entry points other
        than scripts, and the distributions they replace provide none of those names either.
        It runs first: it executes staged code, which can write staging, so the static look
        at staging comes after it, at the files that would really move in.
        """
        packages_dir = self.settings.packages_dir
        if not baseline.healthy or may_change_start(staging, packages_dir, baseline.attempted):
            root, groups = self.session.factory.runtime_root, self.session.factory.cgroups
            result = await check_runtime(self.settings, root, front=(staging,), writable=(staging,), cgroups=groups)
            staged = {m: p for m, p in result.foreign.items() if _under(p, staging)}
            if not result.ok or staged:
                if not result.ok and not baseline.ok:
                    diagnosis = await diagnose(self.settings, root, groups)
                    raise PackageInstallError(
                        f"install_package did not install {spec.text!r}: the kernel's runtime does not import even "
                        f"without it, so the package dir needs repair first: {diagnosis.describe()}"
                    )
                shown = (
                    result.summary()
                    if not result.ok
                    else "; ".join(f"{m} would load from {p}" for m, p in staged.items())
                )
                raise PackageInstallError(
                    f"install_package refused {spec.text!r}: with it installed the kernel could not start cleanly "
                    f"({shown}). Nothing was installed; the package dir is unchanged."
                )
        shadows = shadowing(staging)
        if shadows:
            owners = {s.entry: owner_of(staging, s.entry) for s in shadows}
            shown = ", ".join(
                f"{s.entry}" + (f" (from {owners[s.entry]})" if owners[s.entry] else "") + f" would shadow {s.owner}"
                for s in shadows
            )
            raise PackageInstallError(
                f"install_package refused {spec.text!r}: {shown}, which the kernel itself runs on (it would import "
                "the installed copy instead of its own). Nothing was installed; use a separate Python environment "
                "outside ipyfence for code that needs it."
            )

    async def list_packages(self) -> str:
        return await asyncio.to_thread(render_listing, self.settings.packages_dir)

    async def uninstall(self, package_name: str) -> str:
        """Remove one distribution (or hand-made module) from the package dir, then refresh the kernel."""
        check_name(package_name)
        async with self._lock, self.session.lock:
            removed = await asyncio.to_thread(uninstall, self.settings.packages_dir, package_name)
            text = f"Removed {removed.what} from this workspace's package dir."
            if removed.shadows:
                left = ", ".join(f"{s.entry} (shadows {s.owner})" for s in removed.shadows)
                text += f" Still shadowing the kernel's runtime: {left}."
            try:
                alive = await self.session.kernel.km.is_alive()
            except KernelError:
                alive = False
            if alive:
                await self._refresh_kernel()
                return text + " The running kernel keeps modules it already imported until reset()."
            try:
                await self.session.replace_kernel()
            except KernelStartError as exc:
                explained = await self.explain_start_failure(exc) or str(exc)
                return text + f" The kernel still cannot start: {explained}"
            return text + " The kernel could not run before; a new kernel is running now (variables were lost)."

    async def explain_start_failure(self, exc: KernelError) -> str | None:
        """Why a kernel could not start, when the package dir is the cause (None: it is not)."""
        diagnosis = await diagnose(self.settings, self.session.factory.runtime_root, self.session.factory.cgroups)
        if not diagnosis.broken_by_dir:
            return None
        return (
            f"the sandboxed kernel could not start because of the package dir: {diagnosis.describe()} "
            f"uninstall_package starts a new kernel once the package dir is repaired. (The start-up error was: "
            f"{last_error(str(exc))})"
        )

    async def _pip(
        self, spec: PackageSpec, work: Path, options: list[str], specs: list[str], writable: tuple[Path, ...]
    ) -> None:
        env = pip_env(self.settings, work, self.cache_dir)
        paths = kernel_paths(self.settings, work, self.session.factory.runtime_root)
        limits = self.settings.policy.limits
        sandboxed_bwrap = self.settings.sandbox and platform_backend(self.settings) == "bwrap"
        # Writable: the cache and (for the install step) staging. The working directory is pip's
        # private dir, which no kernel can write: nothing of the workspace is ever on sys.path.
        launch_options = bwrap.LaunchOptions(
            network=not sandboxed_bwrap,  # bwrap: its own netns, the index reached only via the proxy
            extra_writable=tuple(str(p) for p in (self.cache_dir, *writable)),
            chdir=str(work),
        )
        # -P (and PYTHONSAFEPATH for every Python pip starts): no cwd or script dir on sys.path,
        # so a planted ./pip/ can never run in pip's place. "--" ends pip's options: a validated
        # spec can never be read as one.
        argv = [sys.executable, "-P", "-m", "pip", "install", "--quiet", *options, "--", *specs]
        # The seccomp step (kernel_boot --exec) keeps build code from the keyring and from creating
        # unix sockets; the proxy's forwarder starts before it (it is the one unix client).
        if self.settings.sandbox:
            argv = sandboxed_exec(argv)
        # One budget for the whole install (both pip runs share ``work``), not one per run.
        if self._deadline is None or self._deadline[0] != work:
            self._deadline = (work, time.monotonic() + limits.install_seconds)
        timeout = max(0.0, self._deadline[1] - time.monotonic()) if limits.install_seconds else None
        refused: list[str] = []
        async with contextlib.AsyncExitStack() as stack:
            if sandboxed_bwrap:
                gate = await stack.enter_async_context(
                    IndexProxy.start(
                        work / PROXY_SOCKET, allowed_destinations(spec, os.environ), upstream_proxies(os.environ)
                    )
                )
                env.update(gate.proxy_env())
                argv = gate.forwarder_argv(argv)
                refused = gate.refused
            # Planning walks the workspace (for .env files): keep that off the event loop.
            launch = await asyncio.to_thread(build_launch, self.settings, paths, env, argv, options=launch_options)
            groups = self._groups()
            run_argv = groups.wrap(launch.argv) if groups is not None else launch.argv
            args_path = work.parent / f"{work.name}.args"
            run_argv = with_args_fd(run_argv, args_file(launch, args_path))
            try:
                code, output = await _run(run_argv, launch.env, work, timeout, groups)
            except _TimedOut as exc:
                raise PackageInstallError(
                    f"pip did not finish within limits.installSeconds={limits.install_seconds}s and was "
                    f"stopped, with everything it started:\n{exc.tail}"
                ) from None
            finally:
                args_path.unlink(missing_ok=True)
                if groups is not None:
                    await asyncio.to_thread(groups.remove)
        if code != 0:
            where = "" if launch.backend == "none" else f" (in the {launch.backend} sandbox)"
            note = ""
            if refused:
                shown = ", ".join(sorted(set(refused))[:5])
                note = (
                    f"\npip's network reaches only the package index it is configured with; refused: {shown}. "
                    "Configure another index with PIP_INDEX_URL / PIP_EXTRA_INDEX_URL or pip.conf."
                )
            raise PackageInstallError(
                f"pip could not install {spec.text!r}{where}, exit code {code}:\n{trim_output(output)}{note}"
            )

    def _groups(self) -> KernelGroups | None:
        """A cgroup with the kernel's limits for one pip run ("k" prefix: cleaned up like a kernel's)."""
        cgroups = self.session.factory.cgroups
        if cgroups is None:
            return None
        try:
            return cgroups.for_kernel(f"kpip-{secrets.token_hex(4)}")
        except OSError as exc:  # the hierarchy worked at start-up: refuse rather than run unlimited
            raise PackageInstallError(f"could not set up the cgroup limits for pip: {exc}") from None

    async def _refresh_kernel(self) -> None:
        """Make the running kernel see new files now. Call with ``session.lock`` held."""
        try:
            kernel = self.session.kernel
        except KernelError:
            return  # no kernel: the next one starts with the directory on sys.path
        if not await kernel.km.is_alive():
            return
        path = str(self.settings.packages_dir)
        # Silent and without history: no execution count, no output, no names left behind.
        code = (
            f"__import__('sys').path_importer_cache.pop({path!r}, None); "
            f"{path!r} in __import__('sys').path or __import__('sys').path.insert(0, {path!r}); "
            "__import__('importlib').invalidate_caches()"
        )
        kc = kernel.kc
        msg_id = kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        deadline = time.monotonic() + REFRESH_TIMEOUT
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                reply = await kc.get_shell_msg(timeout=remaining)
            except Exception:  # queue.Empty
                break
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return
        log.warning("the kernel did not confirm the import-cache refresh within %.0fs", REFRESH_TIMEOUT)


class _TimedOut(Exception):
    def __init__(self, tail: str) -> None:
        super().__init__("timed out")
        self.tail = tail


async def _run(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float | None, groups: KernelGroups | None = None
) -> tuple[int, str]:
    """Run argv (no shell) in its own process group; keep the output's tail; kill on timeout/cancel."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        cwd=str(cwd),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    buf = bytearray()
    try:
        await asyncio.wait_for(drain_tail(proc, buf, OUTPUT_KEEP), timeout)
    except TimeoutError:
        await _kill(proc.pid, groups)
        await proc.wait()
        raise _TimedOut(trim_output(buf.decode(errors="replace"))) from None
    finally:
        if proc.returncode is None:  # cancelled
            with contextlib.suppress(BaseException):
                await asyncio.shield(_kill(proc.pid, groups))
            with contextlib.suppress(BaseException):
                await asyncio.shield(proc.wait())
    assert proc.returncode is not None
    return proc.returncode, buf.decode(errors="replace")


async def _kill(pid: int, groups: KernelGroups | None) -> None:
    # bwrap's pid namespace takes every sandboxed process with it; unsandboxed, the group does;
    # the cgroup catches anything that left both (a daemonised build step).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if groups is not None:
        await asyncio.to_thread(groups.remove)


def trim_output(output: str, limit: int = ERROR_CHARS) -> str:
    """The part of pip's output that explains a failure: without warnings if errors exist, the tail."""
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    if any(ln.startswith("ERROR") or "error" in ln.lower() for ln in lines):
        lines = [ln for ln in lines if not ln.startswith("WARNING:")] or lines
    text = "\n".join(lines)
    if len(text) > limit:
        text = f"[... {len(text) - limit} characters of pip output trimmed ...]\n" + text[-limit:]
    return text or "(pip printed nothing)"


def _report_items(report: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(read_private_file(report, REPORT_MAX_BYTES))
        items = data["install"]
        assert isinstance(items, list)
    except (OSError, ValueError, KeyError, AssertionError) as exc:
        raise PackageInstallError(f"pip's installation report could not be read: {exc}") from None
    # Requested first, then dependencies, each in pip's order.
    return sorted(items, key=lambda it: not it.get("requested", False))


def read_private_file(path: Path, limit: int) -> bytes:
    """A file sandboxed code could have replaced: never through a link, never a FIFO or device.

    O_NOFOLLOW refuses a symlink (no redirect to a host file); O_NONBLOCK makes opening a
    FIFO return at once instead of waiting for a writer that never comes.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{path.name} is larger than {limit} bytes")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise ValueError(f"{path.name} is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


def _pin(item: dict[str, Any]) -> str:
    """Exactly the distribution the resolver chose, as a spec for a --no-deps install."""
    meta = item["metadata"]
    name, version = meta["name"], meta["version"]
    if not item.get("is_direct"):
        return f"{name}=={version}"
    info = item["download_info"]
    url = info["url"]
    if "vcs_info" in info:
        vcs = info["vcs_info"]
        url = f"{vcs['vcs']}+{url}@{vcs.get('commit_id') or vcs.get('requested_revision', '')}".rstrip("@")
    if info.get("subdirectory"):
        url += f"#subdirectory={info['subdirectory']}"
    return f"{name} @ {url}"


def _under(path: str, root: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base + os.sep)


def _refuse_runtime_items(spec: PackageSpec, items: list[dict[str, Any]], packages_dir: Path) -> None:
    """A runtime distribution in pip's plan means the constraints did not hold: refuse, never install it."""
    runtime = runtime_dists()
    clash = [
        f"{it['metadata']['name']} {it['metadata']['version']} (the kernel runs on {runtime[n].why()})"
        for it in items
        if (n := canonicalize_name(it["metadata"]["name"])) in runtime
    ]
    if clash:
        # pip installs one only when the copy it sees first differs: an older install in the package dir.
        stale = [d.name for d in list_installed(packages_dir)[0] if canonicalize_name(d.name) in runtime]
        hint = ""
        if stale:
            hint = f" The package dir holds its own copy of {', '.join(stale)}: remove it with uninstall_package."
        raise PackageInstallError(
            f"install_package refused {spec.text!r}: pip chose {', '.join(clash)}, part of ipyfence's kernel "
            f"runtime, which installed packages may not replace. Nothing was installed.{hint}"
        )


def _already_satisfied(spec: PackageSpec, packages_dir: Path) -> str:
    where = ""
    if spec.name:
        for label, path in (("the kernel's packages", [str(packages_dir)]), ("the server's environment", sys.path)):
            dists = list(importlib.metadata.distributions(name=spec.name, path=path))
            if dists:
                where = f": {dists[0].metadata['Name']} {dists[0].version} from {label}"
                break
    return f"Nothing to install, {spec.text!r} is already satisfied{where}. It can be imported in the kernel."


def _success_message(items: list[dict[str, Any]], replaced: list[Replaced]) -> str:
    names = [f"{it['metadata']['name']} {it['metadata']['version']}" for it in items]
    requested = [n for n, it in zip(names, items, strict=True) if it.get("requested")]
    deps = [n for n, it in zip(names, items, strict=True) if not it.get("requested")]
    text = f"Installed {', '.join(requested or names)}"
    if deps and requested:
        text += f" (with dependencies: {', '.join(deps)})"
    text += ". It can be imported in the kernel now, and stays installed across reset() and restarts."
    if replaced:
        old = ", ".join(f"{r.name} {r.old_version}" for r in replaced)
        text += f" Replaced {old}: modules already imported keep the old code until reset()."
    return text
