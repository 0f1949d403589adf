"""Acceptance 7 and 8: attack the boundary from inside the kernel.

Every attack runs twice: sandboxed (the default) it must fail, and with ``--no-sandbox`` it must
succeed, which proves the attack itself works and the test can fail. Each mode starts one
server and runs every attack in it (in a sync, module-scoped fixture); the per-attack tests
then check the recorded outcome.

Traffic: only to host loopback servers the test runs, and — inside the sandbox only, after
checking that its namespace has no route — one connect() to TEST-NET 192.0.2.1, which
cannot leave. With --no-sandbox nothing is sent anywhere: the test only reads the host's
routing table.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

import ipyfence
from tests.conftest import ipyfence_client, require_bwrap, run_cell
from tests.integration.procs import server_pid

MODES = ("sandboxed", "no-sandbox")
RUN_ID = uuid.uuid4().hex[:10]

HARNESS = """
import json, os, socket
C = json.loads(CONFIG_JSON)
def attempt(fn):
    try:
        detail = fn()
    except BaseException as exc:
        print(f"BLOCKED {type(exc).__name__}: {exc}"[:400])
    else:
        print(f"SUCCEEDED {detail!r}"[:400])
"""


# --- attacks ------------------------------------------------------------------------------


@dataclass
class Attack:
    name: str
    code: str  # defines attack(); may use C (the config dict); run via attempt(attack)
    host_check: Callable[[Path], bool] | None = None  # decides success by looking at the host instead
    cleanup: Callable[[Path], None] | None = None
    no_sandbox_code: str | None = None  # a harmless variant for --no-sandbox (never sends packets out)
    sandbox_only: bool = False


def _read_secret(path_expr: str, marker_key: str) -> str:
    return f"""
def attack():
    data = open({path_expr}).read()
    assert C[{marker_key!r}] in data, f"no secret in the file, read {{data[:40]!r}}"
    return "read the secret"
"""


def _write(path_expr: str) -> str:
    return f"""
def attack():
    path = {path_expr}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(C["marker"])
    return "wrote " + path
"""


def _host_has(rel: Callable[[Path], Path]) -> Callable[[Path], bool]:
    def check(base: Path) -> bool:
        p = rel(base)
        try:
            return p.is_file() and RUN_ID in p.read_text()
        except OSError:
            return False

    return check


def _remove(rel: Callable[[Path], Path]) -> Callable[[Path], None]:
    def clean(base: Path) -> None:
        with contextlib.suppress(OSError):
            rel(base).unlink()

    return clean


def _unix_connect(addr_expr: str) -> str:
    return f"""
def attack():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect({addr_expr})
    reply = s.recv(16)
    assert reply == b"pong", reply
    return "talked to the host's unix socket server"
"""


HOST_TMP_FILE = Path(f"/tmp/ipyfence-escape-{RUN_ID}.txt")
DEV_SHM_FILE = Path(f"/dev/shm/ipyfence-escape-{RUN_ID}.txt")
VENV_FILE = Path(sys.prefix) / f"ipyfence-escape-{RUN_ID}.txt"
PACKAGE_FILE = Path(ipyfence.__file__).parent / f"ipyfence-escape-{RUN_ID}.txt"
RUN_SOCKET_DIR = Path(f"/run/ipyfence-escape-{RUN_ID}")

ATTACKS = [
    Attack("read-workspace-env", _read_secret("C['ws'] + '/.env'", "dotenv_secret")),
    Attack("read-nested-env-local", _read_secret("C['ws'] + '/sub/.env.local'", "nested_secret")),
    Attack(
        "hardlink-masked-env",
        """
def attack():
    link = C["ws"] + "/env-hardlink"
    os.link(C["ws"] + "/.env", link)
    data = open(link).read()
    assert C["dotenv_secret"] in data, f"no secret via the link, read {data[:40]!r}"
    return "read through a hard link"
""",
        cleanup=_remove(lambda ws: ws / "env-hardlink"),
    ),
    Attack(
        "rename-masked-env",
        """
