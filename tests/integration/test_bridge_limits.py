"""The tool bridge under attack from inside the sandboxed kernel, with a raw unix socket.

By default the kernel cannot create a unix socket at all after start-up (kernel_boot's seccomp
filter; tested in test_escape.py): these tests allow them (``allowAllUnixSockets``) to attack the
bridge's own host-side rules, which must hold even then.

- a 100 MB line without a hello is cut off after a small header: the server does not grow;
- 50 silent connections do not stop a generated tool call;
- a wrong token is refused, a token inside a request is refused;
- ``preconnect()``: one shared connection for every thread, no new socket afterwards, a clear
  error in a forked child and once the connection is lost.

The rules are host-side, so the 100 MB attack also runs with ``--no-sandbox``; the control in
each case is the same socket accepting a proper hello and serving a real call.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from ipyfence.mcptools import protocol
from tests.conftest import allow_unix_sockets, require_bwrap, require_srt, run_cell, text_of
from tests.integration import procs

PEER = str(Path(__file__).resolve().parents[1] / "peers" / "peer_server.py")
MB = 1024 * 1024

RAW = r"""
import json, os, socket
path, token = os.environ["IPYFENCE_BRIDGE_SOCKET"], os.environ["IPYFENCE_BRIDGE_TOKEN"]
def raw():
    s = socket.socket(socket.AF_UNIX); s.connect(path); return s
def flood(s, total, first=b""):
    sent = 0
    chunk = b"x" * (1024 * 1024)
    try:
        if first:
            s.sendall(first)
        while sent < total:
            sent += s.send(chunk)
    except OSError as e:
        return sent, type(e).__name__
    return sent, "all sent"
def lines(s):
    f = s.makefile("rb")
    return [json.loads(l) for l in f]
"""


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def ok_cell(client: Any, code: str) -> str:
    out, err = await run_cell(client, code, timeout=120)
    assert not err, out
    return out


MODES = {"bwrap": (), "srt": ("--sandbox-backend", "srt"), "no-sandbox": ("--no-sandbox",)}


def require(mode: str) -> None:
    if mode != "no-sandbox":
        require_bwrap()
    if mode == "srt":
        require_srt()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", list(MODES))
async def test_a_100mb_line_without_hello_is_cut_off(
    make_client: Any, workspace: Path, mode: str, tmp_path: Path
) -> None:
    require(mode)
    async with make_client(*MODES[mode], *allow_unix_sockets(tmp_path)) as client:
        await ok_cell(client, RAW)
        pid = procs.server_pid(str(workspace))
        before = vm_rss(pid)
        out = await ok_cell(client, "s = raw(); print('SENT', *flood(s, 100 * 1024 * 1024)); print(lines(s))")
        after = vm_rss(pid)
        sent = int(out.split()[1])
        # the host stopped reading after a small header: the kernel could not even push the
        # 100 MB into the socket, and the server did not grow by anything like it
        assert sent < 8 * MB, out
        assert "all sent" not in out and "[]" in out, out  # closed without a word
        assert after - before < 16 * MB, (before, after)
        # the same after a good hello: a request is capped at 16 MiB and refused by name
        out = await ok_cell(
            client,
            "s = raw(); print('SENT', *flood(s, 100 * 1024 * 1024, "
            "json.dumps({'token': token}).encode() + b'\\n')); print(lines(s))",
        )
        assert "'ok': True" in out and "larger than 16 MiB" in out, out
        assert int(out.split()[1]) < 40 * MB, out
        assert vm_rss(pid) - before < 64 * MB


@pytest.mark.anyio
async def test_silent_connections_and_wrong_tokens_do_not_stop_real_calls(make_client: Any, tmp_path: Path) -> None:
    require_bwrap()  # host-side rules: the srt and --no-sandbox runs of the 100 MB test cover those modes
    async with make_client(*allow_unix_sockets(tmp_path), env={"PEER_SECRET": "x"}) as client:
        result = await client.call_tool(
            "register_mcp_server", {"server_name": "peer", "server_params": {"command": sys.executable, "args": [PEER]}}
        )
        assert not result.is_error, text_of(result)
        out = await ok_cell(
            client,
            RAW
            + r"""
silent = [raw() for _ in range(50)]
from mcptools.peer import add
print("CALL", add.run(add.Params(a=2, b=40)).result)
closed = 0
for s in silent:
    s.setblocking(False)
    try:
        closed += s.recv(1) == b""
    except BlockingIOError:
        pass
print("SILENT CLOSED", closed)
bad = raw(); bad.sendall(json.dumps({"token": "0" * 32}).encode() + b"\n"); print("BAD", lines(bad))
smuggled = raw(); smuggled.sendall(json.dumps({"token": token, "server": "peer", "tool": "add"}).encode() + b"\n")
print("SMUGGLED", lines(smuggled))
""",
        )
        assert "CALL 42" in out, out
        # the oldest silent connections were dropped to make room (at most MAX_PENDING wait)
        assert int(out.split("SILENT CLOSED ")[1].split()[0]) >= 50 - protocol.MAX_PENDING, out
        assert "wrong or missing token" in out.split("BAD", 1)[1], out
        assert "wrong or missing token" in out.split("SMUGGLED", 1)[1], out


PRECONNECT = r"""
import os, socket, threading
from ipyfence.mcptools import client
from mcptools.peer import add
client.preconnect(10)
real_socket = socket.socket
class Forbidden(real_socket):
    def __init__(self, *a, **k):
        raise PermissionError("socket() blocked (as the seccomp filter does)")
socket.socket = Forbidden
results = []
threads = [threading.Thread(target=lambda i=i: results.append(add.run({"a": i, "b": 1}).result)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print("THREADS", sorted(results))
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        add.run({"a": 1, "b": 1}); msg = "child call worked"
    except client.BridgeError as e:
        msg = str(e)
    os.write(w, msg.encode()); os._exit(0)
os.waitpid(pid, 0); os.close(w)
print("CHILD", os.read(r, 4096).decode())
client._shared.sock.shutdown(socket.SHUT_RDWR)
try:
    add.run({"a": 1, "b": 1})
except client.BridgeError as e:
    print("LOST", e)
socket.socket = real_socket
"""


@pytest.mark.anyio
async def test_preconnect_shares_one_connection_and_fails_clearly(make_client: Any, tmp_path: Path) -> None:
    require_bwrap()  # unix sockets allowed: this test stands in for the start-up lockdown itself
    async with make_client(*allow_unix_sockets(tmp_path), env={"PEER_SECRET": "x"}) as client:
        result = await client.call_tool(
            "register_mcp_server", {"server_name": "peer", "server_params": {"command": sys.executable, "args": [PEER]}}
        )
        assert not result.is_error, text_of(result)
        out = await ok_cell(client, PRECONNECT)
        assert "THREADS [1, 2, 3, 4, 5, 6, 7, 8]" in out, out
        assert "CHILD MCP tools cannot be called from a forked child process" in out, out
        assert "LOST the connection to the ipyfence host bridge was lost" in out and "reset()" in out, out
        # reset() gives a new kernel whose calls work again
        result = await client.call_tool("reset", {})
        assert not result.is_error
        out = await ok_cell(client, "from mcptools.peer import add\nprint(add.run({'a': 1, 'b': 2}).result)")
        assert out.strip() == "3"
