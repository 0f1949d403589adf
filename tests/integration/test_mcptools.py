"""register_mcp_server + generated API + kernel→host bridge, end to end with real processes.

Every call below is made from code in the sandboxed kernel, through the generated modules or,
for the attacks, through a raw unix socket to the bridge.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import allow_unix_sockets, require_bwrap, run_cell, text_of

PEER = str(Path(__file__).resolve().parents[1] / "peers" / "peer_server.py")
TIME_SERVER = str(Path(sys.executable).with_name("mcp-server-time"))
SECRET = "s3cr3t-from-server-env-7f1c"
DOTENV_SECRET = "s3cr3t-from-dotenv-91ab"


def peer_params(secret_var: str = "PEER_SECRET") -> dict[str, Any]:
    return {"command": sys.executable, "args": [PEER], "env": {"PEER_SECRET": "${" + secret_var + "}"}}


async def register(client: Any, name: str, params: dict[str, Any]) -> tuple[str, bool]:
    result = await client.call_tool("register_mcp_server", {"server_name": name, "server_params": params})
    return text_of(result), bool(result.is_error)


async def ok_cell(client: Any, code: str) -> str:
    out, err = await run_cell(client, code, timeout=60)
    assert not err, out
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def http_peer() -> Iterator[str]:
    """The peer over streamable HTTP on loopback (on the host, where the kernel cannot reach it)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, PEER, "--http", str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.anyio
async def test_generated_apis_work_from_the_sandboxed_kernel(make_client: Any, workspace: Path, http_peer: str) -> None:
    require_bwrap()
    (workspace / ".env").write_text(f"DOTENV_SECRET={DOTENV_SECRET}\n")
    async with make_client(env={"PEER_SECRET": SECRET}) as client:
        out, err = await register(client, "peer", peer_params())
        assert not err, out
        assert set(out.split()) >= {
            "mcptools.peer.add",
            "mcptools.peer.get_sum",
            "mcptools.peer.foo_bar",
            "mcptools.peer.class_",
            "mcptools.peer.evil",
        }
        out, err = await register(client, "peer_dotenv", peer_params("DOTENV_SECRET"))
        assert not err, out
        out, err = await register(client, "everything", {"command": "mcp-server-everything", "args": []})
        assert not err, out
        out, err = await register(client, "time", {"command": TIME_SERVER, "args": []})
        assert not err, out
        out, err = await register(client, "peer_http", {"url": http_peer, "headers": {"X-Test": "${PEER_SECRET}"}})
        assert not err, out

        # Third-party servers: npm server-everything and PyPI mcp-server-time.
        out = await ok_cell(
            client,
            """
from mcptools.everything import echo, get_sum
from mcptools.time import get_current_time
print(echo.run(echo.Params(message="hello bridge")))
print(get_sum.run({"a": 2, "b": 40}))
print(get_current_time.run(get_current_time.Params(timezone="UTC")))
""",
        )
        assert "hello bridge" in out and "42" in out and "UTC" in out

        # Typed results, tool errors, non-text content, non-identifier names, help().
        out = await ok_cell(
            client,
            """
from mcptools.peer import add, fail, image, get_sum, foo_bar, class_
from ipyfence.mcptools.client import Image
r = add.run(add.Params(a=2, b=3))
print(type(r).__name__, r.result)
try:
    fail.run(fail.Params(message="the server's own message"))
except fail.ToolCallError as e:
    print("ToolCallError:", e)
imgs = image.run({})
print(type(imgs[0]).__name__, imgs[0].mime_type, imgs[0].data[:4])
print(get_sum.run(get_sum.Params(a=1, b=2)), foo_bar.run({}), class_.run({"value": "k"}))
print("DOC:", add.__doc__.splitlines()[0])
""",
        )
        assert "Result 5" in out
        assert "ToolCallError:" in out and "the server's own message" in out
        assert "Image image/png b'\\x89PNG'" in out
        assert "3.0 foo.bar called class=k" in out
        assert "DOC: MCP tool 'add' of server 'peer'." in out

        # The HTTP server is reached only through the bridge: the kernel has no network.
        out = await ok_cell(
            client,
            f"""
import socket
from mcptools.peer_http import add
print("http", add.run(add.Params(a=20, b=22)).result)
try:
    socket.create_connection(("127.0.0.1", {http_peer.split(":")[2].split("/")[0]}), timeout=2)
    print("DIRECT OK")
except OSError as e:
    print("direct blocked")
""",
        )
        assert "http 42" in out and "direct blocked" in out

        # Sessions are reused; a crashed server is restarted on the next call.
        out = await ok_cell(
            client,
            """
from mcptools.peer import pid, crash
p1 = pid.run({}).result; p2 = pid.run({}).result
print("same", p1 == p2)
try:
    crash.run({})
except Exception as e:
    print("crash:", type(e).__name__)
p3 = pid.run({}).result
print("restarted", p3 != p1)
""",
        )
        assert "same True" in out and "crash: BridgeError" in out and "restarted True" in out

        # Concurrent calls from threads in one cell.
        out = await ok_cell(
            client,
            """
from concurrent.futures import ThreadPoolExecutor
from mcptools.peer import add
with ThreadPoolExecutor(8) as pool:
    results = list(pool.map(lambda i: add.run({"a": i, "b": 1000}).result, range(64)))
print("threads", results == [i + 1000 for i in range(64)])
""",
        )
        assert "threads True" in out

        # Latency of calls made from code (reported, not asserted; `make bench` measures it).
        out = await ok_cell(
            client,
            """
import time
from mcptools.everything import echo
echo.run({"message": "warm"})
t = time.perf_counter()
for _ in range(200):
    echo.run({"message": "x"})
print(f"LATENCY {(time.perf_counter() - t) / 200 * 1000:.3f} ms/call")
""",
        )
        print(out)

        # Registrations (and the bridge) survive reset().
        result = await client.call_tool("reset", {})
        assert not result.is_error
        out = await ok_cell(
            client, "from mcptools.peer import add\nprint('after reset', add.run({'a': 1, 'b': 1}).result)"
        )
        assert "after reset 2" in out


