"""Issue 10: the host never runs or trusts what the kernel can write.

Each attack is planted from inside the (real, bwrap) kernel over the real MCP client, then the host
action that would trigger it runs (a registered server is (re)started, the server restarts and reads
the workspace .env). Because these rules hold on the host side whatever the sandbox does, the
control for each one shows that the plant itself works when the rule is absent: the same server
started the old way (cwd = workspace), python-dotenv's default interpolation of the same file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from dotenv import dotenv_values

from tests.conftest import require_bwrap, run_cell, text_of

pytestmark = pytest.mark.anyio

TIME_PARAMS = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}


def _plant_code(marker: Path) -> str:
    """A cell that plants ./mcp_server_time/__main__.py: on import it would write ``marker`` (outside)."""
    payload = f"open({str(marker)!r}, 'w').write('planted code ran on the host')\n"
    return (
        "import os\n"
        "os.makedirs('mcp_server_time', exist_ok=True)\n"
        "open('mcp_server_time/__init__.py', 'w').write('')\n"
        f"open('mcp_server_time/__main__.py', 'w').write({payload!r})\n"
    )


async def test_registered_server_never_starts_from_the_workspace(
    make_client: Any, workspace: Path, tmp_path: Path
) -> None:
    require_bwrap()
    marker = tmp_path / f"pwned-{uuid.uuid4().hex[:8]}"
    async with make_client() as client:
        text, err = await run_cell(client, _plant_code(marker))
        assert not err, text
        result = await client.call_tool("register_mcp_server", {"server_name": "clock", "server_params": TIME_PARAMS})
        assert not result.is_error, text_of(result)
        text, err = await run_cell(
            client, "from mcptools.clock.get_current_time import Params, run\nprint(run(Params(timezone='UTC')))"
        )
        assert not err and "UTC" in text, text
    # A new server (same state dir) restarts the registered server on the kernel's first call.
    async with make_client() as client:
        text, err = await run_cell(
            client, "from mcptools.clock.get_current_time import Params, run\nprint(run(Params(timezone='UTC')))"
        )
        assert not err and "UTC" in text, text
    assert not marker.exists(), "the registered server ran kernel-planted code on the host"
    # Control: started the old way, with the workspace as its cwd, the same server runs the plant.
    subprocess.run([sys.executable, "-m", "mcp_server_time"], cwd=workspace, timeout=60, capture_output=True)
    assert marker.exists(), "the plant would not have worked: the test proves nothing"


async def test_cwd_in_the_workspace_needs_the_opt_in(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    params = {**TIME_PARAMS, "cwd": str(workspace)}
    async with make_client() as client:
        result = await client.call_tool("register_mcp_server", {"server_name": "clock", "server_params": params})
        text = text_of(result)
        assert result.is_error and "--allow-workspace-servers" in text and "unsandboxed" in text, text
        relative = {"command": "./node_modules/.bin/server"}
        result = await client.call_tool("register_mcp_server", {"server_name": "rel", "server_params": relative})
        assert result.is_error and "relative path" in text_of(result)
        sneaky = {**TIME_PARAMS, "env": {"PYTHONPATH": str(workspace)}}
        result = await client.call_tool("register_mcp_server", {"server_name": "pp", "server_params": sneaky})
        assert result.is_error and "env PYTHONPATH" in text_of(result)
    async with make_client("--allow-workspace-servers") as client:
        result = await client.call_tool("register_mcp_server", {"server_name": "clock", "server_params": params})
        assert not result.is_error, text_of(result)


async def test_kernel_written_dotenv_is_literal_data(make_client: Any, workspace: Path) -> None:
    """The kernel creates .env (absent at start, so not masked) asking for the server's secret."""
    require_bwrap()
    secret = f"s3cret-{uuid.uuid4().hex[:8]}"
    env = {"SOME_SERVER_SECRET": secret}
    async with make_client(env=env) as client:
        text, err = await run_cell(client, "open('.env', 'w').write('KERNEL_ENV_LEAK=${SOME_SERVER_SECRET}\\n')")
        assert not err, text
    async with make_client(env=env) as client:
        text, _ = await run_cell(client, "import os; print(repr(os.environ.get('LEAK')))")
        assert secret not in text and "'${SOME_SERVER_SECRET}'" in text, text
    # Control: python-dotenv's default (interpolation on) would have handed the kernel the secret.
    os.environ["SOME_SERVER_SECRET"] = secret
    try:
        assert dotenv_values(workspace / ".env")["KERNEL_ENV_LEAK"] == secret
    finally:
        del os.environ["SOME_SERVER_SECRET"]


