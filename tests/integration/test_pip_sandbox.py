"""pip in install_package is as fenced as the kernel: attacks from the kernel and from build code.

- a ``pip`` package planted in the workspace by the kernel never runs in pip's place;
- build code (a hostile sdist's setup.py, served by a loopback index the test makes) cannot
  exceed maxProcesses, cannot outlive limits.installSeconds or hang the server, cannot reach
  a loopback server that is not the index, nor an abstract unix socket of the host;
- pip's report file is read without following links and never blocks on a FIFO.

Each attack is shown to work with --no-sandbox (or, host-side, without the rule), so the
tests can fail. The index is on loopback, passed as PIP_INDEX_URL: the proxy lets pip reach
it (configured index, so loopback is allowed for it) and nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import http.server
import io
import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

from ipyfence.packages.installer import read_private_file
from ipyfence.packages.proxy import Destination, IndexProxy, allowed_destinations, is_public, upstream_proxies
from ipyfence.packages.spec import parse_spec
from tests.conftest import ClientFactory, require_bwrap, run_cell, text_of
from tests.integration.test_install_package import build_wheel

pytestmark = pytest.mark.sandbox

# The build backend every hostile sdist uses: ATTACK runs when pip imports it, then it fails
# the build (nothing needs installing: the record file is the evidence).
BACKEND = """\
import json, os, socket, sys, time, urllib.request
RECORD = {record!r}
def _save(rec):
    with open(RECORD, "a") as f:
        f.write(json.dumps(rec) + "\\n")
{attack}
def get_requires_for_build_wheel(config_settings=None):
    return []
def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    raise SystemExit("hostile package: done")
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise SystemExit("hostile package: done")
"""

FORK_ATTACK = """
children = []
for _ in range(300):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
_save({"forked": len(children)})
"""

SLEEP_ATTACK = """
_save({"sleeping": os.getpid()})
time.sleep(100000)
"""

NET_ATTACK = """
rec = {{}}
try:  # through the proxy pip is given (HTTP_PROXY is in the environment)
    rec["proxied"] = urllib.request.urlopen({other!r}, timeout=10).read().decode()
except Exception as e:
    rec["proxied"] = "error: " + repr(e)
try:  # straight to the host's loopback
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({{}}))
    rec["direct"] = opener.open({other!r}, timeout=10).read().decode()
except Exception as e:
    rec["direct"] = "error: " + repr(e)
try:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect({abstract!r})
    rec["abstract"] = s.recv(100).decode()
except Exception as e:
    rec["abstract"] = "error: " + repr(e)
