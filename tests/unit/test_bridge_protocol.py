"""The host bridge's protocol rules, against a real unix socket (no kernel needed)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ipyfence.mcptools import protocol
from ipyfence.mcptools.bridge import KernelBridge, bind_in_place

TOKEN = "t" * 32


@pytest.fixture
def kernel_dir(tmp_path: Path) -> Path:
    d = tmp_path / "runtime" / "k1"
    d.mkdir(parents=True, mode=0o700)
    return d


async def echo(server: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "content": [{"type": "text", "text": f"{server}.{tool}"}]}


@pytest.fixture
async def bridge(kernel_dir: Path) -> AsyncIterator[KernelBridge]:
    b = KernelBridge(kernel_dir / protocol.SOCKET_NAME, TOKEN, echo, hello_timeout=0.5)
    await b.start()
    try:
        yield b
    finally:
        await b.close()


async def connect(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(str(path), limit=64 * 1024 * 1024)


async def say(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, data: bytes) -> dict[str, Any] | None:
    writer.write(data)
    await writer.drain()
    line = await reader.readline()
    return json.loads(line) if line else None


@pytest.mark.anyio
async def test_hello_then_request_with_id(bridge: KernelBridge) -> None:
    reader, writer = await connect(bridge.path)
    assert await say(writer, reader, protocol.hello(TOKEN)) == {"ok": True}
    req = {"id": 7, "server": "s", "tool": "t", "arguments": {}}
    reply = await say(writer, reader, protocol.encode(req))
    assert reply is not None and reply["id"] == 7 and reply["content"][0]["text"] == "s.t"
    # a line the host cannot parse gets an id-less refusal and the connection stays usable
    reply = await say(writer, reader, b"{not json\n")
    assert reply is not None and reply["kind"] == "refused" and "id" not in reply
    reply = await say(writer, reader, protocol.encode({**req, "id": 8}))
    assert reply is not None and reply["id"] == 8
    writer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("hello", [{"token": "x" * 32}, {}, {"token": TOKEN, "server": "s"}, [TOKEN]])
async def test_a_bad_hello_is_refused_and_closed(bridge: KernelBridge, hello: Any) -> None:
    reader, writer = await connect(bridge.path)
    reply = await say(writer, reader, protocol.encode(hello) if isinstance(hello, dict) else b"[1]\n")
    assert reply is not None and reply["ok"] is False and "token" in reply["error"]
    assert await reader.readline() == b""  # closed at once


@pytest.mark.anyio
async def test_a_big_line_without_hello_is_cut_off_after_the_header(bridge: KernelBridge) -> None:
    reader, writer = await connect(bridge.path)
    writer.write(b"x" * (protocol.MAX_HELLO * 4))  # no newline: never a complete hello
    await writer.drain()
    assert await reader.readline() == b""  # closed without a word


@pytest.mark.anyio
async def test_silence_is_closed_after_the_hello_timeout(bridge: KernelBridge) -> None:
    reader, _writer = await connect(bridge.path)
    assert await reader.readline() == b""


@pytest.mark.anyio
async def test_oversized_request_is_refused_with_the_cap(bridge: KernelBridge) -> None:
    reader, writer = await connect(bridge.path)
    assert await say(writer, reader, protocol.hello(TOKEN)) == {"ok": True}
    big = protocol.encode({"id": 1, "server": "s", "tool": "t", "arguments": {"x": "y" * protocol.MAX_FRAME}})
    writer.write(big)
    line = await reader.readline()
    reply = json.loads(line)
    assert reply["ok"] is False and "16 MiB" in reply["error"]
    assert await reader.readline() == b""
    writer.close()


@pytest.mark.anyio
async def test_connection_caps(bridge: KernelBridge) -> None:
    # silent connections beyond MAX_PENDING push out the oldest, never the newest
    silent = [await connect(bridge.path) for _ in range(protocol.MAX_PENDING + 5)]
    reader, writer = await connect(bridge.path)
    assert await say(writer, reader, protocol.hello(TOKEN)) == {"ok": True}
    closed = [await r.read() == b"" for r, _ in silent[:5]]
    assert all(closed)
    # authenticated connections are capped
    conns = [(reader, writer)]
    for _ in range(protocol.MAX_CONNECTIONS - 1):
        r, w = await connect(bridge.path)
        assert await say(w, r, protocol.hello(TOKEN)) == {"ok": True}
        conns.append((r, w))
    r, w = await connect(bridge.path)
    reply = await say(w, r, protocol.hello(TOKEN))
    assert reply is not None and reply["ok"] is False and "open tool bridge connections" in reply["error"]
    # closing one frees a slot
    conns[0][1].close()
    await conns[0][1].wait_closed()
    for _ in range(50):
        r, w = await connect(bridge.path)
        reply = await say(w, r, protocol.hello(TOKEN))
        if reply == {"ok": True}:
            break
        await asyncio.sleep(0.05)
    assert reply == {"ok": True}


def test_socket_is_0600_and_a_planted_symlink_is_replaced_not_followed(kernel_dir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "host-file"
    victim.write_text("host data")
    victim.chmod(0o644)
    planted = kernel_dir / protocol.SOCKET_NAME
    planted.symlink_to(victim)
    # control: what a chmod by path would have done to the host file
    os.chmod(planted, 0o600)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    victim.chmod(0o644)

    sock = bind_in_place(planted)
    try:
        st = os.lstat(planted)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(victim.stat().st_mode) == 0o644 and victim.read_text() == "host data"
        assert [p.name for p in kernel_dir.parent.iterdir()] == ["k1"]  # the staging dir is gone
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(planted))  # listening by the time it appears
        client.close()
    finally:
        sock.close()
