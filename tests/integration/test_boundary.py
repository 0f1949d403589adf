"""Issue 11: holes in the boundary itself, attacked from inside the kernel as root.

One server per mode runs every attack; each must fail sandboxed (bwrap) and succeed with
``--no-sandbox`` (the control that shows the attack works). The server is started by a small
wrapper that first joins a fresh session keyring holding a secret key, so the keyring attack has
something real to read, exactly as a user's login keyring would be inherited.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from tests.conftest import IPYFENCE, require_bwrap, require_srt, run_cell, server_env

pytestmark = pytest.mark.anyio
KEY_SECRET = f"key-{uuid.uuid4().hex[:12]}"

# Joins a new session keyring with one `user` key, then becomes ipyfence (the keyring is inherited).
WRAPPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {"x86_64": (250, 248), "aarch64": (219, 217)}[os.uname().machine]
assert libc.syscall(NR[0], 1, None) >= 0, "KEYCTL_JOIN_SESSION_KEYRING failed"
secret = sys.argv[1].encode()
assert libc.syscall(NR[1], b"user", b"ipyfence-test", secret, len(secret), -3) >= 0, "add_key failed"
os.execv(sys.argv[2], sys.argv[2:])
"""

ATTACKS = r"""
import ctypes, os, socket
def attempt(name, fn):
    try:
        print(name, "SUCCEEDED", repr(fn())[:80])
    except BaseException as exc:
        print(name, "BLOCKED", type(exc).__name__, str(exc)[:120])
def unix(path):
    def go():
        s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(path)
        return s.recv(4)
    return go
def sysctl():
    path = "/proc/sys/kernel/printk_ratelimit"
    value = open(path).read()
    with open(path, "w") as f:  # the same value back: nothing changes on the host
        f.write(value)
    return "wrote " + path
def keyring():
    libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long
    search, read = {"x86_64": (250, 250), "aarch64": (219, 219)}[os.uname().machine]
    key = libc.syscall(search, 10, -3, b"user", b"ipyfence-test", 0)
    if key < 0:
        raise PermissionError(os.strerror(ctypes.get_errno()))
    buf = ctypes.create_string_buffer(256)
    n = libc.syscall(read, 11, key, buf, 256)
    if n < 0:
        raise PermissionError(os.strerror(ctypes.get_errno()))
    return buf.raw[:n].decode()
def private_dir():
    d = os.path.dirname(os.environ["IPYFENCE_BRIDGE_SOCKET"])
    with open(os.path.join(d, "filler.bin"), "wb") as f:
        f.write(b"x" * 1024)
    return "wrote into " + d
attempt("A1-unix-in-workspace", unix("agent.sock"))
attempt("A2-unix-elsewhere", unix(HOME_SOCKET))
attempt("A3-sysctl", sysctl)
attempt("A4-keyring", keyring)
attempt("A5-private-dir", private_dir)
"""


class Pong:
    """A unix socket server that answers every connection with b'pong'."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.sendall(b"pong")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def sockets(workspace: Path, tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home" / ".ssh"  # like an ssh-agent socket under $HOME, outside any hidden dir
    home.mkdir(parents=True)
    servers = [Pong(workspace / "agent.sock"), Pong(home / "agent.sock")]
    yield home / "agent.sock"
    for server in servers:
        server.close()


async def _run(workspace: Path, state_dir: Path, home_socket: Path, *args: str) -> dict[str, str]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-c", WRAPPER, KEY_SECRET, IPYFENCE, "--workspace", str(workspace), *args],
        env=server_env(state_dir),
    )
    async with Client(params) as client:
        text, err = await run_cell(client, ATTACKS.replace("HOME_SOCKET", repr(str(home_socket))))
        assert not err, text
    return {line.split()[0]: line for line in text.splitlines() if line.startswith("A")}


@pytest.mark.parametrize("mode", ["sandboxed", "srt", "no-sandbox"])
async def test_boundary_attacks(workspace: Path, state_dir: Path, sockets: Path, mode: str) -> None:
    """bwrap and srt alike: under srt the /proc binds are srt's to make, so Landlock (writes only beneath
    the writable roots) and the in-kernel seccomp filter are what stop these attacks there."""
    require_bwrap()
    if mode == "srt":
        require_srt()
    args = {"sandboxed": (), "srt": ("--sandbox-backend", "srt"), "no-sandbox": ("--no-sandbox",)}[mode]
    outcome = await _run(workspace, state_dir, sockets, *args)
    assert len(outcome) == 5, outcome
    if mode != "no-sandbox":
        blocked = {k: v for k, v in outcome.items() if "BLOCKED" not in v}
        assert not blocked, blocked
        assert KEY_SECRET not in "".join(outcome.values())
    else:
        worked = {k: v for k, v in outcome.items() if "SUCCEEDED" not in v}
        assert not worked, worked  # every attack works unsandboxed: the test can fail
        assert KEY_SECRET in outcome["A4-keyring"]


READER = r"""
import os, sys
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():  # not the needles on this reader's own command line
        try:
            data = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        found += [n for n in sys.argv[1:] if n.encode() in data]
