"""Host-side MCP client sessions: one long-lived connection per registered server.

A ``Client`` context must be entered and left in the same task, so each connection runs in its
own task that holds the context open until closed. Calls from other tasks share the session
(JSON-RPC multiplexes them). A server that died is reconnected on the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO, cast

from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, CallToolResult, Tool

from ipyfence.errors import BridgeError
from ipyfence.mcptools.params import HttpParams, ServerParams, StdioParams

log = logging.getLogger(__name__)

STDERR_TAIL = 1500  # characters of a failed server's stderr shown in the error


class ConnectError(Exception):
    """Connecting to a server failed; the message says why. ``stderr`` is the server's stderr tail:
    shown to the agent on register, never sent to the kernel (it may hold secrets)."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr

    def with_stderr(self) -> str:
        return f"{self}\nserver stderr:\n{self.stderr}" if self.stderr else str(self)


def _dispatcher_closed(client: Client) -> bool:
    """Whether the session's transport already hit EOF (the server process exited)."""
    dispatcher = getattr(client.session, "_dispatcher", None)
    return bool(getattr(dispatcher, "_closed", False))


class ServerConnection:
    def __init__(self, name: str, params: ServerParams, cwd: Path, connect_timeout: float) -> None:
        self.name = name
        self.params = params
        self.cwd = cwd
        self.connect_timeout = connect_timeout
        self._client: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()
        self._errlog: TextIO | None = None
        self.starts = 0  # how many times a connection was made (for tests and logs)

    # -- connection lifecycle -------------------------------------------------------------

    @asynccontextmanager
    async def _transport_client(self) -> AsyncIterator[Client]:
        params = self.params
        if isinstance(params, StdioParams):
            stdio = StdioServerParameters(
                command=params.command, args=list(params.args), env=dict(params.env), cwd=self.cwd
            )
            assert self._errlog is not None
            async with Client(stdio_client(stdio, errlog=self._errlog)) as client:
                yield client
            return
        async with self._http_client(params) as client:
            yield client

    @asynccontextmanager
    async def _http_client(self, params: HttpParams) -> AsyncIterator[Client]:
        async with contextlib.AsyncExitStack() as stack:
            yield await self._enter_http(stack, params)

    async def _enter_http(self, stack: contextlib.AsyncExitStack, params: HttpParams) -> Client:
        """Streamable HTTP; a server that rejects it outright is retried over the legacy SSE transport."""
        try:
            async with contextlib.AsyncExitStack() as attempt:
                http = await attempt.enter_async_context(create_mcp_http_client(headers=dict(params.headers)))
                client = await attempt.enter_async_context(Client(streamable_http_client(params.url, http_client=http)))
                stack.push_async_exit(attempt.pop_all())
                return client
        except Exception as first:
            log.info("streamable HTTP to %s failed (%s); trying SSE", self.name, _describe(first))
            try:
                return await stack.enter_async_context(Client(sse_client(params.url, headers=dict(params.headers))))
            except Exception:
                raise first from None

    async def _run(self, ready: asyncio.Future[Client]) -> None:
        try:
            async with self._transport_client() as client:
                if not ready.done():
                    ready.set_result(client)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else ConnectError("cancelled"))
            if not isinstance(exc, Exception):
                raise
            log.info("connection to MCP server %s ended: %s", self.name, exc)
        finally:
            self._client = None

    def _stderr_tail(self) -> str:
        if self._errlog is None:
            return ""
        try:
            self._errlog.flush()
            self._errlog.seek(0)
            text = self._errlog.read()
        except (OSError, ValueError):
            return ""
        return text[-STDERR_TAIL:].strip()

    async def _connect(self) -> Client:
        await self._shutdown()
        if isinstance(self.params, StdioParams):
            self._errlog = cast(TextIO, tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))  # noqa: SIM115
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[Client] = loop.create_future()
        self._task = asyncio.create_task(self._run(ready), name=f"mcp-server-{self.name}")
        self.starts += 1
        try:
            client = await asyncio.wait_for(asyncio.shield(ready), self.connect_timeout)
        except TimeoutError:
            await self._shutdown()
            raise ConnectError(
                f"the server did not complete the MCP handshake within {self.connect_timeout:g}s",
                self._stderr_tail(),
            ) from None
        except Exception as exc:
            # The server is gone; give its process a moment to flush stderr before reading it.
            await self._shutdown()
            raise ConnectError(_describe(exc), self._stderr_tail()) from None
        self._client = client
        return client

    def _with_stderr(self) -> str:
        tail = self._stderr_tail()
        return f"\nserver stderr:\n{tail}" if tail else ""

    async def _shutdown(self) -> None:
        task, self._task = self._task, None
        connected, self._client = self._client is not None, None
        if task is not None and not task.done() and not connected:
            task.cancel()  # still in the handshake: nothing to close politely
            with contextlib.suppress(BaseException):
                await task
        elif task is not None and not task.done():
            self._stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), 10)
            except (TimeoutError, Exception):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def client(self) -> Client:
        """The live session, (re)connecting when there is none or the server has exited."""
        async with self._lock:
            client = self._client
            if client is None or _dispatcher_closed(client) or self._task is None or self._task.done():
                client = await self._connect()
            return client

    # -- operations ----------------------------------------------------------------------

    async def list_tools(self) -> list[Tool]:
        client = await self.client()
        tools: list[Tool] = []
        cursor: str | None = None
        for _ in range(100):  # a paginator that never ends cannot hang registration
            page = await asyncio.wait_for(client.list_tools(cursor=cursor), self.connect_timeout)
            tools += page.tools
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools

    async def call_tool(self, tool: str, arguments: dict[str, Any]) -> CallToolResult:
        try:
            client = await self.client()
        except ConnectError as exc:
            raise BridgeError(f"cannot connect to MCP server {self.name!r}: {exc}") from None
        try:
            return await client.call_tool(tool, arguments)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                # The stderr tail goes to ipyfence's log, never to the kernel: it may hold secrets.
                log.warning("MCP server %s closed the connection.%s", self.name, self._with_stderr())
                raise BridgeError(
                    f"MCP server {self.name!r} closed the connection during the call (it crashed or exited); "
                    "it will be restarted on the next call"
                ) from None
            raise BridgeError(f"MCP server {self.name!r} rejected the call: {exc}") from None

    async def aclose(self) -> None:
        async with self._lock:
            await self._shutdown()
            if self._errlog is not None:
                with contextlib.suppress(OSError):
                    self._errlog.close()
                self._errlog = None


def _describe(exc: BaseException) -> str:
    """A readable message for a connection failure (task groups wrap the real cause)."""
    inner = getattr(exc, "exceptions", None)  # an ExceptionGroup
    while isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    if isinstance(exc, FileNotFoundError):
        return f"command not found: {exc.filename or exc}"
    if isinstance(exc, PermissionError):
        return f"command is not executable: {exc.filename or exc}"
    if isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED:
        return "the server closed the connection before completing the MCP handshake (did it exit?)"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