async def test_host_writes_never_follow_kernel_made_symlinks(make_client: Any, workspace: Path, tmp_path: Path) -> None:
    """The kernel points mcptools/, mcptools/__init__.py and mcptools/<name> at places outside the
    workspace; register_mcp_server must refuse or replace the links, never write through them."""
    require_bwrap()
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    victim = outside / "victim.py"
    victim.write_text("original\n")
    async with make_client() as client:
        text, err = await run_cell(client, f"import os; os.symlink({str(outside / 'dir')!r}, 'mcptools')")
        assert not err, text
        result = await client.call_tool("register_mcp_server", {"server_name": "clock", "server_params": TIME_PARAMS})
        assert result.is_error and "symlink" in text_of(result), text_of(result)
        assert list((outside / "dir").iterdir()) == [], "code generation wrote through the mcptools symlink"
        code = (
            "import os\n"
            "os.unlink('mcptools'); os.mkdir('mcptools')\n"
            f"os.symlink({str(victim)!r}, 'mcptools/__init__.py')\n"
            f"os.symlink({str(outside / 'dir')!r}, 'mcptools/clock')\n"
        )
        text, err = await run_cell(client, code)
        assert not err, text
        result = await client.call_tool("register_mcp_server", {"server_name": "clock", "server_params": TIME_PARAMS})
        assert not result.is_error, text_of(result)
        text, err = await run_cell(
            client, "from mcptools.clock.get_current_time import Params, run\nprint(run(Params(timezone='UTC')))"
        )
        assert not err and "UTC" in text, text
    assert victim.read_text() == "original\n" and list((outside / "dir").iterdir()) == []
    assert not (workspace / "mcptools" / "clock").is_symlink()
    # Control: a plain host write through the planted link lands outside the workspace.
    (workspace / "link").symlink_to(victim)
    (workspace / "link").write_text("through the link\n")
    assert victim.read_text() == "through the link\n"


def test_runtime_dirs_never_trust_a_shared_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another local user pre-creates /tmp/ipyfence-<uid> (as a link, or owned by them) and plants a
    stale-looking runtime dir whose placeholders file lists a victim: nothing is used or removed."""
    from ipyfence import runtime

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(runtime, "shared_tmp_dirs", lambda: [tmp])
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    victim = tmp_path / "victim"
    victim.mkdir()
    placeholder = tmp_path / "ws" / ".vscode"  # an empty placeholder a dead server left in its workspace
    placeholder.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shared = tmp / f"ipyfence-{os.geteuid()}"
    shared.symlink_to(elsewhere)
    root = runtime.make_runtime_root()
    assert shared not in root.parents and list(elsewhere.iterdir()) == []
    shared.unlink()
    shared.mkdir(mode=0o700)
    stale = shared / "ipyfence-stale"
    stale.mkdir()
    (stale / runtime.OWNER_FILE).write_text("999999999")  # a dead pid
    (stale / runtime.PLACEHOLDERS_FILE).write_text(f"{victim}\n{placeholder}\n")
    os.chown(shared, 65534, 65534)  # made by someone else
    root = runtime.make_runtime_root()
    assert root.parent != shared and victim.is_dir() and stale.is_dir() and placeholder.is_dir()
    # Control: once the parent is really ours, a dead server's dir is cleaned with its empty placeholder;
    # a path that is not a placeholder name stays, whatever the file lists.
    os.chown(shared, os.geteuid(), os.getegid())
    root = runtime.make_runtime_root()
    assert root.parent == shared and not stale.exists() and not placeholder.exists() and victim.is_dir()


@pytest.mark.parametrize("mode", ["bwrap", "srt", "no-sandbox"])
async def test_kernel_start_never_imports_from_the_workspace(make_client: Any, workspace: Path, mode: str) -> None:
    """Class 2: modules planted in the workspace that a kernel start would import (the launcher,
    site hooks, IPython's own dependencies) never run when reset() starts the next kernel."""
    from tests.conftest import require_srt

    require_bwrap()
    if mode == "srt":
        require_srt()
    names = ["ipykernel_launcher", "sitecustomize", "usercustomize", "traitlets", "ipyfence"]
    plant = "import os\n" + "".join(
        f"open('{n}.py', 'w').write(\"open('planted-{n}.ran', 'w').write('x')\\n\")\n" for n in names
    )
    plant += "open('mymodule.py', 'w').write('VALUE = 42\\n')\n"
    args = {"bwrap": (), "srt": ("--sandbox-backend", "srt"), "no-sandbox": ("--no-sandbox",)}[mode]
    async with make_client(*args) as client:
        text, err = await run_cell(client, plant)
        assert not err, text
        result = await client.call_tool("reset", {})
        assert not result.is_error, text_of(result)
        await client.call_tool("reset", {})  # the standby too: both later kernels start clean
        text, err = await run_cell(client, "import os, mymodule; print(os.getcwd(), mymodule.VALUE)")
        assert not err and f"{workspace} 42" in text, text
    ran = sorted(p.name for p in workspace.glob("planted-*.ran"))
    assert ran == [], f"planted modules ran at kernel start: {ran}"
    # Control: Python started the old way (cwd = workspace) runs the plant.
    subprocess.run([sys.executable, "-c", "import sitecustomize"], cwd=workspace, timeout=60, check=False)
    assert (workspace / "planted-sitecustomize.ran").exists()