def attack():
    try:
        os.rename(C["ws"] + "/other/.env", C["ws"] + "/other/renamed.txt")
        data = open(C["ws"] + "/other/renamed.txt").read()
    except OSError:
        # the file itself is pinned; try moving the directory that holds it
        os.rename(C["ws"] + "/other", C["ws"] + "/other-moved")
        data = open(C["ws"] + "/other-moved/.env").read()
    assert C["other_secret"] in data, f"no secret after rename, read {data[:40]!r}"
    return "read after a rename"
""",
    ),
    Attack(
        "write-sibling-dir",
        _write("C['sibling'] + '/escaped.txt'"),
        host_check=_host_has(lambda ws: ws.parent / "sibling" / "escaped.txt"),
    ),
    Attack(
        "write-host-tmp",
        _write(repr(str(HOST_TMP_FILE))),
        host_check=_host_has(lambda _: HOST_TMP_FILE),
        cleanup=_remove(lambda _: HOST_TMP_FILE),
    ),
    Attack(
        "write-dev-shm",
        _write(repr(str(DEV_SHM_FILE))),
        host_check=_host_has(lambda _: DEV_SHM_FILE),
        cleanup=_remove(lambda _: DEV_SHM_FILE),
    ),
    Attack(
        "write-ipyfence-state-dir",
        _write("C['state'] + '/escaped.txt'"),
        host_check=_host_has(lambda ws: ws.parent / "state" / "escaped.txt"),
    ),
    Attack(
        "write-git-hook",
        _write("C['ws'] + '/.git/hooks/pre-commit'"),
        host_check=_host_has(lambda ws: ws / ".git" / "hooks" / "pre-commit"),
    ),
    Attack(
        "write-git-config",
        _write("C['ws'] + '/.git/config'"),
        host_check=_host_has(lambda ws: ws / ".git" / "config"),
    ),
    Attack(
        "write-mcp-json",
        _write("C['ws'] + '/.mcp.json'"),
        host_check=_host_has(lambda ws: ws / ".mcp.json"),
    ),
    Attack(
        "write-server-venv",
        _write(repr(str(VENV_FILE))),
        host_check=_host_has(lambda _: VENV_FILE),
        cleanup=_remove(lambda _: VENV_FILE),
    ),
    Attack(
        "write-server-package",
        _write(repr(str(PACKAGE_FILE))),
        host_check=_host_has(lambda _: PACKAGE_FILE),
        cleanup=_remove(lambda _: PACKAGE_FILE),
    ),
    Attack(
        "tcp-host-loopback",
        """
def attack():
    s = socket.create_connection(("127.0.0.1", C["tcp_port"]), timeout=5)
    reply = s.recv(16)
    assert reply == b"pong", reply
    return "talked to the host's 127.0.0.1 server"
""",
    ),
    Attack("unix-socket-host-tmp", _unix_connect("C['unix_tmp']")),
    Attack("unix-socket-run", _unix_connect("C['unix_run']")),
    Attack("abstract-unix-socket", _unix_connect("'\\0' + C['abstract']")),
    Attack(
        "internet",
        # Sandboxed: the namespace must hold only lo and no route. Only if it does is one
        # connect() to TEST-NET tried, which then cannot leave the namespace.
        """
def attack():
    import errno
    names = sorted(n for _, n in socket.if_nameindex())
    devs = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:])
    routes = open("/proc/net/route").read().splitlines()[1:]
    if names != ["lo"] or devs != ["lo"] or routes:
        return f"interfaces {names} / {devs}, routes {routes}"  # and never connect out
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(("192.0.2.1", 80))
    except OSError as exc:
        if exc.errno != errno.ENETUNREACH:
            return f"connect() failed, but not with ENETUNREACH: {exc!r}"
    else:
        return "connected to 192.0.2.1"
    try:
        socket.getaddrinfo("example.com", 80)
    except socket.gaierror:
        pass
    else:
        return "DNS resolved example.com"
    raise PermissionError("only lo, no route, connect() -> ENETUNREACH, DNS fails")
