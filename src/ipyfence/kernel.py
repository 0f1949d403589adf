"""KernelSession: one sandboxed IPython kernel (plus a warm standby) behind a lock.

Launch: the sandbox argv is prepended to the kernel command and handed to jupyter_client as
a kernel spec. Channels use the ``ipc`` ZMQ transport, so the sockets are files in the
kernel's private directory and work across the unshared network namespace. Interrupts are
sent as messages: a signal to bwrap would not reach the kernel.
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
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.kernelspec import KernelSpec
from jupyter_client.manager import AsyncKernelManager

from ipyfence import limitnotes
from ipyfence.errors import KernelError
from ipyfence.outputs import CellOutput
from ipyfence.sandbox import integrity
from ipyfence.sandbox.cgroups import Cgroups, Events, KernelGroups
from ipyfence.sandbox.launch import Launch, base_env, build_launch, kernel_argv, kernel_paths
from ipyfence.sandbox.plan import MountPlan
from ipyfence.settings import Settings

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0  # seconds for a kernel to answer its first kernel_info
INTERRUPT_GRACE = 3.0  # seconds an interrupted cell gets to stop before the kernel is replaced
POLL = 0.2  # seconds between liveness checks while waiting for output
WATCH_INTERVAL = 0.25  # seconds between checks that the host has not detached a mask

# (elapsed seconds, last output line) → awaitable; used for MCP progress notifications.
ProgressFn = Callable[[float, str], Awaitable[None]]
# Called with (kernel_dir, token) before a kernel starts, e.g. to open its bridge socket.
KernelHook = Callable[[Path, str], Awaitable[None]]
# Called with kernel_dir after a kernel is gone, e.g. to close its bridge socket.
StopHook = Callable[[Path], Awaitable[None]]


RUNTIME_PREFIX = "ipyfence-"
OWNER_FILE = "server.pid"
PLACEHOLDERS_FILE = "placeholders"


def remove_placeholders(paths: list[str]) -> None:
    """Remove the empty read-only placeholders bwrap created; anything with content stays."""
    for path in paths:
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)  # only succeeds when empty
            elif os.path.isfile(path) and os.path.getsize(path) == 0:
                os.unlink(path)


def remove_stale_runtime_dirs() -> None:
    """Delete runtime dirs left by servers that were killed (SIGKILL skips our cleanup)."""
    for owner in Path(tempfile.gettempdir()).glob(f"{RUNTIME_PREFIX}*/{OWNER_FILE}"):
        try:
            pid = int(owner.read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                remove_placeholders((owner.parent / PLACEHOLDERS_FILE).read_text().splitlines())
            shutil.rmtree(owner.parent, ignore_errors=True)
        except (OSError, ValueError):
            continue


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
    started_at: float = field(default_factory=time.monotonic)

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


@dataclass
class ExecutionResult:
    output: CellOutput
    error: bool  # the cell raised, timed out, or the kernel died
    state_lost: bool = False  # the kernel was replaced; variables are gone


class KernelFactory:
    """Starts kernels in fresh private directories under one runtime root."""

    def __init__(self, settings: Settings, on_start: KernelHook | None = None, on_stop: StopHook | None = None) -> None:
        self.settings = settings
        self.on_start = on_start
        self.on_stop = on_stop
        remove_stale_runtime_dirs()
        self.runtime_root = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX))  # 0700 by mkdtemp
        (self.runtime_root / OWNER_FILE).write_text(str(os.getpid()))
        # Must exist before the first kernel starts: it is bind-mounted (read-only) into every
        # sandbox, and later installs show up through that mount without a restart.
        settings.packages_dir.mkdir(parents=True, exist_ok=True)
        # Limits rlimits cannot enforce (pids as root, memory of a process tree). Unsandboxed
        # kernels get no limits at all, consistently with --no-sandbox meaning "none of it".
        self.cgroups = Cgroups(settings.policy.limits) if settings.sandbox else None
        self._counter = itertools.count(1)
        self._placeholders: list[str] = []  # protected paths bwrap created as empty mount points

    def _remember_placeholders(self, plan: MountPlan) -> None:
        new = [p for p in (*plan.absent_files, *plan.absent_dirs) if p not in self._placeholders]
        if new:
            self._placeholders += new
            (self.runtime_root / PLACEHOLDERS_FILE).write_text("\n".join(self._placeholders))

    async def start(self) -> RunningKernel:
        n = next(self._counter)
        kernel_dir = self.runtime_root / f"k{n}"
        for sub in ("", "home", "ipython", "mpl", "jupyter"):
            (kernel_dir / sub).mkdir(mode=0o700, exist_ok=True)
        token = secrets.token_hex(16)
        if self.on_start is not None:
            await self.on_start(kernel_dir, token)
        connection_file = kernel_dir / "kernel.json"
        env = base_env(self.settings, kernel_dir, token)
        paths = kernel_paths(self.settings, kernel_dir, self.runtime_root)
        # Planning walks the workspace (for .env files): keep that off the event loop.
        launch = await asyncio.to_thread(build_launch, self.settings, paths, env, kernel_argv(connection_file))
        snap = integrity.snapshot(launch.plan, self.settings.workspace) if launch.plan else None
        if launch.plan is not None:
            self._remember_placeholders(launch.plan)
        log_path = self.runtime_root / f"k{n}.log"
        groups = self._groups(f"k{n}")
        argv = groups.wrap(launch.argv) if groups is not None else launch.argv
        km = _SandboxedKernelManager(
            transport="ipc",
            ip=str(kernel_dir / "zmq"),
            connection_file=str(connection_file),
            cache_ports=False,
        )
        km._kernel_spec = KernelSpec(
            argv=argv, display_name="ipyfence", language="python", interrupt_mode="message", env={}
        )
        with open(log_path, "ab") as log_file:
            try:
                await km.start_kernel(
                    env=launch.env,
                    cwd=str(self.settings.workspace),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=log_file,
                )
            except OSError as exc:
                if groups is not None:
                    await asyncio.to_thread(groups.remove)
                raise KernelError(f"could not start the kernel ({launch.backend}): {exc}") from None
        kc = km.client()
        kc.start_channels()
        kernel = RunningKernel(km, kc, kernel_dir, token, launch, log_path, snap, groups)
        await self._wait_ready(kernel)
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
                raise KernelError(
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
                    raise KernelError(f"the kernel did not become ready within {START_TIMEOUT:.0f}s") from None

    async def stop(self, kernel: RunningKernel) -> None:
        """Kill the kernel's sandbox: with its pid namespace gone, every process it started is gone."""
        with contextlib.suppress(Exception):
            kernel.kc.stop_channels()
        with contextlib.suppress(Exception):
            await kernel.km.shutdown_kernel(now=True)
        with contextlib.suppress(Exception):
            await kernel.km.cleanup_resources()
        if kernel.groups is not None:  # kills anything still in the kernel's groups
            await asyncio.to_thread(kernel.groups.remove)
        if self.on_stop is not None:
            with contextlib.suppress(Exception):
                await self.on_stop(kernel.kernel_dir)
        shutil.rmtree(kernel.kernel_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            kernel.log_path.unlink()

    def remove_runtime_root(self) -> None:
        if self.cgroups is not None:
            self.cgroups.close()
        remove_placeholders(self._placeholders)
        shutil.rmtree(self.runtime_root, ignore_errors=True)


class KernelSession:
    """The server's one kernel. Calls are serialized; ``reset()`` swaps in a warm standby."""

    def __init__(self, settings: Settings, on_start: KernelHook | None = None, on_stop: StopHook | None = None) -> None:
        self.settings = settings
        self.factory = KernelFactory(settings, on_start, on_stop)
        self.lock = asyncio.Lock()
        self._kernel: RunningKernel | None = None
        self._standby: asyncio.Task[RunningKernel] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._tripped: str | None = None  # why the watchdog stopped the kernel, told on the next call

    @property
    def kernel(self) -> RunningKernel:
        if self._kernel is None:
            raise KernelError("the kernel is not running")
        return self._kernel

    async def start(self) -> None:
        self._kernel = await self.factory.start()
        self._start_standby()
        self._start_watchdog()

    def _start_standby(self) -> None:
        if self.settings.standby and self._standby is None:
            self._standby = asyncio.create_task(self.factory.start())

    async def _next_kernel(self) -> RunningKernel:
        """The standby if it is healthy, else a fresh kernel."""
        standby, self._standby = self._standby, None
        if standby is not None:
            try:
                kernel = await standby
                if await kernel.km.is_alive() and _integrity_problem(kernel) is None:
                    return kernel
                await self.factory.stop(kernel)
            except Exception as exc:  # a failed standby must not block a reset
                log.warning("standby kernel failed, starting a fresh one: %s", exc)
        return await self.factory.start()

    async def replace_kernel(self) -> None:
        """Swap in a new kernel; the old one is killed in the background."""
        old = self._kernel
        self._kernel = None
        self._kernel = await self._next_kernel()
        if old is not None:
            self._spawn(self.factory.stop(old))
        self._start_standby()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def reset(self) -> None:
        async with self.lock:
            await self.replace_kernel()

    async def shutdown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        standby, self._standby = self._standby, None
        if standby is not None:
            # Let a half-started standby finish, so it is stopped cleanly rather than orphaned.
            with contextlib.suppress(BaseException):
                await self.factory.stop(await asyncio.wait_for(standby, START_TIMEOUT))
        if self._kernel is not None:
            kernel, self._kernel = self._kernel, None
            await self.factory.stop(kernel)
        for task in list(self._background):
            with contextlib.suppress(BaseException):
                await task
        self.factory.remove_runtime_root()

    async def execute(
        self,
        code: str,
        *,
        timeout: float,
        max_output_chars: int,
        progress: ProgressFn | None = None,
    ) -> ExecutionResult:
        async with self.lock:
            notes = await self._ensure_sound_kernel()
            return await _Execution(self, code, timeout, max_output_chars, progress, notes).run()

    async def _ensure_sound_kernel(self) -> list[str]:
        """Replace a dead kernel, or one whose masks no longer hold; say so if state was lost."""
        notes: list[str] = []
        if self._tripped is not None:
            notes.append(self._tripped)
            self._tripped = None
        kernel = self._kernel
        problem = _integrity_problem(kernel) if kernel is not None else None
        if problem is not None:
            notes.append(f"[ipyfence: {problem}; the kernel was replaced before this cell. Variables were lost.]")
        alive = kernel is not None and await kernel.km.is_alive()
        if kernel is not None and problem is None and not alive:
            # Died between calls (a background thread, a limit): say so, or state vanishes silently.
            process = getattr(kernel.km.provisioner, "process", None)
            code = process.returncode if process is not None else None
            cause = limitnotes.death_cause(self.settings.policy.limits, code, Events(), kernel.events())
            notes.append(
                f"[ipyfence: the kernel died ({cause}) after the previous call. State lost: all variables and "
                "imports are gone; this cell runs in a new kernel.]"
            )
        if kernel is None or problem is not None or not alive:
            await self.replace_kernel()
        return notes

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch_masks())

    async def _watch_masks(self) -> None:
        """Kill the kernel the moment a host rename detaches one of its masks.

        Between calls a background thread in the kernel could otherwise read the unmasked file.
        """
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            kernel = self._kernel
            why = kernel.masks_broken() if kernel is not None else None
            if kernel is None or why is None or self._kernel is not kernel:
                continue
            log.warning("stopping the kernel: %s", why)
            self._tripped = f"[ipyfence: the kernel was stopped because {why}. Variables were lost.]"
            self._kernel = None
            self._spawn(self.factory.stop(kernel))


