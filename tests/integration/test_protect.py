"""The mount plan fails closed, attacked from inside the kernel (real bwrap, real MCP client).

One server per mode, in a workspace whose name is full of glob characters, runs every attack:

- ``.env`` masks still apply although the workspace path is ``ws[1]*?{x}`` (glob escaping);
- a nested repo's parent cannot be renamed away to plant a fresh ``.git`` (pinned ancestors);
- the repo's ``core.hooksPath`` (in-tree, not created yet) cannot be planted (git-config protection);
- a unix socket in the workspace (an agent's) cannot be connected to (masked);
- a ``.env`` the host creates after start is hidden after ``reset()`` (the standby is re-planned);
- a kernel that floods the workspace past the scan limit cannot hide a deep ``.env`` from the next
  kernel's scan (unscanned subtrees are hidden).

With ``--no-sandbox`` each attack succeeds, so the test can fail.
"""

from __future__ import annotations

import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import IPYFENCE, ClientFactory, require_bwrap, require_srt, run_cell, server_env, text_of

pytestmark = pytest.mark.anyio

MODE_ARGS: dict[str, tuple[str, ...]] = {
    "sandboxed": (),
    "no-sandbox": ("--no-sandbox",),
    "srt": ("--sandbox-backend", "srt"),
}

SCAN_LIMIT = 300  # IPYFENCE_SCAN_LIMIT for the server: a flood of 1500 files is past it
SECRET = f"SECRET_{uuid.uuid4().hex}"

HARNESS = """
import os, socket
def attempt(name, fn):
    try:
        fn()
    except BaseException as exc:
        print(name, "BLOCKED", type(exc).__name__, str(exc)[:200])
    else:
        print(name, "SUCCEEDED")
def read(path):
    def go():
        assert SECRET in open(path).read()
    return go
"""

FIRST = """
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect("agent.sock")
    s.close()
def rename_repo():
    os.rename("nest/repo", "nest/repo2")
    os.rename("nest/repo2", "nest/repo")
def rename_parent():
    os.rename("nest", "nest2")
    os.makedirs("nest/repo/.git/hooks")
    open("nest/repo/.git/hooks/pre-commit", "w").write("#!/bin/sh\\necho pwned\\n")
attempt("root_env", read(".env"))
attempt("deep_env", read("sub/.env"))
attempt("socket", connect)
attempt("rename_repo", rename_repo)
attempt("rename_parent", rename_parent)
def plant_hook():
    os.makedirs(".husky", exist_ok=True)
    with open(".husky/pre-commit", "w") as f:
        f.write("#!/bin/sh\\necho pwned\\n")
attempt("hooks_path", plant_hook)
"""

FLOOD = f"""
os.makedirs("flood/d", exist_ok=True)
for i in range({SCAN_LIMIT * 5}):
    open(f"flood/f{{i}}", "w").close()
open("flood/d/.env", "w").write(f"KEY={{SECRET}}\\n")
attempt("late_env", read("late/.env"))
"""

AFTER_FLOOD = """
attempt("flood_env", read("flood/d/.env"))
"""


