"""App: the kernel session plus the services behind the tools, without any MCP import.

Kept free of the MCP SDK on purpose: the CLI starts the kernel first and imports the SDK
(most of a cold start) while the sandboxed kernel boots. The tool-calling and package
services are loaded lazily for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from ipyfence.kernel import KernelSession
from ipyfence.settings import Settings

if TYPE_CHECKING:
    from ipyfence.mcptools.service import McpToolsService
    from ipyfence.packages import PackageInstaller


class App:
    """Owns the kernel session and the services; the MCP tools are thin adapters over it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.session = KernelSession(settings, on_start=self._attach_kernel, on_stop=self._detach_kernel)
        self._tools: McpToolsService | None = None
        self._installer: PackageInstaller | None = None
        self._starting: asyncio.Task[None] | None = None
        self._stopped = False

    async def start(self) -> None:
        """Start the kernel in the background and return once its process is launched."""
        self._starting = asyncio.create_task(self.session.start())
        spawned = asyncio.ensure_future(self.session.factory.spawned.wait())
        await asyncio.wait({spawned, self._starting}, return_when=asyncio.FIRST_COMPLETED)
        spawned.cancel()

    async def ready(self) -> KernelSession:
        """The session once its first kernel is up; a failed start is raised (and retried next time)."""
        if self._starting is not None:
            starting = self._starting
            try:
                await starting
            finally:
                if starting.done():
                    self._starting = None
        return self.session

    async def tools(self) -> McpToolsService:
        if self._tools is None:
            from ipyfence.mcptools.service import McpToolsService

            tools = McpToolsService(self.settings)
            await tools.start()
            self._tools = tools
        return self._tools

    def installer(self) -> PackageInstaller:
        if self._installer is None:
            from ipyfence.packages import PackageInstaller

            self._installer = PackageInstaller(self.settings, self.session)
        return self._installer

    async def _attach_kernel(self, kernel_dir: Path, token: str) -> None:
        await (await self.tools()).attach_kernel(kernel_dir, token)

    async def _detach_kernel(self, kernel_dir: Path) -> None:
        if self._tools is not None:
            await self._tools.detach_kernel(kernel_dir)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._starting is not None:
            with contextlib.suppress(BaseException):
                await self._starting
        await self.session.shutdown()
        if self._tools is not None:
            await self._tools.aclose()