class _Execution:
    """One cell: send, collect iopub until idle, handle timeout and kernel death."""

    def __init__(
        self,
        session: KernelSession,
        code: str,
        timeout: float,
        limit: int,
        progress: ProgressFn | None,
        notes: list[str],
    ) -> None:
        self.session = session
        self.kernel = session.kernel
        self.code = code
        self.timeout = timeout
        self.out = CellOutput(limit)
        for note in notes:
            self.out.add_note(note)
        self.progress = progress
        self.msg_id = ""
        self.started = time.monotonic()
        self.last_progress = self.started
        self.limits = session.settings.policy.limits
        self.events_before = self.kernel.events()

    async def run(self) -> ExecutionResult:
        kc = self.kernel.kc
        self.msg_id = kc.execute(self.code, store_history=True, allow_stdin=False, stop_on_error=True)
        try:
            finished = await self._collect_until_idle(self.started + self.timeout)
        except asyncio.CancelledError:
            # The MCP call was cancelled: stop the cell (or the kernel) before giving up, still
            # holding the session lock. An anyio shield, not asyncio.shield: the SDK cancels through
            # an anyio scope, which re-cancels every await, and asyncio.shield would let the
            # interrupt run on unawaited while the next cell starts and its output is swallowed.
            with anyio.CancelScope(shield=True):
                await self._interrupt_or_replace("the request was cancelled")
            raise
        except _KernelDied as died:
            return await self._kernel_died(died)
        if not finished:
            return await self._timed_out()
        await self._read_reply()
        after = self.kernel.events()
        for note in limitnotes.cell_notes(
            self.limits, self.out.error_name, self.out.error_value, self.events_before, after
        ):
            self.out.add_note(note)
        return ExecutionResult(self.out, error=self.out.error_name is not None)

    async def _collect_until_idle(self, deadline: float) -> bool:
        """Read iopub for our request until the kernel reports idle. False on deadline.

        The idle status on iopub, not execute_reply on shell, marks the end: the two
        channels are not ordered relative to each other, so output can trail the reply.
        """
        kc = self.kernel.kc
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                msg = await kc.get_iopub_msg(timeout=min(POLL, remaining))
            except Exception:  # queue.Empty: no message within POLL
                if not await self.kernel.km.is_alive():
                    raise _KernelDied() from None
                await self._maybe_progress()
                continue
            if msg.get("parent_header", {}).get("msg_id") != self.msg_id:
                continue
            self.out.handle(msg)
            if self.out.status == "idle":
                return True

    async def _maybe_progress(self) -> None:
        now = time.monotonic()
        if self.progress is None or now - self.last_progress < 5.0:
            return
        self.last_progress = now
        tail = self.out.text.render().rstrip().splitlines()
        with contextlib.suppress(Exception):
            await self.progress(now - self.started, tail[-1] if tail else "")

    async def _read_reply(self) -> None:
        """Pick up our execute_reply (already sent before idle) for pager payloads."""
        kc = self.kernel.kc
        for _ in range(50):
            try:
                reply = await kc.get_shell_msg(timeout=0.1)
            except Exception:
                return
            if reply.get("parent_header", {}).get("msg_id") == self.msg_id:
                self.out.page(reply.get("content", {}).get("payload", []))
                return

    async def _timed_out(self) -> ExecutionResult:
        recovered = await self._interrupt_or_replace(f"timed out after {self.timeout:g}s")
        return ExecutionResult(self.out, error=True, state_lost=not recovered)

    async def _interrupt_or_replace(self, why: str) -> bool:
        """Interrupt the cell; if it does not stop within the grace period, replace the kernel."""
        with contextlib.suppress(Exception):
            await self.kernel.km.interrupt_kernel()
        try:
            stopped = await self._collect_until_idle(time.monotonic() + INTERRUPT_GRACE)
        except _KernelDied:
            stopped = False
        if stopped:
            self.out.add_note(f"[ipyfence: cell {why}; it was interrupted. Kernel state is kept.]")
            return True
        await self.session.replace_kernel()
        self.out.add_note(
            f"[ipyfence: cell {why} and did not respond to an interrupt within {INTERRUPT_GRACE:g}s; "
            "the kernel was restarted. All variables and imports are lost.]"
        )
        return False

    async def _kernel_died(self, died: _KernelDied) -> ExecutionResult:
        process = getattr(self.kernel.km.provisioner, "process", None)
        code = process.returncode if process is not None else None
        cause = limitnotes.death_cause(self.limits, code, self.events_before, self.kernel.events())
        await self.session.replace_kernel()
        if self.session._tripped is not None:  # the watchdog stopped it: say why, not just "died"
            self.out.add_note(self.session._tripped + " A new kernel is ready.")
            self.session._tripped = None
            return ExecutionResult(self.out, error=True, state_lost=True)
        self.out.add_note(limitnotes.death_note(cause))
        return ExecutionResult(self.out, error=True, state_lost=True)


def _integrity_problem(kernel: RunningKernel) -> str | None:
    broken = kernel.masks_broken()
    if broken is not None:
        return broken
    new_env = kernel.unmasked_env_files()
    if new_env:
        return f"new .env file(s) {', '.join(new_env)} appeared after the kernel started and were not masked in it"
    return None


class _KernelDied(Exception):
    pass