@pytest.mark.anyio
async def test_secrets_stay_on_the_host(make_client: Any, workspace: Path, state_dir: Path) -> None:
    require_bwrap()
    (workspace / ".env").write_text(f"DOTENV_SECRET={DOTENV_SECRET}\n")
    async with make_client(env={"PEER_SECRET": SECRET}) as client:
        for name, var in (("peer", "PEER_SECRET"), ("peer_dotenv", "DOTENV_SECRET")):
            out, err = await register(client, name, peer_params(var))
            assert not err, out
        registry_path = next(state_dir.rglob("registry.json"))
        out = await ok_cell(
            client,
            f"""
import os, pathlib
from mcptools.peer import secret_sha256
from mcptools.peer_dotenv import secret_sha256 as dotenv_sha
print("server sha", secret_sha256.run({{}}).result)
print("dotenv sha", dotenv_sha.run({{}}).result)
needles = [{SECRET!r}, {DOTENV_SECRET!r}]
hay = [repr(dict(os.environ))]
for p in pathlib.Path("mcptools").rglob("*"):
    if p.is_file():
        hay.append(p.read_bytes().decode(errors="replace"))
for p in pathlib.Path("/proc").glob("[0-9]*/environ"):
    try:
        hay.append(p.read_bytes().decode(errors="replace"))
    except OSError:
        pass
print("registry visible", os.path.exists({str(registry_path)!r}))
print("leaked", any(n in h for n in needles for h in hay))
try:
    print(open(".env").read() or "env empty")
except OSError as e:
    print("env unreadable")
""",
        )
        # The servers got the substituted secrets (from the server env and from .env)...
        assert f"server sha {hashlib.sha256(SECRET.encode()).hexdigest()}" in out
        assert f"dotenv sha {hashlib.sha256(DOTENV_SECRET.encode()).hexdigest()}" in out
        # ...and the kernel sees neither of them anywhere.
        assert "leaked False" in out
        assert "registry visible False" in out  # the state dir is hidden from the kernel
        assert DOTENV_SECRET not in out and SECRET not in out
    # Placeholders, not secrets, are persisted.
    registry = next(state_dir.rglob("registry.json")).read_text()
    assert SECRET not in registry and "${PEER_SECRET}" in registry


BRIDGE_ATTACKS = r"""
import json, os, socket
path, token = os.environ["IPYFENCE_BRIDGE_SOCKET"], os.environ["IPYFENCE_BRIDGE_TOKEN"]
def ask(req, hello={"token": token}):
    s = socket.socket(socket.AF_UNIX); s.connect(path); f = s.makefile()
    s.sendall((json.dumps(hello) + "\n").encode())
    line = f.readline()
    if line and json.loads(line).get("ok"):
        s.sendall((json.dumps(req) + "\n").encode())
        line = f.readline()
    s.close()
    return json.loads(line) if line else {"closed": True}
marker = MARKER
# ipybox's attack: post full server_params so the host runs a command with its secrets.
ipybox = {"server_name": "x", "server_params": {"command": "sh", "args": ["-c", f"echo $PEER_SECRET > {marker}"]},
          "tool": "t", "arguments": {}}
print("A1", ask(ipybox))
print("A2", ask({"server": "peer", "tool": "add", "arguments": {"a": 1, "b": 2},
                 "server_params": {"command": "sh", "args": ["-c", f"touch {marker}"]}}))
print("A3", ask({"server": "evil_srv", "tool": "run", "arguments": {}}))
print("A4", ask({"server": "peer", "tool": "no_such_tool", "arguments": {}}))
print("A5", ask({"server": "peer", "tool": "add", "arguments": {"a": 1, "b": 2}}, hello={"token": "0" * 32}))
print("A6", ask({"server": "peer", "tool": "add", "arguments": {"a": 1, "b": 2}}, hello={}))
print("A7", ask({"server": "peer", "tool": "add", "arguments": {"a": 1, "b": 2},
                 "env": {"LD_PRELOAD": "/tmp/x.so"}}))
print("A8", ask({"token": token, "server": "peer", "tool": "add", "arguments": {"a": 1, "b": 2}}))
print("OK", ask({"server": "peer", "tool": "add", "arguments": {"a": 1, "b": 2}})["ok"])
"""


