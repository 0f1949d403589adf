"""Escape attacks from inside the kernel under ``--sandbox-backend srt`` (real srt, real kernel, real client).

Each attack runs once under srt (must fail) and once with ``--no-sandbox`` (must succeed), so
the checks can fail. All traffic stays on loopback: the "internet" check uses a UDP
``connect()``, which only asks the kernel for a route and sends nothing, and the domain
allowlist test points srt's ``parentProxy`` at a CONNECT recorder on the host's loopback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ClientFactory, require_bwrap, require_srt, run_cell

pytestmark = [pytest.mark.anyio, pytest.mark.srt, pytest.mark.sandbox]

SECRET_ENV = "s3cr3t-dotenv-value"
NESTED_SECRET = "nested-local-secret"
SERVER_SECRET = "server-only-secret-9f2c"


class LoopbackServer:
    """A TCP listener on the host's 127.0.0.1 that counts accepted connections."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            with conn:
                self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        """Accept and close: a connection that arrives is all the attack needs."""

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


class ConnectRecorder(LoopbackServer):
    """A parent proxy on loopback: records request lines, forwards nothing, answers 502."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        data = b""
        try:
            while b"\r\n\r\n" not in data and len(data) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            self.requests.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
            conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass


@pytest.fixture
def loopback_server() -> Iterator[LoopbackServer]:
    server = LoopbackServer()
    yield server
    server.close()


def _server_pid(workspace: Path) -> int:
    """The ipyfence server serving ``workspace`` (the host process the kernel must not reach)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"ipyfence") for a in argv[:2]) and str(workspace).encode() in argv:
            return int(entry)
    raise AssertionError("ipyfence server process not found")


def _prepare(workspace: Path, tmp_path: Path) -> None:
    (workspace / ".env").write_text(f"WS_SECRET={SECRET_ENV}\n")
    (workspace / "app").mkdir()
    (workspace / "app" / ".env.local").write_text(f"X={NESTED_SECRET}\n")
    (tmp_path / "sibling").mkdir()
    subprocess.run(["git", "init", "-q", str(workspace)], check=True)


ATTACKS = r"""
import json, os, signal, socket
results = {}
def attempt(name, fn):
    try:
        results[name] = ("ok", str(fn())[:200])
    except BaseException as e:
        results[name] = ("blocked", type(e).__name__ + ": " + str(e)[:200])
def write(path):
    with open(path, "w") as f:
        f.write("pwned")
    return path
def tcp():
    s = socket.create_connection(("127.0.0.1", LOOPBACK_PORT), timeout=3)
    s.close()
    return "connected"
def route():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # connect() on UDP sends nothing
    s.connect(("192.0.2.1", 9))
    return s.getsockname()
def proc_secret():
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if SERVER_SECRET.encode() in open(f"/proc/{pid}/environ", "rb").read():
                    found.append(pid)
            except OSError:
                pass
    if not found:
        raise PermissionError("secret not found in any /proc/*/environ")
    return found
attempt("read_env", lambda: open(WS + "/.env").read())
attempt("read_nested_env", lambda: open(WS + "/app/.env.local").read())
attempt("write_sibling", lambda: write(SIBLING + "/escape.txt"))
attempt("write_host_tmp", lambda: write(HOST_TMP + "/escape-tmp.txt"))
attempt("write_home", lambda: write(HOME_DIR + "/ipyfence-srt-escape-" + TAG))
attempt("write_hook", lambda: write(WS + "/.git/hooks/pre-commit"))
attempt("tcp_loopback", tcp)
attempt("internet_route", route)
attempt("signal_server", lambda: os.kill(SERVER_PID, 0) or "signalled")
attempt("proc_secret", proc_secret)
attempt("own_env_secret", lambda: os.environ["SERVER_SECRET"])
print("RESULTS=" + json.dumps(results))
"""


def _attack_code(workspace: Path, tmp_path: Path, port: int, server_pid: int) -> str:
    consts = {
        "WS": str(workspace),
        "SIBLING": str(tmp_path / "sibling"),
        "HOST_TMP": str(tmp_path),
        "HOME_DIR": os.path.expanduser("~"),
        "TAG": tmp_path.name,
        "LOOPBACK_PORT": port,
        "SERVER_PID": server_pid,
        "SERVER_SECRET": SERVER_SECRET,
    }
    return "".join(f"{k} = {v!r}\n" for k, v in consts.items()) + ATTACKS


