"""Host side of the kernel→host tool bridge: one unix socket per kernel (protocol in ``protocol.py``).

The socket lives in the kernel's private directory, which the kernel can write: it is bound in
a fresh host-only directory and renamed into place through directory fds, so no path the kernel
could swap for a symlink is ever followed. A connection must say hello with that kernel's token
before the host reads more than a small header, every request is capped, and so is the number
of connections. A request names only a registered server, a tool and arguments: the bridge
never takes commands, URLs, environment or server parameters from the kernel — the dispatcher
only looks up servers the agent registered on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ipyfence.errors import BridgeError
from ipyfence.mcptools import protocol
from ipyfence.mcptools.protocol import MAX_FRAME, MAX_HELLO, REQUEST_KEYS, encode, refused

log = logging.getLogger(__name__)

# The stream reader's own buffer: a frame is assembled from chunks of this size, so an
# unauthenticated peer makes the host hold at most about this much (twice, while paused).
READ_CHUNK = 64 * 1024

# (server name, tool name, arguments) → response dict (see McpToolsService.call).
Dispatch = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]


class FrameTooLarge(Exception):
    pass


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes | None:
    """One line of at most ``limit`` bytes (newline included); None at a clean end of stream.

    Raises FrameTooLarge as soon as more than ``limit`` bytes have arrived without a newline,
    having buffered no more than that (plus one reader chunk).
    """
    buf = bytearray()
    while True:
        try:
            buf += await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:  # end of stream
            if not buf and not exc.partial:
                return None
            raise ConnectionResetError("the connection closed in the middle of a line") from None
        except asyncio.LimitOverrunError as exc:
            buf += await reader.readexactly(exc.consumed)
            if len(buf) > limit:
                raise FrameTooLarge() from None
            continue
        if len(buf) > limit:
            raise FrameTooLarge()
        return bytes(buf)


def check_hello(line: bytes, token: str) -> bool:
    try:
        hello = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(hello, dict) or set(hello) != protocol.HELLO_KEYS or not isinstance(hello["token"], str):
        return False
    return hmac.compare_digest(hello["token"].encode(), token.encode())


def parse_request(line: bytes) -> tuple[Any, str, str, dict[str, Any]] | dict[str, Any]:
    """(id, server, tool, arguments), or a refusal response."""
    try:
        req = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return refused("the bridge request is not valid JSON")
    if not isinstance(req, dict):
        return refused("the bridge request must be a JSON object")
    request_id = req.get("id")
    if not isinstance(request_id, (int, str)) or isinstance(request_id, bool):
        request_id = None
    extra = sorted(set(req) - REQUEST_KEYS)
    if extra:
        return refused(
            f"the bridge accepts only a registered server name, a tool name and arguments; refused key(s) {extra}. "
            "Servers are registered by the agent with register_mcp_server, never from the kernel.",
            request_id,
        )
    server, tool, arguments = req.get("server"), req.get("tool"), req.get("arguments", {})
    if not isinstance(server, str) or not isinstance(tool, str):
        return refused("the bridge request needs string 'server' and 'tool'", request_id)
    if not isinstance(arguments, dict):
        return refused("the bridge request's 'arguments' must be an object", request_id)
    return request_id, server, tool, arguments


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def bind_in_place(path: Path) -> socket.socket:
    """A bound unix socket (mode 0600) that appears at ``path`` only once it is listening.

    ``path.parent`` is writable by the kernel, so nothing is done there by path: the socket is
    bound and chmodded in a fresh 0700 directory beside it that only the host can reach, starts
    listening, and is then renamed into the kernel's directory through directory fds. A rename
    replaces whatever the kernel put at that name (a symlink is replaced, never followed).
    """
    kernel_dir_fd = _open_dir(path.parent)
    staging = tempfile.mkdtemp(prefix=".bridge-", dir=path.parent.parent)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        staging_fd = _open_dir(Path(staging))
        try:
            staged = os.path.join(staging, path.name)
            sock.bind(staged)
            os.chmod(staged, 0o600)  # by path, but in a directory only the host can reach
            sock.listen(64)
            os.rename(path.name, path.name, src_dir_fd=staging_fd, dst_dir_fd=kernel_dir_fd)
        finally:
            os.close(staging_fd)
    except OSError as exc:
        sock.close()
        raise BridgeError(f"cannot create the tool bridge socket {path}: {exc}") from None
    finally:
        os.close(kernel_dir_fd)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(staging, path.name))  # only if the rename did not happen
        with contextlib.suppress(OSError):
            os.rmdir(staging)
    return sock


class KernelBridge:
    """The listening socket of one kernel."""

    def __init__(self, path: Path, token: str, dispatch: Dispatch, *, hello_timeout: float = protocol.HELLO_TIMEOUT):
        self.path = path
        self.token = token
        self.dispatch = dispatch
        self.hello_timeout = hello_timeout
        self.server: asyncio.AbstractServer | None = None
        self.handlers: set[asyncio.Task[Any]] = set()
        self.pending: dict[asyncio.Task[Any], None] = {}  # waiting for a hello, oldest first
        self.authenticated = 0

    async def start(self) -> None:
        sock = bind_in_place(self.path)
        self.server = await asyncio.start_unix_server(self._handle, sock=sock, limit=READ_CHUNK)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        authenticated = False
        try:
            authenticated = await self._hello(task, reader, writer)
            if authenticated:
                await self._serve(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if authenticated:
                self.authenticated -= 1
            self.pending.pop(task, None)
            self.handlers.discard(task)
            writer.close()

    async def _hello(self, task: asyncio.Task[Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read and check the hello; True once this connection may send requests."""
        self.pending[task] = None
        if len(self.pending) > protocol.MAX_PENDING:
            # Drop the oldest silent connection rather than refuse the new one: a kernel that
            # opens connections and never speaks must not lock out its own tool calls.
            oldest = next(iter(self.pending))
            self.pending.pop(oldest)
            oldest.cancel()
        try:
            line = await asyncio.wait_for(read_frame(reader, MAX_HELLO), self.hello_timeout)
        except (asyncio.TimeoutError, FrameTooLarge):
            return False  # no reply: whoever this is has not shown the token
        finally:
            self.pending.pop(task, None)
        if line is None:
            return False
        if not check_hello(line, self.token):
            await _reply(writer, refused("the bridge hello has a wrong or missing token"))
            return False
        if self.authenticated >= protocol.MAX_CONNECTIONS:
            await _reply(
                writer,
                refused(
                    f"the kernel already has {protocol.MAX_CONNECTIONS} open tool bridge connections "
                    "(one per thread that calls tools); call tools from fewer threads at once"
                ),
            )
            return False
        self.authenticated += 1
        await _reply(writer, protocol.welcome())
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                line = await read_frame(reader, MAX_FRAME)
            except FrameTooLarge:
                message = protocol.too_large("request", MAX_FRAME)
                await _reply(writer, refused(f"{message}; pass large data to the tool through a workspace file"))
                return
            if line is None:
                return
            parsed = parse_request(line)
            if isinstance(parsed, dict):
                await _reply(writer, parsed)
                continue
            request_id, server, tool, arguments = parsed
            response = await self._dispatch(server, tool, arguments)
            if request_id is not None:
                response = {**response, "id": request_id}
            await _reply(writer, response)

    async def _dispatch(self, server: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.dispatch(server, tool, arguments)
        except BridgeError as exc:
            return protocol.failed(str(exc))
        except Exception as exc:  # a bug must not kill the connection handler silently
            log.exception("bridge call %r.%r failed", server, tool)  # %r: names come from the kernel
            return protocol.failed(f"internal bridge error: {type(exc).__name__}: {exc}")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.handlers):
            task.cancel()
        for task in list(self.handlers):
            with contextlib.suppress(BaseException):
                await task
        # By name in the kernel's directory, through its fd: unlink never follows a symlink.
        with contextlib.suppress(OSError):
            dir_fd = _open_dir(self.path.parent)
            try:
                os.unlink(self.path.name, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)


async def _reply(writer: asyncio.StreamWriter, response: dict[str, Any]) -> None:
    writer.write(encode(response))
    await writer.drain()


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