@pytest.mark.anyio
async def test_bridge_refuses_everything_but_registered_tool_calls(
    make_client: Any, workspace: Path, tmp_path: Path
) -> None:
    require_bwrap()
    marker = tmp_path / "host-marker"
    # Raw sockets allowed (allowAllUnixSockets): the bridge's own rules must hold even then.
    unix = allow_unix_sockets(tmp_path)
    async with make_client(*unix, env={"PEER_SECRET": SECRET, "PEER_MARKER": str(marker)}) as client:
        out, err = await register(client, "peer", peer_params())
        assert not err, out
        out = await ok_cell(client, BRIDGE_ATTACKS.replace("MARKER", repr(str(marker))))
        lines = {line[:2]: line for line in out.splitlines()}
        for key in ("A1", "A2", "A7", "A8"):
            assert "'ok': False" in lines[key] and "refused key(s)" in lines[key], lines[key]
        assert "is not registered" in lines["A3"]
        assert "has no tool 'no_such_tool'" in lines["A4"]
        assert "wrong or missing token" in lines["A5"] and "wrong or missing token" in lines["A6"]
        assert "OK True" in out
        # A hostile tool description cannot inject code: importing the module runs nothing.
        out = await ok_cell(
            client,
            """
import mcptools.peer.evil as evil
print("doc ok", '\"\"\"' in evil.__doc__ and "import os" in evil.__doc__)
print(evil.run({"text": "t"}))
help(evil.run)
""",
        )
        assert "doc ok True" in out and "still just data: t" in out
    assert not marker.exists()
    assert not Path("/tmp/pwned").exists()


@pytest.mark.anyio
async def test_bad_registrations_are_tool_errors(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    hang = {"command": sys.executable, "args": ["-c", "import time; time.sleep(600)"]}
    cases: list[tuple[str, Any, str]] = [
        ("1abc", peer_params(), "not a valid Python identifier"),
        ("../x", peer_params(), "not a valid Python identifier"),
        ("class", peer_params(), "keyword"),
        ("ok", {"command": "x", "shell": True}, "unknown key(s) ['shell']"),
        ("ok", {"command": "x", "cwd": "."}, "cwd '.' is inside a writable root"),
        ("ok", {"args": ["x"]}, "needs 'command'"),
        ("ok", {"command": "x", "url": "http://127.0.0.1:1/"}, "both"),
        ("ok", {"command": "x", "args": "not-a-list"}, "args must be a list"),
        ("ok", {"command": "x", "env": {"A": "${NOPE_UNSET_VAR}"}}, "unknown variable ${NOPE_UNSET_VAR}"),
        ("ok", {"url": "ftp://127.0.0.1/x"}, "http:// or https://"),
        ("ok", {"command": "/nonexistent/mcp-server"}, "command not found"),
        (
            "ok",
            {"command": sys.executable, "args": ["-c", "import sys; print('bye', file=sys.stderr); sys.exit(3)"]},
            "bye",
        ),
        ("ok", hang, "did not complete the MCP handshake within 3s"),
        ("ok", {"url": f"http://127.0.0.1:{_free_port()}/mcp"}, "cannot connect"),
    ]
    async with make_client(env={"PEER_SECRET": SECRET, "IPYFENCE_MCP_CONNECT_TIMEOUT": "3"}) as client:
        for name, params, expected in cases:
            out, err = await register(client, name, params)
            assert err, (name, params, out)
            assert expected in out, (name, params, out)
        assert not (workspace / "mcptools" / "ok").exists()

        # A failed re-register leaves the old API intact and working.
        out, err = await register(client, "peer", peer_params())
        assert not err, out
        before = (workspace / "mcptools" / "peer" / "add.py").read_text()
        out, err = await register(client, "peer", {"command": "/nonexistent/mcp-server"})
        assert err and "command not found" in out
        assert (workspace / "mcptools" / "peer" / "add.py").read_text() == before
        assert [p.name for p in (workspace / "mcptools").iterdir() if p.name.startswith(".")] == []
        out = await ok_cell(client, "from mcptools.peer import add\nprint('still', add.run({'a': 1, 'b': 2}).result)")
        assert "still 3" in out
        # ipyfence stays healthy after all of that.
        out = await ok_cell(client, "print(6 * 7)")
        assert "42" in out

    # After a server restart, the generated API works again without a new register.
    async with make_client(env={"PEER_SECRET": SECRET}) as client:
        out = await ok_cell(
            client, "from mcptools.peer import add\nprint('restarted', add.run({'a': 2, 'b': 2}).result)"
        )
        assert "restarted 4" in out
        state = json.loads(next(p for p in workspace.parent.rglob("registry.json")).read_text())
        assert list(state["servers"]) == ["peer"]