def outcomes(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(" ", 2)
        if len(parts) >= 2 and parts[1] in ("BLOCKED", "SUCCEEDED"):
            out[parts[0]] = parts[1] + (" " + parts[2] if len(parts) > 2 else "")
    return out


@pytest.fixture
def glob_workspace(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    # srt reads glob characters in paths as globs: ipyfence refuses such a workspace there
    # (tested in test_srt_refuses_glob_workspace), so srt gets a plain name.
    srt_mode = "srt" in request.node.name
    ws = tmp_path / ("ws-plain" if srt_mode else "ws[1]*?{x}")
    (ws / "sub").mkdir(parents=True)
    (ws / ".env").write_text(f"KEY={SECRET}\n")
    (ws / "sub" / ".env").write_text(f"KEY={SECRET}\n")
    (ws / "nest" / "repo" / ".git" / "hooks").mkdir(parents=True)
    # The user's repo runs hooks from an in-tree directory that does not exist yet (husky-style).
    subprocess.run(["git", "init", "-q", str(ws)], check=True, env={"PATH": "/usr/bin:/bin"})
    subprocess.run(["git", "-C", str(ws), "config", "core.hooksPath", ".husky"], check=True)
    agent = socket.socket(socket.AF_UNIX)
    agent.bind(str(ws / "agent.sock"))
    agent.listen(8)  # connect() succeeds from the backlog, no accept loop needed
    try:
        yield ws
    finally:
        agent.close()


@pytest.mark.parametrize("mode", ["sandboxed", "no-sandbox", "srt"])
async def test_plan_fails_closed(mode: str, glob_workspace: Path, make_client: ClientFactory) -> None:
    if mode == "sandboxed":
        require_bwrap()
    if mode == "srt":
        require_srt()
    args = MODE_ARGS[mode]
    ws = glob_workspace
    async with make_client(*args, ws=ws, env={"IPYFENCE_SCAN_LIMIT": str(SCAN_LIMIT)}) as client:
        text, err = await run_cell(client, f"SECRET = {SECRET!r}\n" + HARNESS + FIRST)
        assert not err, text
        first = outcomes(text)
        # Appears on the host after the standby kernel was planned.
        (ws / "late").mkdir()
        (ws / "late" / ".env").write_text(f"KEY={SECRET}\n")
        reset = await client.call_tool("reset", {})
        assert not reset.is_error, text_of(reset)
        text, err = await run_cell(client, f"SECRET = {SECRET!r}\n" + HARNESS + FLOOD)
        assert not err, text
        second = outcomes(text)
        reset = await client.call_tool("reset", {})
        assert not reset.is_error, text_of(reset)
        text, err = await run_cell(client, f"SECRET = {SECRET!r}\n" + HARNESS + AFTER_FLOOD)
        assert not err, text
        third = outcomes(text)
    results = {**first, **second, **third}
    names = ["root_env", "deep_env", "socket", "rename_repo", "rename_parent", "hooks_path", "late_env", "flood_env"]
    assert set(results) == set(names), results
    expected = "SUCCEEDED" if mode == "no-sandbox" else "BLOCKED"
    wrong = {k: v for k, v in results.items() if not v.startswith(expected)}
    assert not wrong, f"{mode}: expected every attack {expected}, got {wrong}"
    if mode != "no-sandbox":
        assert not (ws / "nest2").exists() and (ws / "nest" / "repo" / ".git" / "hooks").is_dir()


HOME_ATTACKS = """
import os
H = HOME_PATH
def write(rel):
    def go():
        path = os.path.join(H, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write("echo pwned\\n")
    return go
def rename_proj():
    os.rename(os.path.join(H, "proj"), os.path.join(H, "proj2"))
    os.rename(os.path.join(H, "proj2"), os.path.join(H, "proj"))
attempt("bash_aliases", write(".bash_aliases"))
attempt("fish", write(".config/fish/config.fish"))
attempt("local_bin", write(".local/bin/git"))
attempt("site_packages", write(".local/lib/python3.12/site-packages/evil.pth"))
attempt("ssh_config", write(".ssh/config"))
attempt("systemd_unit", write(".config/systemd/user/evil.service"))
attempt("home_bin", write("bin/ls"))
attempt("new_top_level", write("newdir/x"))
attempt("rename_proj", rename_proj)
# The kernel's own work in the home still works:
attempt("ok_proj", write("proj/out.txt"))
attempt("ok_notes", write("notes.txt"))
"""

HOME_BLOCKED = [
    "bash_aliases",
    "fish",
    "local_bin",
    "site_packages",
    "ssh_config",
    "systemd_unit",
    "home_bin",
    "new_top_level",
    "rename_proj",
]


@pytest.mark.parametrize("mode", ["sandboxed", "no-sandbox"])
async def test_home_as_workspace_is_sealed(mode: str, tmp_path: Path, make_client: ClientFactory) -> None:
    if mode == "sandboxed":
        require_bwrap()
    home = tmp_path / "home"
    for d in (".config", ".local/bin", "proj/sub/.git", "bin"):
        (home / d).mkdir(parents=True)
    (home / "notes.txt").write_text("notes\n")
    args = ("--no-sandbox",) if mode == "no-sandbox" else ()
    async with make_client(*args, ws=home, env={"HOME": str(home)}) as client:
        code = f"HOME_PATH = {str(home)!r}\nSECRET = ''\n" + HARNESS + HOME_ATTACKS
        text, err = await run_cell(client, code)
        assert not err, text
    results = outcomes(text)
    assert set(results) == {*HOME_BLOCKED, "ok_proj", "ok_notes"}, results
    assert results["ok_proj"].startswith("SUCCEEDED") and results["ok_notes"].startswith("SUCCEEDED")
    expected = "BLOCKED" if mode == "sandboxed" else "SUCCEEDED"
    wrong = {k: results[k] for k in HOME_BLOCKED if not results[k].startswith(expected)}
    assert not wrong, f"{mode}: expected {expected}, got {wrong}"


def test_srt_refuses_glob_workspace(tmp_path: Path, state_dir: Path) -> None:
    """Fail closed: the server does not start at all, with one clear sentence."""
    require_srt()
    ws = tmp_path / "ws[1]"
    ws.mkdir()
    done = subprocess.run(
        [IPYFENCE, "--workspace", str(ws), "--sandbox-backend", "srt"],
        env=server_env(state_dir),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and "glob characters" in done.stderr, done.stderr
