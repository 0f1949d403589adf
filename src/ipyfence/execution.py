"""One cell: send it, collect iopub until idle, handle timeout, cancellation and kernel death."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from ipyfence import limitnotes, refusalnotes
from ipyfence.outputs import CellOutput

if TYPE_CHECKING:
    from ipyfence.kernel import KernelSession
    from ipyfence.launcher import RunningKernel

INTERRUPT_GRACE = 3.0  # seconds an interrupted cell gets to stop before the kernel is replaced
POLL = 0.2  # seconds between liveness checks while waiting for output

# (elapsed seconds, last output line) → awaitable; used for MCP progress notifications.
ProgressFn = Callable[[float, str], Awaitable[None]]


@dataclass
class ExecutionResult:
    output: CellOutput
    error: bool  # the cell raised, timed out, or the kernel died
    state_lost: bool = False  # the kernel was replaced; variables are gone


class Execution:
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
        self.events_before = self.kernel.last_events or self.kernel.events()

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
        after = self.kernel.last_events = self.kernel.events()
        for note in limitnotes.cell_notes(
            self.limits, self.out.error_name, self.out.error_value, self.events_before, after
        ):
            self.out.add_note(note)
        settings = self.session.settings
        explained = (
            refusalnotes.write_refusal(
                self.out.error_value, self.kernel.launch.plan, settings.policy, str(settings.workspace)
            ),
            refusalnotes.ipybox_leftover(self.out.error_name, self.out.error_value),
        )
        for explanation in explained:
            if explanation is not None:
                self.out.add_note(explanation)
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
        tripped = self.session.take_tripped()
        if tripped is not None:  # the watchdog stopped it: say why, not just "died"
            self.out.add_note(tripped + " A new kernel is ready.")
            return ExecutionResult(self.out, error=True, state_lost=True)
        self.out.add_note(limitnotes.death_note(cause))
        return ExecutionResult(self.out, error=True, state_lost=True)


def integrity_problem(kernel: RunningKernel) -> str | None:
    broken = kernel.masks_broken()
    if broken is not None:
        return broken
    new_env = kernel.unmasked_env_files()
    if new_env:
        return f"new .env file(s) {', '.join(new_env)} appeared after the kernel started and were not masked in it"
    return None


class _KernelDied(Exception):
    pass