_save(rec)
"""


def build_sdist(dest: Path, name: str, backend: str) -> Path:
    """name-1.0.tar.gz with an in-tree PEP 517 backend."""
    base = f"{name.replace('-', '_')}-1.0"
    files = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
        "backend.py": backend,
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
    }
    path = dest / f"{base}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{base}/{rel}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class Index:
    """A PEP 503 index on loopback; projects are added while it runs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "files").mkdir(parents=True)
        handler = functools.partial(_Quiet, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple/"

    def add(self, project: str, path: Path) -> None:
        page = self.root / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        (page / "index.html").write_text(f'<a href="../../files/{path.name}#sha256={digest}">{path.name}</a>\n')

    def add_hostile(self, project: str, record: Path, attack: str) -> None:
        self.add(project, build_sdist(self.root / "files", project, BACKEND.format(record=str(record), attack=attack)))

    def env(self) -> dict[str, str]:
        return {"PIP_INDEX_URL": self.url, "PIP_RETRIES": "0", "PIP_TIMEOUT": "20"}


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    idx = Index(tmp_path / "index")
    wheel = build_wheel(idx.root / "files", "fencetab", "0.9.0", {"fencetab/__init__.py": "__version__ = '0.9.0'\n"})
    idx.add("fencetab", wheel)
    try:
        yield idx
    finally:
        idx.server.shutdown()
        idx.server.server_close()


def records(path: Path) -> list[dict[str, Any]]:
    assert path.exists(), "the hostile build code never ran"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def install(client: Any, spec: str) -> tuple[str, bool]:
    result = await client.call_tool("install_package", {"package_name": spec})
    return text_of(result), bool(result.is_error)


def config(tmp_path: Path, **limits: int) -> str:
    cfg = tmp_path / "limits.json"
    cfg.write_text(json.dumps({"limits": limits}))
    return str(cfg)


# --- 1. a planted pip never runs ------------------------------------------------------------------

PLANT = (
    "import os\n"
    "os.makedirs('pip', exist_ok=True)\n"
    "open('pip/__init__.py', 'w').close()\n"
    "open('pip/__main__.py', 'w').write("
    "\"import os; open(os.path.join({ws!r}, 'plant-ran'), 'a').write('ran')\\nprint('planted pip 99')\\n\")\n"
    "print('planted')"
)


@pytest.mark.anyio
async def test_planted_pip_in_workspace_never_runs(make_client: ClientFactory, workspace: Path, index: Index) -> None:
    require_bwrap()
    marker = workspace / "plant-ran"
    async with make_client(env=index.env()) as client:
        out, err = await run_cell(client, PLANT.format(ws=str(workspace)))
        assert not err and "planted" in out, out
        text, err = await install(client, "fencetab==0.9.0")
        assert not err and "fencetab 0.9.0" in text, text
        out, err = await run_cell(client, "import fencetab; print(fencetab.__version__)")
        assert not err and "0.9.0" in out, out
    assert not marker.exists(), "the kernel's planted pip ran during install_package"
    # Control: the same plant does run for `python -m pip` started in the workspace.
    ran = subprocess.run(
        [sys.executable, "-m", "pip", "--version"], cwd=workspace, capture_output=True, text=True, timeout=60
    )
    assert "planted pip 99" in ran.stdout and marker.exists(), ran


# --- 2. process and time bounds -------------------------------------------------------------------


@pytest.mark.anyio
async def test_build_code_is_bounded_in_processes_and_time(
    make_client: ClientFactory, workspace: Path, index: Index, tmp_path: Path
) -> None:
    require_bwrap()
    forks, sleeps = workspace / "forks.jsonl", workspace / "sleeps.jsonl"
    index.add_hostile("fence-forker", forks, FORK_ATTACK)
    index.add_hostile("fence-sleeper", sleeps, SLEEP_ATTACK)
    cfg = config(tmp_path, maxProcesses=64, installSeconds=30)
    async with make_client("--sandbox-config", cfg, env=index.env()) as client:
        text, err = await install(client, "fence-forker")
        assert err, text
        recs = records(forks)  # one per build hook pip ran (each imports the backend)
        assert all(0 < r["forked"] < 64 for r in recs), recs

        text, err = await install(client, "fence-sleeper")
        assert err and "limits.installSeconds=30s" in text, text
        assert len(records(sleeps)) == 1
        out, err = await run_cell(client, "print(6 * 7)")
        assert not err and out.strip() == "42", out
        text, err = await install(client, "fencetab==0.9.0")  # installs still work afterwards
        assert not err and "fencetab 0.9.0" in text, text


@pytest.mark.anyio
async def test_fork_count_unbounded_without_sandbox(
    make_client: ClientFactory, workspace: Path, index: Index, tmp_path: Path
) -> None:
    """Control: unsandboxed, the same build code forks all it wants."""
    forks = workspace / "forks.jsonl"
    index.add_hostile("fence-forker", forks, FORK_ATTACK)
    cfg = config(tmp_path, maxProcesses=64, installSeconds=120)
    async with make_client("--no-sandbox", "--sandbox-config", cfg, env=index.env()) as client:
        text, err = await install(client, "fence-forker")
        assert err, text
    recs = records(forks)
    assert all(r["forked"] == 300 for r in recs), recs


# --- 3. pip reaches the index and nothing else ----------------------------------------------------


@pytest.fixture
def other_server() -> Iterator[str]:
    """A second loopback HTTP server that is not the index."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"other-server-secret"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def abstract_socket() -> Iterator[str]:
    """A host abstract unix socket that answers every connection with a word."""
    name = "\0ipyfence-test-" + secrets.token_hex(6)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(name)
    srv.listen(8)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"abstract-hello")

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield name
    finally:
        stop.set()
        srv.close()


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandbox", "no-sandbox"])
@pytest.mark.anyio
async def test_build_code_reaches_only_the_index(
    make_client: ClientFactory, workspace: Path, index: Index, other_server: str, abstract_socket: str, sandboxed: bool
) -> None:
    if sandboxed:
        require_bwrap()
    log = workspace / "net.jsonl"
    index.add_hostile("fence-netprobe", log, NET_ATTACK.format(other=other_server, abstract=abstract_socket))
    async with make_client(*(() if sandboxed else ("--no-sandbox",)), env=index.env()) as client:
        text, err = await install(client, "fence-netprobe")
        assert err and "hostile package: done" in text, text  # the index was reached: the sdist was fetched
        if sandboxed:  # the error says what the proxy refused
            assert f"refused: {urlsplit(other_server).netloc}" in text, text
        text, err = await install(client, "fencetab==0.9.0")
        assert not err and "fencetab 0.9.0" in text, text
    for rec in records(log):  # one per build hook pip ran
        if sandboxed:
            assert rec["proxied"].startswith("error") and "403" in rec["proxied"], rec
            assert rec["direct"].startswith("error"), rec
            assert rec["abstract"].startswith("error"), rec
        else:
            reached = {"proxied": "other-server-secret", "direct": "other-server-secret", "abstract": "abstract-hello"}
            assert rec == reached, rec


# --- report file read-back ------------------------------------------------------------------------


def test_report_read_refuses_fifo_symlink_and_oversize(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.json"
    secret.write_text('{"install": []}')
    link = tmp_path / "link.json"
    link.symlink_to(secret)
    with pytest.raises(OSError):
        read_private_file(link, 1000)
    assert read_private_file(secret, 1000) == secret.read_bytes()  # control: the target itself reads
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_private_file(fifo, 1000)  # returns at once: no writer is waited for
    big = tmp_path / "big.json"
    big.write_bytes(b"x" * 2000)
    with pytest.raises(ValueError, match="larger than"):
        read_private_file(big, 1000)


# --- which destinations the proxy allows (pure) -----------------------------------------------------


def test_allowed_destinations_follow_pips_configuration(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_CONFIG_DIRS": str(tmp_path / "none")}
    default = allowed_destinations(parse_spec("requests"), env)
    assert {(d.host, d.port, d.private_ok) for d in default} >= {
        ("pypi.org", 443, False),
        ("files.pythonhosted.org", 443, False),
    }

    mirror = {**env, "PIP_INDEX_URL": "http://127.0.0.1:8080/simple/", "PIP_EXTRA_INDEX_URL": "https://a.example/s"}
    got = allowed_destinations(parse_spec("requests"), mirror)
    assert Destination("127.0.0.1", 8080, True) in got and Destination("a.example", 443, True) in got
    assert not any(d.host == "pypi.org" for d in got)  # index-url replaces the default index

    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\nindex-url = https://mirror.corp:8443/simple\n[install]\nfind-links = http://links.corp/\n"
    )
    got = allowed_destinations(parse_spec("requests"), {**env, "PIP_CONFIG_FILE": str(conf)})
    assert {(d.host, d.port) for d in got} == {("mirror.corp", 8443), ("links.corp", 80)}

    vcs = allowed_destinations(parse_spec("git+https://git.example.org/org/repo.git"), env)
    assert Destination("git.example.org", 443, False) in vcs  # a spec's host: public addresses only
    direct = allowed_destinations(parse_spec("pkg @ https://dl.example.net:444/pkg-1.0.tar.gz"), env)
    assert Destination("dl.example.net", 444, False) in direct

    # A spec URL on the configured (loopback) index: one entry, still allowed to be private,
    # whatever the set order (two entries used to leave it to the hash seed).
    on_index = allowed_destinations(parse_spec("pkg @ http://127.0.0.1:8080/files/pkg-1.0.tar.gz"), mirror)
    assert [d for d in on_index if d.host == "127.0.0.1"] == [Destination("127.0.0.1", 8080, True)]


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2001:4860:4860::8888", True),
        ("2002:808:808::", True),  # 6to4 of a public IPv4
        ("64:ff9b::808:808", True),  # NAT64 of a public IPv4
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped
        ("::127.0.0.1", False),  # IPv4-compatible: is_global says True on 3.11
        ("2002:7f00:1::", False),  # 6to4 of loopback: is_global says True
        ("64:ff9b::7f00:1", False),  # NAT64 of loopback: is_global says True
    ],
)
def test_private_addresses_are_seen_through_ipv6_forms(address: str, public: bool) -> None:
    assert is_public(ipaddress.ip_address(address)) is public


async def _ask(sock: Path, head: bytes, until: bytes = b"\r\n\r\n") -> bytes:
    """Send ``head``; what comes back up to ``until`` (or the end)."""
    reader, writer = await asyncio.open_unix_connection(str(sock))
    writer.write(head)
    await writer.drain()
    data = b""
    with anyio.fail_after(20):
        while until not in data and (chunk := await reader.read(4096)):
            data += chunk
    writer.close()
    return data


@pytest.mark.anyio
async def test_proxy_refuses_private_addresses_unless_configured(tmp_path: Path, other_server: str) -> None:
    """The host-side filter on its own: private only for configured indexes, bounded heads, nothing else."""
    port = urlsplit(other_server).port
    assert port is not None
    connect = f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    sock = tmp_path / "p.sock"
    async with IndexProxy.start(sock, frozenset({Destination("127.0.0.1", port, False)})) as proxy:
        assert (await _ask(sock, connect)).startswith(b"HTTP/1.1 502")  # a spec/default host on loopback
        other = f"CONNECT 127.0.0.1:{port + 1} HTTP/1.1\r\n\r\n".encode()
        assert (await _ask(sock, other)).startswith(b"HTTP/1.1 403")  # not in the allow-list
        assert (await _ask(sock, b"GET / HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n")).startswith(b"HTTP/1.1 431")
        assert proxy.refused == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    async with IndexProxy.start(sock, frozenset({Destination("127.0.0.1", port, True)})):
        assert (await _ask(sock, connect)).startswith(b"HTTP/1.1 200")  # control: a configured index may be there
        get = f"GET {other_server} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        assert b"other-server-secret" in await _ask(sock, get, until=b"secret")


@pytest.mark.anyio
async def test_proxy_chains_to_the_hosts_own_proxy(tmp_path: Path) -> None:
    """With HTTPS_PROXY on the host, allowed CONNECTs go through it (with its credentials); others never reach it."""
    seen: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nfrom-upstream")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    up_port = server.sockets[0].getsockname()[1]
    sock = tmp_path / "p.sock"
    allowed = frozenset({Destination("pypi.org", 443, False)})
    env = upstream_proxies({"HTTPS_PROXY": f"http://user:pa%40ss@127.0.0.1:{up_port}", "NO_PROXY": "localhost"})
    async with IndexProxy.start(sock, allowed, env):
        answer = await _ask(sock, b"CONNECT pypi.org:443 HTTP/1.1\r\n\r\n", until=b"from-upstream")
        assert answer.startswith(b"HTTP/1.1 200") and b"from-upstream" in answer, answer
        assert (await _ask(sock, b"CONNECT evil.example:443 HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 403")
    server.close()
    assert len(seen) == 1 and seen[0].startswith(b"CONNECT pypi.org:443 HTTP/1.1"), seen
    assert b"Proxy-Authorization: Basic " + base64.b64encode(b"user:pa@ss") in seen[0]
