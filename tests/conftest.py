"""Shared fixtures: real ipyfence servers over stdio, driven by the SDK's real MCP client."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

IPYFENCE = str(Path(sys.executable).with_name("ipyfence"))
IN_CI = os.environ.get("CI", "").lower() == "true"


def require_bwrap() -> None:
    """Sandbox tests FAIL under CI=true when bwrap is missing; locally they skip with a hint."""
    if shutil.which("bwrap"):
        return
    if IN_CI:
        pytest.fail("bwrap is not installed, so the sandbox cannot be tested (apt-get install bubblewrap)")
    pytest.skip("bwrap not installed (apt-get install bubblewrap); under CI=true this fails")


def require_srt() -> None:
    if shutil.which("srt"):
        return
    if IN_CI:
        pytest.fail("srt is not installed (npm install -g @anthropic-ai/sandbox-runtime)")
    pytest.skip("srt not installed; under CI=true this fails")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A private IPYFENCE_STATE_DIR so tests never touch ~/.local/state."""
    d = tmp_path / "state"
    d.mkdir()
    return d


def server_env(state_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_ENV_")}
    env["IPYFENCE_STATE_DIR"] = str(state_dir)
    env.update(extra or {})
    return env


@asynccontextmanager
async def ipyfence_client(
    workspace: Path,
    state_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Client]:
    """Start `ipyfence --workspace WS ARGS...` over stdio and yield a connected client."""
    params = StdioServerParameters(
        command=IPYFENCE,
        args=["--workspace", str(workspace), *args],
        env=server_env(state_dir, env),
    )
    async with Client(params) as client:
        yield client


ClientFactory = Callable[..., Any]


@pytest.fixture
def make_client(workspace: Path, state_dir: Path) -> ClientFactory:
    """`async with make_client("--no-sandbox", env={...}) as c:` for the test's workspace."""

    def factory(*args: str, env: dict[str, str] | None = None, ws: Path | None = None) -> Any:
        return ipyfence_client(ws or workspace, state_dir, *args, env=env)

    return factory


def text_of(result: Any) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


async def run_cell(client: Client, code: str, **kw: Any) -> tuple[str, bool]:
    result = await client.call_tool("execute_ipython_cell", {"code": code, **kw})
    return text_of(result), bool(result.is_error)


def allow_unix_sockets(tmp_path: Path) -> tuple[str, ...]:
    """CLI args for a policy that lets the kernel create unix sockets (``network.allowAllUnixSockets``).

    By default the kernel cannot create any after start-up; tests that attack the host-side bridge
    rules with raw sockets need this to reach the bridge at all."""
    cfg = tmp_path / "allow-unix.json"
    cfg.write_text('{"network": {"allowAllUnixSockets": true}}')
    return ("--sandbox-config", str(cfg))
