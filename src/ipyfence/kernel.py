"""KernelSession: the server's one sandboxed IPython kernel (plus a warm standby) behind a lock."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Awaitable
from typing import Any

from ipyfence import limitnotes, nsmask
from ipyfence.errors import KernelError, SandboxError
from ipyfence.execution import Execution, ExecutionResult, ProgressFn, integrity_problem
from ipyfence.launcher import START_TIMEOUT, KernelFactory, KernelHook, RunningKernel, StopHook
from ipyfence.sandbox import integrity
from ipyfence.sandbox.cgroups import Events
from ipyfence.sandbox.launch import kernel_paths
from ipyfence.sandbox.plan import plan_mounts
from ipyfence.settings import Settings

__all__ = ["ExecutionResult", "KernelSession", "ProgressFn"]

log = logging.getLogger(__name__)

WATCH_INTERVAL = 0.25  # seconds between checks that the host has not detached a mask


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
        self._pending_masked: str | None = None  # what the watchdog masked live, told on the next call

    def take_tripped(self) -> str | None:
        """Why the watchdog stopped the kernel since the last call (told once), if it did."""
        tripped, self._tripped = self._tripped, None
        return tripped

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
                stale = await asyncio.to_thread(self._plan_is_stale, kernel)
                if not stale and await kernel.km.is_alive() and integrity_problem(kernel) is None:
                    return kernel
                if stale:
                    log.info("the workspace changed since the standby kernel was planned; starting a fresh one")
                await self.factory.stop(kernel)
            except Exception as exc:  # a failed standby must not block a reset
                log.warning("standby kernel failed, starting a fresh one: %s", exc)
        return await self.factory.start()

    def _plan_is_stale(self, kernel: RunningKernel) -> bool:
        """Would the standby be planned differently now (a .env, a socket, a repo appeared since)?

        The standby was planned when it started, maybe long ago: its masks are those of that
        moment. Planning again costs one workspace walk, off the event loop.
        """
        planned = kernel.launch.plan
        if planned is None:
            return False  # unsandboxed: nothing is masked anyway
        paths = kernel_paths(self.settings, kernel.kernel_dir, self.factory.runtime_root)
        try:
            return plan_mounts(self.settings.policy, paths) != planned
        except SandboxError:
            return True  # a fresh start reports the error itself

    async def replace_kernel(self) -> None:
        """Swap in a new kernel; the old one is killed in the background."""
        old = self._kernel
        self._kernel = None
        self._kernel = await self._next_kernel()
        if old is not None:
            self._spawn(self.factory.stop(old))
        self._start_standby()
        self._start_watchdog()  # not yet running when the first kernel failed to start

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
            return await Execution(self, code, timeout, max_output_chars, progress, notes).run()

    async def _ensure_sound_kernel(self) -> list[str]:
        """Replace a dead kernel, or one whose masks no longer hold; say so if state was lost."""
        notes: list[str] = []
        tripped = self.take_tripped()
        if tripped is not None:
            notes.append(tripped)
        if self._pending_masked is not None:
            notes.append(self._pending_masked)
            self._pending_masked = None
        kernel = self._kernel
        if kernel is not None:
            masked = await self._mask_live(kernel)
            if masked:
                notes.append(masked)
        problem = integrity_problem(kernel) if kernel is not None else None
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

    async def _mask_live(self, kernel: RunningKernel) -> str | None:
        """Mask, inside the running sandbox, .env files that appeared at the workspace root and masked
        files a host rename replaced; the kernel keeps its state. Whatever cannot be masked this way is
        left for ``integrity_problem``, which then replaces the kernel (fail closed)."""
        snap = kernel.snapshot
        plan = kernel.launch.plan
        process = getattr(kernel.km.provisioner, "process", None)
        if snap is None or plan is None or process is None or kernel.launch.backend != "bwrap":
            return None
        new = kernel.unmasked_env_files()
        replaced = [p for p in integrity.replaced_paths(snap) if p in plan.masked_files]
        if not new and not replaced:
            return None
        # Something changed: a fresh scan also finds secret files created deeper since the launch.
        paths = kernel_paths(self.settings, kernel.kernel_dir, self.factory.runtime_root)
        try:
            fresh = await asyncio.to_thread(plan_mounts, self.settings.policy, paths)
        except Exception as exc:  # the scan no longer finishes: replace the kernel, whose start says why
            log.warning("cannot re-scan the workspace: %s", exc)
            return None
        deeper = [p for p in fresh.masked_files if p not in plan.masked_files and p not in new]
        done = await nsmask.mask_files(process.pid, [*new, *replaced, *deeper])
        if not done:
            return None
        inodes = [entry for entry in snap.inodes if entry[0] not in done]
        for path in sorted(done):
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                inodes.append((path, st.st_dev, st.st_ino))
        names = snap.root_env_names | {os.path.basename(p) for p in done if os.path.dirname(p) == snap.workspace}
        kernel.snapshot = dataclasses.replace(snap, inodes=tuple(inodes), root_env_names=frozenset(names))
        log.info("masked in the running kernel: %s", ", ".join(sorted(done)))
        return (
            f"[ipyfence: {', '.join(sorted(done))} appeared or changed on the host and was masked in the running "
            "kernel. Variables are kept.]"
        )

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch_masks())

    async def _watch_masks(self) -> None:
        """Mask new or replaced secret files the moment the host makes them; stop the kernel when that
        is not possible (a protected path was replaced: a mount cannot be rebuilt from outside).

        Between calls a background thread in the kernel could otherwise read the unmasked file.
        """
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            kernel = self._kernel
            if kernel is None or self.lock.locked():
                continue  # a call holds the lock: it checks and repairs before and after its cell
            if kernel.snapshot is not None and (kernel.unmasked_env_files() or kernel.masks_broken()):
                async with self.lock:
                    if self._kernel is kernel:
                        self._pending_masked = await self._mask_live(kernel) or self._pending_masked
            why = kernel.masks_broken() if self._kernel is kernel else None
            if why is None:
                continue
            log.warning("stopping the kernel: %s", why)
            self._tripped = f"[ipyfence: the kernel was stopped because {why}. Variables were lost.]"
            self._kernel = None
            self._spawn(self.factory.stop(kernel))
