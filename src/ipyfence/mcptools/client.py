"""Kernel-side runtime for the generated ``mcptools`` modules (stdlib + pydantic only).

Runs inside the sandbox, which has no network: calls go as newline-delimited JSON over the
unix socket ``$IPYFENCE_BRIDGE_SOCKET`` (protocol in ``protocol.py``). A connection first
says hello with the kernel's token; a request then carries only a registered server's name,
a tool name and the arguments; the host decides everything else.

Two ways to hold connections:
- ``preconnect(timeout)``, called once by ipyfence's start-up step before user code runs:
  one process-wide connection, shared by all threads (one request/response at a time), and
  no socket is ever created again (the sandbox then forbids creating unix sockets). If that
  connection breaks, tool calls fail until ``reset()`` gives the agent a new kernel.
- otherwise, lazily: one connection per thread, made on first use, remade once if stale.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ipyfence.mcptools.protocol import SOCKET_ENV, TOKEN_ENV, encode, hello


class ToolCallError(Exception):
    """The MCP server reported an error for this tool call (its message is the exception text)."""


class BridgeError(Exception):
    """The host bridge refused the call or could not reach the MCP server."""


@dataclass(frozen=True)
class Image:
    data: bytes
    mime_type: str

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {self.mime_type: self.data, "text/plain": repr(self)}

    def __repr__(self) -> str:
        return f"Image({self.mime_type}, {len(self.data)} bytes)"


@dataclass(frozen=True)
class Audio:
    data: bytes
    mime_type: str

    def __repr__(self) -> str:
        return f"Audio({self.mime_type}, {len(self.data)} bytes)"


@dataclass(frozen=True)
class Resource:
    """An embedded resource (``text`` or ``blob`` set) or a resource link (neither set)."""

    uri: str
    mime_type: str | None = None
    text: str | None = None
    blob: bytes | None = None
    name: str | None = None


class _Connection:
    """One authenticated connection. Its read buffer outlives an interrupted call, so a reply
    that arrives after the caller gave up is read (and skipped by id) by the next call."""

    def __init__(self, path: str, token: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.buf = bytearray()
        self.pid = os.getpid()
        try:
            self.sock.connect(path)
            self.sock.sendall(hello(token))
            line = self.readline()
        except OSError:
            self.close()
            raise
        reply = json.loads(line) if line else {}
        if not reply.get("ok"):
            self.close()
            raise BridgeError(str(reply.get("error", "the ipyfence tool bridge closed the connection at hello")))

    def readline(self) -> bytes:
        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                line = bytes(self.buf[: end + 1])
                del self.buf[: end + 1]
                return line
            chunk = self.sock.recv(65536)
            if not chunk:
                return b""
            self.buf += chunk

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except BaseException:
            # Interrupted part-way (KeyboardInterrupt): end the partial line so the host
            # answers it with an id-less refusal, which the next call skips.
            with contextlib.suppress(OSError):
                self.sock.sendall(b"\n")
            raise

    def call(self, request_id: int, data: bytes) -> dict[str, Any] | None:
        """Send one request, return the reply with its id; None if the host closed the connection."""
        self.send(data)
        while True:
            line = self.readline()
            if not line:
                return None
            reply: dict[str, Any] = json.loads(line)
            if reply.get("id") == request_id:
                return reply
            # an answer to an earlier call that was interrupted, or to a line the host could not parse

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


_ids = itertools.count(1)
_local = threading.local()

# Set once by preconnect(); from then on no socket is ever created.
_shared: _Connection | None = None
_shared_pid: int | None = None
_shared_lock = threading.Lock()

_LOST = (
    "the connection to the ipyfence host bridge was lost, and this kernel cannot open a new one; "
    "ask for reset(), which gives the agent a new kernel with a new connection"
)


def _endpoint() -> tuple[str, str]:
    path = os.environ.get(SOCKET_ENV)
    if not path:
        raise BridgeError(f"{SOCKET_ENV} is not set: this kernel was not started by ipyfence")
    return path, os.environ.get(TOKEN_ENV, "")


def preconnect(timeout: float, *, path: str | None = None, token: str | None = None) -> None:
    """Open the one process-wide bridge connection now, waiting up to ``timeout`` seconds for
    the host's socket (the host attaches it while the kernel boots). Every later tool call in
    this process, from any thread, shares it; no other socket is created.

    ``path`` and ``token`` default to ``$IPYFENCE_BRIDGE_SOCKET`` and ``$IPYFENCE_BRIDGE_TOKEN``
    (a start-up step that gets the token another way, e.g. from a file descriptor, passes it).
    """
    global _shared, _shared_pid
    if path is None:
        path = _endpoint()[0]
    if token is None:
        token = os.environ.get(TOKEN_ENV, "")
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = _Connection(path, token)
            break
        except (FileNotFoundError, ConnectionRefusedError) as exc:  # not there yet, or not listening yet
            if time.monotonic() >= deadline:
                raise BridgeError(f"the ipyfence tool bridge did not appear within {timeout:g}s: {exc}") from None
            time.sleep(0.02)
        except OSError as exc:
            raise BridgeError(f"cannot reach the ipyfence tool bridge: {exc}") from None
    with _shared_lock:
        if _shared is not None:
            _shared.close()
        _shared, _shared_pid = conn, os.getpid()


def _shared_request(request_id: int, data: bytes) -> dict[str, Any]:
    if os.getpid() != _shared_pid:  # checked before the lock, which a fork may have copied held
        raise BridgeError(
            f"MCP tools cannot be called from a forked child process: the kernel's one connection to the "
            f"ipyfence host bridge belongs to the kernel process (pid {_shared_pid}); call them from the "
            "kernel process (threads are fine)"
        )
    global _shared
    with _shared_lock:
        conn = _shared
        if conn is None:
            raise BridgeError(_LOST)
        try:
            reply = conn.call(request_id, data)
        except OSError:
            reply = None
        if reply is None:
            conn.close()
            _shared = None
            raise BridgeError(_LOST)
        return reply


def _thread_connection() -> tuple[_Connection, bool]:
    """This thread's connection and whether it is fresh (a forked child must not share its parent's)."""
    conn: _Connection | None = getattr(_local, "conn", None)
    if conn is not None and conn.pid == os.getpid():
        return conn, False
    path, token = _endpoint()
    try:
        conn = _Connection(path, token)
    except OSError as exc:
        raise BridgeError(f"cannot reach the ipyfence tool bridge: {exc}") from None
    _local.conn = conn
    return conn, True


def _drop_connection() -> None:
    conn = getattr(_local, "conn", None)
    _local.conn = None
    if conn is not None:
        conn.close()


def request(payload: dict[str, Any]) -> dict[str, Any]:
    """Send one request, return its reply."""
    request_id = next(_ids)
    data = encode({**payload, "id": request_id})
    if _shared_pid is not None:
        return _shared_request(request_id, data)
    for _attempt in range(2):
        conn, fresh = _thread_connection()
        try:
            reply = conn.call(request_id, data)
        except OSError as exc:
            _drop_connection()
            if fresh:
                raise BridgeError(f"the ipyfence tool bridge connection failed: {exc}") from None
            continue
        if reply is None:
            _drop_connection()
            if fresh:
                raise BridgeError("the ipyfence tool bridge closed the connection")
            continue  # a stale connection from before; retry once on a fresh one
        return reply
    raise BridgeError("the ipyfence tool bridge is not answering")


def _convert(block: dict[str, Any]) -> Any:
    kind = block.get("type")
    if kind == "text":
        return block.get("text", "")
    if kind == "image":
        return Image(base64.b64decode(block.get("data", "")), block.get("mimeType", "application/octet-stream"))
    if kind == "audio":
        return Audio(base64.b64decode(block.get("data", "")), block.get("mimeType", "application/octet-stream"))
    if kind == "resource":
        res = block.get("resource", {})
        blob = res.get("blob")
        return Resource(
            uri=res.get("uri", ""),
            mime_type=res.get("mimeType"),
            text=res.get("text"),
            blob=base64.b64decode(blob) if blob is not None else None,
        )
    if kind == "resource_link":
        return Resource(uri=block.get("uri", ""), mime_type=block.get("mimeType"), name=block.get("name"))
    return block


def call_tool(
    server: str,
    tool: str,
    params: BaseModel | dict[str, Any],
    params_model: type[BaseModel],
    result_model: type[BaseModel] | None,
) -> Any:
    """Validate ``params``, call the tool through the bridge and map its result to Python values."""
    if not isinstance(params, params_model):
        if isinstance(params, BaseModel):
            raise TypeError(f"run() expects {params_model.__module__}.Params or a dict, got {type(params).__name__}")
        params = params_model.model_validate(params)
    arguments = params.model_dump(mode="json", by_alias=True, exclude_unset=True)
    if not isinstance(arguments, dict):
        raise TypeError("the tool's Params must serialize to a JSON object")
    response = request({"server": server, "tool": tool, "arguments": arguments})
    if not response.get("ok"):
        message = str(response.get("error", "unknown error"))
        if response.get("kind") == "tool":
            raise ToolCallError(message)
        raise BridgeError(message)
    content = [_convert(b) for b in response.get("content", [])]
    structured = response.get("structured")
    if result_model is not None and structured is not None:
        return result_model.model_validate(structured)
    if all(isinstance(v, str) for v in content):
        if not content and structured is not None:
            return structured
        return "\n".join(content)
    return content
