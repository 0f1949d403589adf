"""Kernel-side runtime for the generated ``mcptools`` modules (stdlib + pydantic only).

Runs inside the sandbox, which has no network: calls go as newline-delimited JSON over the
unix socket ``$IPYFENCE_BRIDGE_SOCKET``, one persistent connection per thread. A request
carries only the token, a registered server's name, a tool name and the arguments; the host
decides everything else.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

SOCKET_ENV = "IPYFENCE_BRIDGE_SOCKET"
TOKEN_ENV = "IPYFENCE_BRIDGE_TOKEN"


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
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self.rfile = self.sock.makefile("rb")
        self.pid = os.getpid()

    def close(self) -> None:
        for closer in (self.rfile.close, self.sock.close):
            with contextlib.suppress(OSError):
                closer()


_local = threading.local()


def _connection() -> tuple[_Connection, bool]:
    """This thread's connection and whether it is fresh (a forked child must not share its parent's)."""
    conn: _Connection | None = getattr(_local, "conn", None)
    if conn is not None and conn.pid == os.getpid():
        return conn, False
    path = os.environ.get(SOCKET_ENV)
    if not path:
        raise BridgeError(f"{SOCKET_ENV} is not set: this kernel was not started by ipyfence")
    try:
        conn = _Connection(path)
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
    """Send one request line, read one response line."""
    data = (json.dumps(payload, separators=(",", ":")) + "\n").encode()
    for _attempt in range(2):
        conn, fresh = _connection()
        try:
            conn.sock.sendall(data)
            line = conn.rfile.readline()
        except OSError as exc:
            _drop_connection()
            if fresh:
                raise BridgeError(f"the ipyfence tool bridge connection failed: {exc}") from None
            continue
        if not line:
            _drop_connection()
            if fresh:
                raise BridgeError("the ipyfence tool bridge closed the connection")
            continue  # a stale connection from before; retry once on a fresh one
        response: dict[str, Any] = json.loads(line)
        return response
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
    token = os.environ.get(TOKEN_ENV, "")
    response = request({"token": token, "server": server, "tool": tool, "arguments": arguments})
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