print(sorted(set(found)))
"""


def _read_cmdlines_as_nobody(*needles: str) -> list[str]:
    """Which needles any process's command line shows to another local user (uid 65534)."""
    import ast
    import subprocess

    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-I", "-c", READER]
    out = subprocess.run([*argv, *needles], capture_output=True, text=True, timeout=60, check=True).stdout
    return list(ast.literal_eval(out.strip()))


async def test_secrets_are_not_on_any_command_line(make_client: Any) -> None:
    import subprocess

    require_bwrap()
    secret = f"kernel-secret-{uuid.uuid4().hex[:10]}"
    async with make_client(env={"KERNEL_ENV_API_TOKEN": secret}) as client:
        text, err = await run_cell(
            client, "import os; print(os.environ['API_TOKEN'], os.environ['IPYFENCE_BRIDGE_TOKEN'])"
        )
        assert not err and secret in text, text
        token = text.split()[1]
        await client.call_tool("reset", {})  # a second kernel and a standby: more command lines to read
        assert _read_cmdlines_as_nobody(secret, token) == []
    # Control: the same reader does see a secret that is on a command line.
    visible = f"argv-secret-{uuid.uuid4().hex[:10]}"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", visible]) as proc:
        try:
            assert _read_cmdlines_as_nobody(visible) == [visible]
        finally:
            proc.kill()


@pytest.mark.parametrize("mode", ["sandboxed", "no-sandbox"])
async def test_flooded_workspace_fails_closed_and_standby_is_replanned(
    make_client: Any, workspace: Path, mode: str
) -> None:
    """A kernel floods the workspace so the next scan cannot finish, and hides a secret deeper; a
    secret also appears on the host after the standby kernel was planned. Neither is readable."""
    require_bwrap()
    args = ("--no-sandbox",) if mode == "no-sandbox" else ()
    async with make_client(*args) as client:
        (workspace / "late").mkdir()
        (workspace / "late" / ".env").write_text(f"LATE={KEY_SECRET}\n")  # after the standby was planned
        await client.call_tool("reset", {})
        text, _ = await run_cell(client, "print(open('late/.env').read())")
        assert (KEY_SECRET in text) == (mode == "no-sandbox"), text
    async with make_client(*args, env={"IPYFENCE_SCAN_LIMIT": "40"}) as client:
        flood = "import os\nos.makedirs('flood', exist_ok=True)\nfor i in range(60): open(f'flood/{i}', 'w').close()\n"
        text, err = await run_cell(
            client, flood + f"os.makedirs('deep/x', exist_ok=True); open('deep/x/.env', 'w').write('S={KEY_SECRET}')"
        )
        assert not err, text
        result = await client.call_tool("reset", {})
        text, _ = await run_cell(client, "print(open('deep/x/.env').read())")
        if mode == "sandboxed":  # the unfinished subtrees are hidden (or, past a cap, the kernel refuses)
            assert KEY_SECRET not in text, (result, text)
        else:
            assert KEY_SECRET in text, text  # the control: unmasked, the deeper secret is readable


