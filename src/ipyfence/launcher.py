"""Launch sandboxed kernels: the sandbox argv prepended to the kernel command, as a kernel spec.

Channels use the ``ipc`` ZMQ transport, so the sockets are files in the kernel's private
directory and work across the unshared network namespace. Interrupts are sent as messages:
a signal to bwrap would not reach the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.kernelspec import KernelSpec
from jupyter_client.manager import AsyncKernelManager

from ipyfence import gitexclude
from ipyfence.errors import KernelError, KernelStartError
from ipyfence.runtime import PLACEHOLDERS_FILE, make_runtime_root, remove_placeholders
from ipyfence.sandbox import integrity
from ipyfence.sandbox.bwrap import LaunchOptions
from ipyfence.sandbox.cgroups import Cgroups, Events, KernelGroups
from ipyfence.sandbox.launch import Launch, args_file, base_env, build_launch, kernel_argv, kernel_paths, parent_guard
from ipyfence.sandbox.plan import MountPlan
from ipyfence.settings import Settings

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0  # seconds for a kernel to answer its first kernel_info
KERNEL_OPTIONS = LaunchOptions(die_with_stdin=True)

# Called with (kernel_dir, token) once a kernel process is launched, before it is used (its bridge socket).
KernelHook = Callable[[Path, str], Awaitable[None]]
# Called with kernel_dir after a kernel is gone, e.g. to close its bridge socket.
StopHook = Callable[[Path], Awaitable[None]]


class _SandboxedKernelManager(AsyncKernelManager):  # type: ignore[misc]
    """A kernel manager whose command line is exactly the argv it is given."""

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        assert self.kernel_spec is not None
        return list(self.kernel_spec.argv)  # no {template} substitution inside user values


@dataclass
class RunningKernel:
    km: AsyncKernelManager
    kc: AsyncKernelClient
    kernel_dir: Path
    token: str
    launch: Launch
    log_path: Path
    snapshot: integrity.Snapshot | None
    groups: KernelGroups | None = None  # its cgroups, when the host lets us make them
    lifeline: int | None = None  # write end of the kernel's stdin pipe; closing it kills the sandbox
    started_at: float = field(default_factory=time.monotonic)
    last_events: Events | None = None  # counters read after the previous cell (saves a read per cell)

    def events(self) -> Events:
        return self.groups.events() if self.groups is not None else Events()

    def masks_broken(self) -> str | None:
        """Why this kernel's masks no longer hold (a host rename detached them), if they don't."""
        if self.snapshot is None:
            return None
        replaced = integrity.replaced_paths(self.snapshot)
        if replaced:
            return f"{', '.join(replaced)} was replaced on the host, which detached its sandbox mask"
        return None

    def unmasked_env_files(self) -> list[str]:
        return integrity.new_env_files(self.snapshot) if self.snapshot else []

    def startup_log(self, limit: int = 2000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-limit:].strip()


class KernelFactory:
    """Starts kernels in fresh private directories under one runtime root."""

    def __init__(self, settings: Settings, on_start: KernelHook | None = None, on_stop: StopHook | None = None) -> None:
        self.settings = settings
        self.on_start = on_start
        self.on_stop = on_stop
        self.runtime_root = make_runtime_root()  # 0700, in a verified private parent
        # Must exist before the first kernel starts: it is bind-mounted (read-only) into every
        # sandbox, and later installs show up through that mount without a restart.
        settings.packages_dir.mkdir(parents=True, exist_ok=True)
        # Limits rlimits cannot enforce (pids as root, memory of a process tree). Unsandboxed
        # kernels get no limits at all, consistently with --no-sandbox meaning "none of it".
        self.cgroups = Cgroups(settings.policy.limits) if settings.sandbox else None
        self._counter = itertools.count(1)
        self.spawned = asyncio.Event()  # set once the first kernel process has been launched
        self._placeholders: list[str] = []  # protected paths bwrap created as empty mount points
        self._excluded: list[str] = []  # placeholder files named in the repo's .git/info/exclude

    def _remember_placeholders(self, plan: MountPlan) -> None:
        new = [p for p in (*plan.absent_files, *plan.absent_dirs) if p not in self._placeholders]
        if new:
            self._placeholders += new
            (self.runtime_root / PLACEHOLDERS_FILE).write_text("\n".join(self._placeholders))
        files = [p for p in plan.absent_files if p not in self._excluded]
        if files:  # keep placeholder files out of `git status` / `git add -A` while we run
            self._excluded += files
            gitexclude.exclude(self.settings.workspace, self._excluded)

    async def start(self) -> RunningKernel:
        n = next(self._counter)
        kernel_dir = self.runtime_root / f"k{n}"
        for sub in ("", "home", "ipython", "mpl", "jupyter"):
            (kernel_dir / sub).mkdir(mode=0o700, exist_ok=True)
        token = secrets.token_hex(16)
        connection_file = kernel_dir / "kernel.json"
        env = base_env(self.settings, kernel_dir, token)
        paths = kernel_paths(self.settings, kernel_dir, self.runtime_root)
        # Planning walks the workspace (for .env files): keep that off the event loop.
        launch = await asyncio.to_thread(
            build_launch, self.settings, paths, env, kernel_argv(connection_file), options=KERNEL_OPTIONS
        )
        snap = integrity.snapshot(launch.plan, self.settings.workspace) if launch.plan else None
        if launch.plan is not None:
            self._remember_placeholders(launch.plan)
        log_path = self.runtime_root / f"k{n}.log"
        groups = self._groups(f"k{n}")
        argv = groups.wrap(launch.argv) if groups is not None else launch.argv
        if self.settings.sandbox:
            argv = parent_guard(argv, os.getpid(), args_file(launch, self.runtime_root / f"k{n}.args"))
        km = _SandboxedKernelManager(
            transport="ipc",
            ip=str(kernel_dir / "zmq"),
            connection_file=str(connection_file),
            cache_ports=False,
        )
        km._kernel_spec = KernelSpec(
            argv=argv, display_name="ipyfence", language="python", interrupt_mode="message", env={}
        )
        # Under bwrap the kernel's stdin is a pipe only we can write (see bwrap.STDIN_WATCH): it
        # closes when we die, however we die, and the sandbox's watcher then kills everything.
        lifeline_in, lifeline = os.pipe() if launch.backend == "bwrap" else (subprocess.DEVNULL, None)
        with open(log_path, "ab") as log_file:
            try:
                await km.start_kernel(
                    env=launch.env,
                    cwd=str(kernel_dir),  # never the workspace: see kernel_boot
                    stdin=lifeline_in,
                    stdout=log_file,
                    stderr=log_file,
                )
            except OSError as exc:
                if lifeline is not None:
                    os.close(lifeline)
                if groups is not None:
                    await asyncio.to_thread(groups.remove)
                raise KernelError(f"could not start the kernel ({launch.backend}): {exc}") from None
            finally:
                if lifeline is not None:
                    os.close(lifeline_in)
        self.spawned.set()
        kc = km.client()
        kc.start_channels()
        kernel = RunningKernel(km, kc, kernel_dir, token, launch, log_path, snap, groups, lifeline)
        if self.on_start is not None:
            # After the launch, so slow set-up here (the bridge; on the first kernel, importing
            # the MCP SDK) overlaps with the kernel's own start-up. No cell runs before it ends.
            try:
                await self.on_start(kernel_dir, token)
            except BaseException:
                await self.stop(kernel)
                raise
        await self._wait_ready(kernel)
        (self.runtime_root / f"k{n}.args").unlink(missing_ok=True)  # bwrap read it at start
        return kernel

    def _groups(self, name: str) -> KernelGroups | None:
        if self.cgroups is None:
            return None
        try:
            return self.cgroups.for_kernel(name)
        except OSError as exc:  # the hierarchy worked at start-up: refuse rather than run unlimited
            raise KernelError(f"could not set up the kernel's cgroup limits: {exc}") from None

    async def _wait_ready(self, kernel: RunningKernel) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if not await kernel.km.is_alive():
                detail = kernel.startup_log()
                await self.stop(kernel)
                raise KernelStartError(
                    f"the kernel exited during start-up ({kernel.launch.backend} sandbox)."
                    + (f"\n{detail}" if detail else "")
                    + "\nRun `ipyfence doctor` to check the sandbox prerequisites."
                )
            try:
                await kernel.kc.wait_for_ready(timeout=min(1.0, max(0.05, deadline - time.monotonic())))
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    await self.stop(kernel)
                    raise KernelStartError(f"the kernel did not become ready within {START_TIMEOUT:.0f}s") from None

    async def stop(self, kernel: RunningKernel) -> None:
        """Kill the kernel's sandbox: with its pid namespace gone, every process it started is gone."""
        with contextlib.suppress(Exception):
            kernel.kc.stop_channels()
        with contextlib.suppress(Exception):
            await kernel.km.shutdown_kernel(now=True)
        with contextlib.suppress(Exception):
            await kernel.km.cleanup_resources()
        if kernel.lifeline is not None:  # the watcher inside kills whatever is left in the sandbox
            with contextlib.suppress(OSError):
                os.close(kernel.lifeline)
            kernel.lifeline = None
        if kernel.groups is not None:  # kills anything still in the kernel's groups
            await asyncio.to_thread(kernel.groups.remove)
        if self.on_stop is not None:
            with contextlib.suppress(Exception):
                await self.on_stop(kernel.kernel_dir)
        shutil.rmtree(kernel.kernel_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            kernel.log_path.unlink()
        with contextlib.suppress(OSError):
            kernel.kernel_dir.with_name(f"{kernel.kernel_dir.name}.args").unlink()

    def remove_runtime_root(self) -> None:
        if self.cgroups is not None:
            self.cgroups.close()
        remove_placeholders(self._placeholders, trusted=True)  # this server's own, in-memory list
        if self._excluded:
            gitexclude.restore(self.settings.workspace)
        shutil.rmtree(self.runtime_root, ignore_errors=True)