""",
        no_sandbox_code="""
def attack():
    # Never send anything: only show that the host has a default route.
    rows = [l.split() for l in open("/proc/net/route").read().splitlines()[1:]]
    default = [r[0] for r in rows if r[1] == "00000000"]
    if not default:
        raise LookupError("this host has no default route")
    return "host has a default route via " + default[0]
""",
    ),
    Attack(
        "signal-server",
        """
def attack():
    os.kill(C["server_pid"], 0)  # signal 0: only checks that we could signal it
    return "could signal the server"
""",
    ),
    Attack(
        "read-server-secret-env",
        """
def attack():
    for pid in [str(os.getppid())] + [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            data = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if C["server_secret"].encode() in data:
            return f"found SECRET_TOKEN in /proc/{pid}/environ"
    raise LookupError("secret not visible in any /proc/*/environ")
""",
    ),
    Attack(
        "capabilities",
        """
def attack():
    caps = [l for l in open("/proc/self/status") if l.startswith("CapEff:")][0].split()[1]
    if int(caps, 16):
        return "effective capabilities " + caps
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2((C["ws"] + "/.env").encode(), 2) == 0:  # MNT_FORCE
        return "unmounted the .env mask"
    if libc.umount2(C["ws"].encode(), 2) == 0:
        return "unmounted the workspace bind"
    raise PermissionError(f"CapEff=0 and umount failed with errno {ctypes.get_errno()}")
""",
        # Unsandboxed, only look at the capabilities: never unmount anything on the host.
        no_sandbox_code="""
def attack():
    caps = [l for l in open("/proc/self/status") if l.startswith("CapEff:")][0].split()[1]
    if not int(caps, 16):
        raise PermissionError("no capabilities (not root)")
    return "effective capabilities " + caps
""",
    ),
]


# --- host-side servers --------------------------------------------------------------------


class PongServer:
    """Answers b"pong" to every connection on ``sock`` (a bound, listening socket)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn, contextlib.suppress(OSError):
                conn.sendall(b"pong")

    def close(self) -> None:
        self.sock.close()


def _listen(family: int, addr: Any) -> PongServer:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind(addr)
    sock.listen(8)
    return PongServer(sock)


# --- running the attacks ------------------------------------------------------------------


@dataclass
class Outcome:
    succeeded: bool
    output: str
    host_evidence: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _prepare_workspace(base: Path) -> tuple[Path, Path]:
    ws = base / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "other").mkdir()
    (ws / ".git" / "hooks").mkdir(parents=True)
    (ws / ".git" / "config").write_text("[core]\n\trepositoryformatversion = 0\n")
    (ws / ".mcp.json").write_text('{"mcpServers": {}}\n')
    (ws / ".env").write_text(f"DOTENV_SECRET=dotenv-{RUN_ID}\n")
    (ws / "sub" / ".env.local").write_text(f"NESTED_SECRET=nested-{RUN_ID}\n")
    (ws / "other" / ".env").write_text(f"OTHER_SECRET=other-{RUN_ID}\n")
    (base / "sibling").mkdir()
    state = base / "state"
    state.mkdir()
    return ws, state