@pytest.mark.parametrize("mode", ["sandboxed", "no-sandbox"])
async def test_nested_git_cannot_be_replaced_by_renaming_its_parent(
    make_client: Any, workspace: Path, mode: str
) -> None:
    """Rename `sub` (its read-only `sub/.git` moves with it), then plant `sub/.git/hooks/pre-commit`."""
    require_bwrap()
    (workspace / "sub" / ".git").mkdir(parents=True)
    (workspace / "sub" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    code = (
        "import os\n"
        "try:\n"
        "    os.rename('sub', 'sub2'); os.makedirs('sub/.git/hooks')\n"
        "    open('sub/.git/hooks/pre-commit', 'w').write('#!/bin/sh\\necho pwned\\n')\n"
        "    print('PLANTED')\n"
        "except OSError as e:\n"
        "    print('REFUSED', e)\n"
    )
    async with make_client(*(("--no-sandbox",) if mode == "no-sandbox" else ())) as client:
        text, _ = await run_cell(client, code)
    planted = (workspace / "sub" / ".git" / "hooks" / "pre-commit").exists()
    assert planted == (mode == "no-sandbox"), text
    assert ("PLANTED" in text) == (mode == "no-sandbox"), text


@pytest.mark.parametrize("mode", ["sandboxed", "no-sandbox"])
async def test_git_hooks_path_and_includes_in_the_tree_are_protected(
    make_client: Any, workspace: Path, mode: str
) -> None:
    """`core.hooksPath = .githooks` (husky style) and an included config file in the work tree: the
    kernel must not create a hook there or rewrite the include (git would run/read them on the host)."""
    import subprocess

    require_bwrap()
    subprocess.run(["git", "init", "-q", str(workspace)], check=True)
    subprocess.run(["git", "-C", str(workspace), "config", "core.hooksPath", ".githooks"], check=True)
    subprocess.run(["git", "-C", str(workspace), "config", "include.path", "../team.gitconfig"], check=True)
    (workspace / "team.gitconfig").write_text("[user]\n\tname = team\n")
    code = (
        "import os\n"
        "for path, data in (('.githooks/pre-commit', '#!/bin/sh\\necho pwned\\n'),\n"
        "                   ('team.gitconfig', '[core]\\n\\tfsmonitor = echo pwned\\n')):\n"
        "    try:\n"
        "        os.makedirs(os.path.dirname(path) or '.', exist_ok=True); open(path, 'w').write(data)\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('REFUSED', path, e)\n"
    )
    async with make_client(*(("--no-sandbox",) if mode == "no-sandbox" else ())) as client:
        text, _ = await run_cell(client, code)
    wrote = text.count("WROTE")
    assert wrote == (2 if mode == "no-sandbox" else 0), text
    assert ("fsmonitor" in (workspace / "team.gitconfig").read_text()) == (mode == "no-sandbox")


@pytest.mark.parametrize("mode", ["sandboxed", "no-sandbox"])
async def test_home_as_workspace_protects_every_startup_file(make_client: Any, tmp_path: Path, mode: str) -> None:
    """--workspace ~: new or changed start-up files anywhere the shell, git, ssh, systemd or a desktop
    would read them are refused; ordinary project directories stay writable."""
    require_bwrap()
    home = tmp_path / "home"
    (home / "proj").mkdir(parents=True)
    (home / ".config").mkdir()
    (home / ".bashrc").write_text("# mine\n")
    targets = [
        ".bash_aliases",
        ".bashrc",
        ".config/autostart/x.desktop",
        ".config/git/config",
        ".local/bin/ls",
        ".ssh/config",
        "bin/ls",
        "new-top-level-file",
    ]
    code = (
        "import os\n"
        f"for t in {targets!r}:\n"
        "    p = os.path.join(os.path.expanduser(HOME), t)\n"
        "    try:\n"
        "        os.makedirs(os.path.dirname(p), exist_ok=True); open(p, 'a').write('pwned')\n"
        "        print('WROTE', t)\n"
        "    except OSError as e:\n"
        "        print('REFUSED', t, type(e).__name__)\n"
        "open(os.path.join(HOME, 'proj', 'work.txt'), 'w').write('ok'); print('PROJECT OK')\n"
    ).replace("HOME", repr(str(home)))
    args = ("--no-sandbox",) if mode == "no-sandbox" else ()
    async with make_client(*args, ws=home, env={"HOME": str(home)}) as client:
        text, _ = await run_cell(client, code)
    assert "PROJECT OK" in text, text
    wrote = text.count("WROTE ")
    assert wrote == (len(targets) if mode == "no-sandbox" else 0), text


async def test_kernel_made_env_symlink_cannot_stop_later_kernels(make_client: Any, workspace: Path) -> None:
    """A `.env` symlink the kernel plants (to /dev/zero) must not make every later kernel fail to start."""
    require_bwrap()
    async with make_client() as client:
        text, err = await run_cell(
            client, "import os; os.symlink('/dev/zero', '.env'); os.symlink('/dev/zero', 'sub.env')"
        )
        assert not err, text
        await client.call_tool("reset", {})
        text, err = await run_cell(client, "print('alive', 6 * 7)")
        assert not err and "alive 42" in text, text
    assert (workspace / ".env").is_symlink()  # the plant is real


def test_helpers_are_never_found_in_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `bwrap` planted in the workspace (the server's cwd, or `.` on PATH) is never the one used."""
    import os

    from ipyfence.sandbox.launch import find_bwrap

    planted = tmp_path / "bwrap"
    planted.write_text("#!/bin/sh\nexit 0\n")
    planted.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f".::{tmp_path}:{os.environ['PATH']}")
    found = find_bwrap()
    assert found != str(planted) and not found.startswith(str(tmp_path)), found