def _results(text: str) -> dict[str, tuple[str, str]]:
    line = next(line for line in text.splitlines() if line.startswith("RESULTS="))
    return {k: (v[0], v[1]) for k, v in json.loads(line[len("RESULTS=") :]).items()}


def _host_effects(workspace: Path, tmp_path: Path) -> dict[str, bool]:
    home_file = Path(os.path.expanduser("~")) / f"ipyfence-srt-escape-{tmp_path.name}"
    return {
        "write_sibling": (tmp_path / "sibling" / "escape.txt").exists(),
        "write_host_tmp": (tmp_path / "escape-tmp.txt").exists(),
        "write_home": home_file.exists(),
        "write_hook": (workspace / ".git" / "hooks" / "pre-commit").exists(),
    }


def _cleanup_home(tmp_path: Path) -> None:
    home_file = Path(os.path.expanduser("~")) / f"ipyfence-srt-escape-{tmp_path.name}"
    home_file.unlink(missing_ok=True)


@pytest.mark.parametrize("mode", ["srt", "no-sandbox"])
async def test_escape_attacks(
    mode: str, make_client: ClientFactory, workspace: Path, tmp_path: Path, loopback_server: LoopbackServer
) -> None:
    if mode == "srt":
        require_srt()
        require_bwrap()
    _prepare(workspace, tmp_path)
    args = ("--sandbox-backend", "srt") if mode == "srt" else ("--no-sandbox",)
    try:
        async with make_client(*args, "--no-standby", env={"SERVER_SECRET": SERVER_SECRET}) as client:
            code = _attack_code(workspace, tmp_path, loopback_server.port, _server_pid(workspace))
            text, is_error = await run_cell(client, code, timeout=60)
            assert not is_error, text
            results = _results(text)
            effects = _host_effects(workspace, tmp_path)
            # srt stubs missing protected files in its cwd; none of those may appear in the
            # workspace. ipyfence's own read-only placeholders do, while the server runs.
            during = sorted(os.listdir(workspace))
        after = sorted(os.listdir(workspace))
    finally:
        _cleanup_home(tmp_path)

    if mode == "no-sandbox":  # the same attacks work unconfined: the checks below can fail
        assert SECRET_ENV in results["read_env"][1]
        assert NESTED_SECRET in results["read_nested_env"][1]
        assert all(effects.values()), effects
        assert results["tcp_loopback"][0] == "ok" and loopback_server.accepted >= 1
        assert results["internet_route"][0] == "ok"  # the host has a route (nothing was sent)
        assert results["signal_server"][0] == "ok"
        assert results["proc_secret"][0] == "ok"
        return

    placeholders = [".claude", ".cursor", ".idea", ".mcp.json", ".vscode"]
    assert during == sorted([".env", ".git", "app", *placeholders]), during
    assert after == [".env", ".git", "app"], after  # empty placeholders are removed at exit
    assert sorted(os.listdir(workspace)) == [".env", ".git", "app"]
    blocked = {name: outcome for name, (outcome, _) in results.items()}
    assert SECRET_ENV not in results["read_env"][1]
    assert NESTED_SECRET not in results["read_nested_env"][1]
    assert not any(effects.values()), (effects, results)
    # Writes to /tmp land in srt's private tmpfs (never on the host); the others fail outright.
    for name in ("write_sibling", "write_home", "write_hook"):
        assert blocked[name] == "blocked", results[name]
    assert blocked["tcp_loopback"] == "blocked" and loopback_server.accepted == 0
    assert "Network is unreachable" in results["internet_route"][1], results["internet_route"]
    assert "ProcessLookupError" in results["signal_server"][1], results["signal_server"]
    assert blocked["proc_secret"] == "blocked" and blocked["own_env_secret"] == "blocked"