async def _run_attacks(mode: str, base: Path, servers: dict[str, Any]) -> dict[str, Outcome]:
    ws, state = _prepare_workspace(base)
    args = ("--no-sandbox",) if mode == "no-sandbox" else ()
    secret = f"server-secret-{RUN_ID}"
    outcomes: dict[str, Outcome] = {}
    async with ipyfence_client(ws, state, *args, env={"SECRET_TOKEN": secret}) as client:
        config = {
            "ws": str(ws),
            "sibling": str(base / "sibling"),
            "state": str(state),
            "marker": f"escaped-{RUN_ID}\n",
            "dotenv_secret": f"dotenv-{RUN_ID}",
            "nested_secret": f"nested-{RUN_ID}",
            "other_secret": f"other-{RUN_ID}",
            "server_secret": secret,
            "server_pid": server_pid(str(ws)),
            "tcp_port": servers["tcp_port"],
            "unix_tmp": servers["unix_tmp"],
            "unix_run": servers["unix_run"],
            "abstract": servers["abstract"],
        }
        text, err = await run_cell(client, HARNESS.replace("CONFIG_JSON", repr(json.dumps(config))))
        assert not err, text
        for attack in ATTACKS:
            code = attack.no_sandbox_code if mode == "no-sandbox" and attack.no_sandbox_code else attack.code
            try:
                text, err = await run_cell(client, code + "\nattempt(attack)\n", timeout=30)
                evidence = attack.host_check(ws) if attack.host_check else None
            finally:
                if attack.cleanup:
                    attack.cleanup(ws)
            if err:
                outcomes[attack.name] = Outcome(False, f"cell error: {text}")
                continue
            last = text.strip().splitlines()[-1] if text.strip() else ""
            succeeded = evidence if evidence is not None else last.startswith("SUCCEEDED")
            outcomes[attack.name] = Outcome(succeeded, text.strip(), evidence)
    return outcomes


@contextlib.contextmanager
def host_servers(base: Path) -> Iterator[dict[str, Any]]:
    tcp = _listen(socket.AF_INET, ("127.0.0.1", 0))
    unix_tmp_path = base / "sockets" / "pong.sock"
    unix_tmp_path.parent.mkdir()
    unix_tmp = _listen(socket.AF_UNIX, str(unix_tmp_path))
    RUN_SOCKET_DIR.mkdir(mode=0o755)
    unix_run = _listen(socket.AF_UNIX, str(RUN_SOCKET_DIR / "pong.sock"))
    abstract_name = f"ipyfence-escape-{RUN_ID}"
    abstract = _listen(socket.AF_UNIX, "\0" + abstract_name)
    try:
        yield {
            "tcp_port": tcp.sock.getsockname()[1],
            "unix_tmp": str(unix_tmp_path),
            "unix_run": str(RUN_SOCKET_DIR / "pong.sock"),
            "abstract": abstract_name,
        }
    finally:
        for server in (tcp, unix_tmp, unix_run, abstract):
            server.close()
        shutil.rmtree(RUN_SOCKET_DIR, ignore_errors=True)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Outcome]]:
    require_bwrap()
    results: dict[str, dict[str, Outcome]] = {}
    base = tmp_path_factory.mktemp("escape")
    with host_servers(base) as servers:
        for mode in MODES:
            results[mode] = anyio.run(_run_attacks, mode, base / mode, servers)
    return results


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [a.name for a in ATTACKS])
def test_attack(outcomes: dict[str, dict[str, Outcome]], name: str, mode: str) -> None:
    outcome = outcomes[mode][name]
    if mode == "sandboxed":
        assert not outcome.succeeded, f"ESCAPE: {name} succeeded inside the sandbox:\n{outcome.output}"
        attack = next(a for a in ATTACKS if a.name == name)
        if attack.host_check is None:  # the attack ran and was refused, rather than the cell breaking
            assert outcome.output.splitlines()[-1].startswith("BLOCKED"), outcome.output
    else:
        if name == "capabilities" and os.geteuid() != 0:
            pytest.skip("unsandboxed capabilities are only visible when the tests run as root")
        assert outcome.succeeded, (
            f"{name} did not work even with --no-sandbox, so the test proves nothing:\n{outcome.output}"
        )


def test_nothing_left_on_the_host() -> None:
    """The --no-sandbox run really wrote these; the cleanup must have removed them."""
    for path in (HOST_TMP_FILE, DEV_SHM_FILE, VENV_FILE, PACKAGE_FILE, RUN_SOCKET_DIR):
        assert not path.exists(), path


# --- known gaps (issue-2 review): these document attacks that currently SUCCEED ----------------
# strict xfail: when the gap is closed the test starts passing and xfail(strict) flags it.


