"""The kernel→host tool bridge protocol, shared by both ends (stdlib only: the kernel imports it).

One unix socket per kernel, newline-delimited JSON in both directions:

1. hello: the kernel's first line is ``{"token": "..."}``, at most ``MAX_HELLO`` bytes, within
   ``HELLO_TIMEOUT`` seconds of connecting. The host answers ``{"ok": true}``, or a refusal and
   closes the connection. Nothing larger than the hello is read before the token is checked.
2. requests: then each line is ``{"id", "server", "tool", "arguments"}``, at most ``MAX_FRAME``
   bytes; the reply line carries the same ``id``. A reply without a matching id (a refusal of a
   line the host could not parse, the answer to a request the kernel gave up on) is skipped by
   the kernel, so an interrupted call never shifts the answers of later ones.

The host caps how many connections one kernel may hold (``MAX_CONNECTIONS`` authenticated,
``MAX_PENDING`` waiting for their hello; the oldest waiting one is dropped for a new one).
"""

from __future__ import annotations

import json
from typing import Any

SOCKET_NAME = "bridge.sock"  # in the kernel's private dir
SOCKET_ENV = "IPYFENCE_BRIDGE_SOCKET"
TOKEN_ENV = "IPYFENCE_BRIDGE_TOKEN"

HELLO_KEYS = frozenset({"token"})
REQUEST_KEYS = frozenset({"id", "server", "tool", "arguments"})

MAX_HELLO = 256  # bytes, newline included; a token is 32 hex characters
HELLO_TIMEOUT = 5.0  # seconds a new connection may take to say hello
# One request line. Tool arguments can be large, but data bigger than this belongs in a file
# in the workspace, which the MCP server can be given a path to.
MAX_FRAME = 16 * 1024 * 1024
MAX_CONNECTIONS = 16  # authenticated connections per kernel (one per calling thread, or one shared)
MAX_PENDING = 8  # connections per kernel still waiting for their hello


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def hello(token: str) -> bytes:
    return encode({"token": token})


def welcome() -> dict[str, Any]:
    return {"ok": True}


def refused(message: str, request_id: Any = None) -> dict[str, Any]:
    reply: dict[str, Any] = {"ok": False, "kind": "refused", "error": message}
    if request_id is not None:
        reply["id"] = request_id
    return reply


def failed(message: str) -> dict[str, Any]:
    return {"ok": False, "kind": "failed", "error": message}


def too_large(what: str, limit: int) -> str:
    size = f"{limit // (1024 * 1024)} MiB" if limit >= 1024 * 1024 else f"{limit} bytes"
    return f"the bridge {what} is larger than {size}, so the host closed the connection"