async def test_domain_allowlist_through_parent_proxy(
    make_client: ClientFactory, workspace: Path, tmp_path: Path
) -> None:
    """srt's proxy refuses a non-allowed host (403) and sends the allowed one to the parent proxy only."""
    require_srt()
    require_bwrap()
    recorder = ConnectRecorder()
    try:
        parent = f"http://127.0.0.1:{recorder.port}"
        config = tmp_path / "srt-settings.json"
        config.write_text(
            json.dumps(
                {
                    "network": {
                        "allowedDomains": ["example.org"],
                        "deniedDomains": [],
                        "parentProxy": {"http": parent, "https": parent},
                    },
                    "filesystem": {"denyRead": [], "allowWrite": [], "denyWrite": []},
                }
            )
        )
        code = r"""
import urllib.request, urllib.error, json
out = {}
for url in ("https://example.com/", "https://example.org/", "http://example.net/"):
    try:
        urllib.request.urlopen(url, timeout=20)
        out[url] = "ok"
    except Exception as e:
        out[url] = f"{type(e).__name__}: {e}"
print("RESULTS=" + json.dumps(out))
"""
        async with make_client("--sandbox-config", str(config), "--no-standby") as client:  # auto picks srt
            text, is_error = await run_cell(client, code, timeout=90)
        assert not is_error, text
        results = json.loads(next(x for x in text.splitlines() if x.startswith("RESULTS="))[len("RESULTS=") :])
    finally:
        recorder.close()
    assert "403" in results["https://example.com/"], results
    assert "403" in results["http://example.net/"], results
    # The allowed host went to the parent proxy, which answered 502 and forwarded nothing.
    assert "502" in results["https://example.org/"], results
    assert recorder.requests == ["CONNECT example.org:443 HTTP/1.1"], recorder.requests


async def test_bridge_and_state_dirs_under_srt(make_client: ClientFactory, workspace: Path, state_dir: Path) -> None:
    """The kernel sees its own private dir but not ipyfence's state or other kernels' dirs."""
    require_srt()
    require_bwrap()
    (state_dir / "marker").write_text("x")
    code = f"""
import os
kd = os.path.dirname(os.environ["IPYFENCE_BRIDGE_SOCKET"])
print("own", sorted(os.listdir(kd))[:3] != [])
print("siblings", sorted(os.listdir(os.path.dirname(kd))))
try:
    print("state", os.listdir({str(state_dir)!r}))
except OSError as e:
    print("state blocked", type(e).__name__)
print("tmp", os.environ["TMPDIR"].startswith(kd))
"""
    async with make_client("--sandbox-backend", "srt") as client:  # with a standby kernel beside it
        text, is_error = await run_cell(client, code)
    assert not is_error, text
    assert "own True" in text
    siblings = text.split("siblings ", 1)[1].splitlines()[0]
    assert "k2" not in siblings and ".srt.json" not in siblings, siblings
    assert "marker" not in text
    assert "tmp True" in text


async def test_srt_missing_is_a_clear_error(tmp_path: Path, workspace: Path, state_dir: Path) -> None:
    """No srt on PATH: a fix-it message and a non-zero exit, never an unsandboxed kernel."""
    from tests.conftest import IPYFENCE, server_env

    env = server_env(state_dir, {"PATH": "/nonexistent"})
    proc = subprocess.run(
        [IPYFENCE, "--workspace", str(workspace), "--sandbox-backend", "srt"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "npm install -g @anthropic-ai/sandbox-runtime" in proc.stderr


SHM_KEY = 0x1F2E3D4C
SHM_READ = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget({SHM_KEY}, 0, 0)
print("SHM=" + (ctypes.string_at(libc.shmat(shmid, None, 0)).decode() if shmid >= 0 else "none"))
"""


@pytest.mark.parametrize("backend", ["srt", "bwrap"])
async def test_known_gap_srt_shares_host_sysv_ipc(backend: str, make_client: ClientFactory) -> None:
    """KNOWN GAP: srt does not unshare the IPC namespace (bwrap's --unshare-ipc is not in its argv).

    Under srt the kernel can attach the host's System V shared memory (and message queues,
    semaphores) that its uid may access; the bwrap backend blocks this. If this test starts
    failing for srt, srt has closed the gap: update the README's security model.
    """
    require_bwrap()
    if backend == "srt":
        require_srt()
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    shmid = libc.shmget(SHM_KEY, 4096, 0o1000 | 0o600)  # IPC_CREAT, owner-only
    assert shmid >= 0, ctypes.get_errno()
    try:
        addr = libc.shmat(shmid, None, 0)
        ctypes.memmove(addr, b"host-shm-secret\0", 16)
        async with make_client("--sandbox-backend", backend, "--no-standby") as client:
            text, is_error = await run_cell(client, SHM_READ)
        libc.shmdt(ctypes.c_void_p(addr))
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID
    assert not is_error, text
    expected = "SHM=host-shm-secret" if backend == "srt" else "SHM=none"
    assert expected in text, text
