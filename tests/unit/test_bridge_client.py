"""The kernel-side client against the real host bridge (a unix socket, an event loop in a thread)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipyfence.mcptools import client, protocol
from ipyfence.mcptools.bridge import KernelBridge

TOKEN = "k" * 32


async def dispatch(server: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "content": [{"type": "text", "text": f"{tool}:{arguments.get('n')}"}]}


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KernelBridge]:
    kernel_dir = tmp_path / "k1"
    kernel_dir.mkdir(mode=0o700)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    bridge = KernelBridge(kernel_dir / protocol.SOCKET_NAME, TOKEN, dispatch)
    asyncio.run_coroutine_threadsafe(bridge.start(), loop).result(10)
    monkeypatch.setenv(protocol.SOCKET_ENV, str(bridge.path))
    monkeypatch.setenv(protocol.TOKEN_ENV, TOKEN)
    monkeypatch.setattr(client, "_shared", None)
    monkeypatch.setattr(client, "_shared_pid", None)
    monkeypatch.setattr(client, "_local", threading.local())
    try:
        yield bridge
    finally:
        asyncio.run_coroutine_threadsafe(bridge.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def call(n: int) -> str:
    reply = client.request({"server": "s", "tool": "t", "arguments": {"n": n}})
    return str(reply["content"][0]["text"])


def test_lazy_connection_per_thread(host: KernelBridge) -> None:
    assert call(1) == "t:1"
    assert call(2) == "t:2"  # same connection, reused


def test_wrong_token_is_a_bridge_error(host: KernelBridge, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(protocol.TOKEN_ENV, "0" * 32)
    with pytest.raises(client.BridgeError, match="wrong or missing token"):
        call(1)


def test_a_late_reply_to_an_abandoned_call_is_skipped(host: KernelBridge) -> None:
    client.preconnect(5)
    shared = client._shared
    assert shared is not None
    # what an interrupted call leaves behind: a request whose reply nobody read yet, and a
    # partial line ended by the client's clean-up newline
    shared.sock.sendall(protocol.encode({"id": -1, "server": "s", "tool": "t", "arguments": {"n": 99}}))
    shared.sock.sendall(b'{"id": -2, "server": "s", "to\n')
    assert call(3) == "t:3"
    assert call(4) == "t:4"


def test_preconnect_waits_for_the_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(protocol.SOCKET_ENV, str(tmp_path / "never.sock"))
    monkeypatch.setattr(client, "_shared", None)
    monkeypatch.setattr(client, "_shared_pid", None)
    with pytest.raises(client.BridgeError, match=r"did not appear within 0\.1s"):
        client.preconnect(0.1)


def test_preconnect_then_threads_share_one_connection(host: KernelBridge) -> None:
    client.preconnect(5)
    results: list[str] = []
    threads = [threading.Thread(target=lambda i=i: results.append(call(i))) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(f"t:{i}" for i in range(20))
    assert host.authenticated == 1  # twenty threads, one connection
