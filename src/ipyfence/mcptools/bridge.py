"""Host side of the kernel→host tool bridge: one unix socket per kernel, newline-delimited JSON.

The socket lives in the kernel's 0700 private directory and every request must carry that
kernel's token. A request is exactly ``{"token", "server", "tool", "arguments"}``: the bridge
never takes commands, URLs, environment or server parameters from the kernel — the dispatcher
only looks up servers the agent registered on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ipyfence.errors import BridgeError

log = logging.getLogger(__name__)

REQUEST_KEYS = frozenset({"token", "server", "tool", "arguments"})
MAX_LINE = 64 * 1024 * 1024  # one request line; tool arguments can be large

# (server name, tool name, arguments) → response dict (see McpToolsService.call).
Dispatch = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]


def refused(message: str) -> dict[str, Any]:
    return {"ok": False, "kind": "refused", "error": message}


def parse_request(line: bytes, token: str) -> tuple[str, str, dict[str, Any]] | dict[str, Any]:
    """(server, tool, arguments), or a refusal response."""
    try:
        req = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return refused("the bridge request is not valid JSON")
    if not isinstance(req, dict):
        return refused("the bridge request must be a JSON object")
    if not hmac.compare_digest(str(req.get("token", "")).encode(), token.encode()):
        return refused("the bridge request has a wrong or missing token")
    extra = sorted(set(req) - REQUEST_KEYS)
    if extra:
        return refused(
            f"the bridge accepts only a registered server name, a tool name and arguments; refused key(s) {extra}. "
            "Servers are registered by the agent with register_mcp_server, never from the kernel."
        )
    server, tool, arguments = req.get("server"), req.get("tool"), req.get("arguments", {})
    if not isinstance(server, str) or not isinstance(tool, str):
        return refused("the bridge request needs string 'server' and 'tool'")
    if not isinstance(arguments, dict):
        return refused("the bridge request's 'arguments' must be an object")
    return server, tool, arguments


class KernelBridge:
    """The listening socket of one kernel."""

    def __init__(self, path: Path, token: str, dispatch: Dispatch) -> None:
        self.path = path
        self.token = token
        self.dispatch = dispatch
        self.server: asyncio.AbstractServer | None = None
        self.handlers: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.server = await asyncio.start_unix_server(self._handle, path=str(self.path), limit=MAX_LINE)
        self.path.chmod(0o600)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.handlers.add(task)
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    writer.write(_encode(refused(f"the bridge request is larger than {MAX_LINE} bytes")))
                    return
                if not line:
                    return
                parsed = parse_request(line, self.token)
                if isinstance(parsed, dict):
                    writer.write(_encode(parsed))
                    await writer.drain()
                    if "token" in parsed["error"]:
                        return  # no second guess on the same connection
                    continue
                response = await self._dispatch(*parsed)
                writer.write(_encode(response))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if task is not None:
                self.handlers.discard(task)
            writer.close()

    async def _dispatch(self, server: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.dispatch(server, tool, arguments)
        except BridgeError as exc:
            return {"ok": False, "kind": "failed", "error": str(exc)}
        except Exception as exc:  # a bug must not kill the connection handler silently
            log.exception("bridge call %s.%s failed", server, tool)
            return {"ok": False, "kind": "failed", "error": f"internal bridge error: {type(exc).__name__}: {exc}"}

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.handlers):
            task.cancel()
        for task in list(self.handlers):
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(OSError):
            self.path.unlink()


def _encode(response: dict[str, Any]) -> bytes:
    return (json.dumps(response, separators=(",", ":")) + "\n").encode()


class Bridge:
    """All kernels' sockets, keyed by kernel directory."""

    def __init__(self, dispatch: Dispatch) -> None:
        self.dispatch = dispatch
        self.kernels: dict[Path, KernelBridge] = {}

    async def attach(self, socket_path: Path, token: str) -> None:
        kernel_dir = socket_path.parent
        await self.detach(kernel_dir)
        bridge = KernelBridge(socket_path, token, self.dispatch)
        await bridge.start()
        self.kernels[kernel_dir] = bridge

    async def detach(self, kernel_dir: Path) -> None:
        bridge = self.kernels.pop(kernel_dir, None)
        if bridge is not None:
            await bridge.close()

    async def aclose(self) -> None:
        for kernel_dir in list(self.kernels):
            await self.detach(kernel_dir)