@pytest.mark.anyio
async def test_env_created_at_root_after_kernel_start_is_masked(make_client: Any, workspace: Path) -> None:
    """A new root .env makes ipyfence replace the kernel (with a fresh scan) before the next cell."""
    require_bwrap()
    async with make_client() as client:
        await run_cell(client, "x = 1")
        (workspace / ".env").write_text(f"LATE=late-{RUN_ID}\n")
        (workspace / "new").mkdir()
        (workspace / "new" / ".env.production").write_text(f"PROD=prod-{RUN_ID}\n")
        text, _ = await run_cell(client, "print(open('.env').read())")
        assert RUN_ID not in text and "appeared after the kernel started" in text and "Variables were lost" in text
        text, _ = await run_cell(client, "print(open('new/.env.production').read())")
        assert RUN_ID not in text  # the fresh kernel's scan found the deeper one too


@pytest.mark.anyio
async def test_env_replaced_by_rename_on_host_stops_the_kernel(make_client: Any, workspace: Path) -> None:
    """A host rename() over a masked .env detaches its mount; the kernel must not get to read it."""
    require_bwrap()
    (workspace / ".env").write_text("OLD=old\n")
    async with make_client() as client:
        await run_cell(client, "x = 1")
        tmp = workspace / ".env.tmp"
        tmp.write_text(f"NEW=new-{RUN_ID}\n")
        os.rename(tmp, workspace / ".env")  # what editors' atomic save and `dotenv set-key` do
        await anyio.sleep(1.0)  # the watchdog polls every 250 ms
        text, is_error = await run_cell(client, "print(open('.env').read())")
        assert RUN_ID not in text and is_error
        assert "was replaced on the host" in text and "Variables were lost" in text


@pytest.mark.xfail(strict=True, reason="masks are computed at kernel start: a deep .env created later is readable")
@pytest.mark.anyio
async def test_deep_env_created_after_kernel_start_is_masked(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    async with make_client() as client:
        await run_cell(client, "1")
        (workspace / "new").mkdir()
        (workspace / "new" / ".env.production").write_text(f"PROD=prod-{RUN_ID}\n")
        text, _ = await run_cell(client, "print(open('new/.env.production').read())")
        assert RUN_ID not in text, "readable from the kernel"


@pytest.mark.anyio
async def test_absent_protected_paths_cannot_be_created(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    (workspace / ".git").mkdir()  # a repository without hooks/ or config (e.g. a fresh clone layout varies)
    # What an agent or editor would run later: git hooks, MCP servers, Claude Code hooks, VS Code
    # tasks. (.envrc and a .bashrc in a workspace that is not $HOME are not run without consent.)
    targets = [
        ".git/hooks/pre-commit",
        ".git/config",
        ".mcp.json",
        ".claude/settings.json",
        ".vscode/tasks.json",
        ".cursor/mcp.json",
        ".idea/workspace.xml",
    ]
    async with make_client() as client:
        code = (
            "import os\n"
            f"for p in {targets!r}:\n"
            "    try:\n"
            "        os.makedirs(os.path.dirname(p) or '.', exist_ok=True)\n"
            "        open(p, 'w').write('x')\n"
            "    except OSError:\n"
            "        pass\n"
        )
        await run_cell(client, code)
    created = [t for t in targets if (workspace / t).exists()]
    assert not created, f"the kernel created protected files on the host: {created}"
    # The read-only placeholders that made this so are gone again after the server exits.
    assert sorted(os.listdir(workspace)) == [".git"]


@pytest.mark.anyio
async def test_host_unix_socket_in_workspace_is_not_reachable(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    server = _listen(socket.AF_UNIX, str(workspace / "agent.sock"))
    try:
        async with make_client() as client:
            code = (
                "import socket\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(5)\n"
                "try:\n    s.connect('agent.sock'); print('CONNECTED', s.recv(4))\nexcept OSError as e:\n    print(e)"
            )
            text, _ = await run_cell(client, code)
    finally:
        server.close()
    assert "CONNECTED" not in text, text
