"""A second, independent MCP client: the npm MCP Inspector CLI drives the real server."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI, IPYFENCE, require_bwrap, server_env


def inspector(workspace: Path, state_dir: Path, *method: str) -> dict[str, object]:
    binary = shutil.which("mcp-inspector")
    if binary is None:
        if IN_CI:
            pytest.fail("mcp-inspector not installed (npm install -g @modelcontextprotocol/inspector)")
        pytest.skip("mcp-inspector not installed")
    argv = [binary, "--cli", IPYFENCE, "--workspace", str(workspace), *method]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env=server_env(state_dir), stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_inspector_lists_the_ipybox_tools_and_package_tools(workspace: Path, state_dir: Path) -> None:
    require_bwrap()
    listed = inspector(workspace, state_dir, "--method", "tools/list")
    names = {tool["name"] for tool in listed["tools"]}  # type: ignore[attr-defined]
    ipybox = {"execute_ipython_cell", "register_mcp_server", "install_package", "reset"}
    assert names == ipybox | {"list_packages", "uninstall_package"}
    execute = next(t for t in listed["tools"] if t["name"] == "execute_ipython_cell")  # type: ignore[attr-defined]
    props = execute["inputSchema"]["properties"]
    assert props["timeout"]["default"] == 120 and props["max_output_chars"]["default"] == 5000


def test_inspector_runs_a_cell_and_sees_the_env_file_blocked(workspace: Path, state_dir: Path) -> None:
    require_bwrap()
    (workspace / ".env").write_text("TOKEN=s3cret\n")
    ok = inspector(
        workspace, state_dir, "--method", "tools/call", "--tool-name", "execute_ipython_cell",
        "--tool-arg", "code=print(6 * 7)",
    )  # fmt: skip
    assert ok["isError"] is False and ok["content"][0]["text"] == "42\n"  # type: ignore[index]
    blocked = inspector(
        workspace, state_dir, "--method", "tools/call", "--tool-name", "execute_ipython_cell",
        "--tool-arg", "code=print(open('.env').read())",
    )  # fmt: skip
    assert blocked["isError"] is True
    text = blocked["content"][0]["text"]  # type: ignore[index]
    assert "Permission denied" in text and "s3cret" not in text
