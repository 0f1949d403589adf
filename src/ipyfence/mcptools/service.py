"""McpToolsService: register_mcp_server, the generated ``mcptools/`` packages and the bridge.

Wired into server.py/kernel.py: ``start`` on server start, ``register`` for the tool,
``attach_kernel``/``detach_kernel`` around each kernel, ``aclose`` at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import stat
from pathlib import Path
from typing import Any

import anyio.to_thread
from mcp_types import CallToolResult, Tool

from ipyfence import safefs
from ipyfence.errors import BridgeError, RegistrationError, UnsafePathError
from ipyfence.mcptools import hostlaunch
from ipyfence.mcptools.bridge import Bridge
from ipyfence.mcptools.codegen import GeneratedPackage, ToolSpec, generate_package
from ipyfence.mcptools.params import StdioParams, resolve, validate_server_name, validate_server_params
from ipyfence.mcptools.registry import Registration, Registry
from ipyfence.mcptools.sessions import ConnectError, ServerConnection
from ipyfence.policy import is_glob
from ipyfence.sandbox.launch import BRIDGE_SOCKET
from ipyfence.settings import Settings

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 30.0  # seconds to start a server and finish the MCP handshake
TIMEOUT_ENV = "IPYFENCE_MCP_CONNECT_TIMEOUT"  # override (e.g. in tests)
PACKAGE_DIR = "mcptools"
INIT_SOURCE = '"""Python APIs of MCP servers registered with ipyfence (generated)."""\n'


class McpToolsService:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = Registry(settings.state_dir / "registry.json")
        self.bridge = Bridge(self.call)
        self.connections: dict[str, ServerConnection] = {}
        self._register_lock = asyncio.Lock()
        try:
            self.connect_timeout = float(settings.host_env.get(TIMEOUT_ENV, CONNECT_TIMEOUT))
        except ValueError:
            self.connect_timeout = CONNECT_TIMEOUT

    async def start(self) -> None:
        """Load the registry; servers are connected lazily, on their first call."""
        self.registry.load()

    # -- registration --------------------------------------------------------------------

    def _connection(self, name: str, raw_params: dict[str, Any]) -> ServerConnection:
        params = resolve(raw_params, self.settings.host_env)
        cwd = self.settings.state_dir
        if isinstance(params, StdioParams):
            private = self.settings.state_dir / "server-cwd" / name
            launch = hostlaunch.check(
                name,
                params.command,
                params.env,
                params.cwd,
                workspace=self.settings.workspace,
                roots=[p for p in self.settings.policy.filesystem.allow_write if not is_glob(p)],
                private_dir=private,
                allow_workspace=self.settings.allow_workspace_servers,
                host_path=os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            )
            private.mkdir(mode=0o700, parents=True, exist_ok=True)
            params = dataclasses.replace(params, env={**params.env, "PATH": launch.path})
            cwd = launch.cwd
        return ServerConnection(name, params, cwd, self.connect_timeout)

    async def register(self, server_name: str, server_params: dict[str, Any]) -> list[str]:
        name = validate_server_name(server_name)
        raw = validate_server_params(server_params)
        conn = self._connection(name, raw)  # ToolInputError for unknown ${VAR}s
        async with self._register_lock:
            try:
                tools = await asyncio.wait_for(conn.list_tools(), 2 * self.connect_timeout + 15)
                specs = [_spec(t) for t in tools]
                package = await anyio.to_thread.run_sync(generate_package, name, specs)
                self._install(name, package)
            except ConnectError as exc:
                await conn.aclose()
                raise RegistrationError(f"cannot connect to MCP server {name!r}: {exc.with_stderr()}") from None
            except TimeoutError:
                await conn.aclose()
                raise RegistrationError(f"MCP server {name!r} did not list its tools in time") from None
            except RegistrationError as exc:
                await conn.aclose()
                raise RegistrationError(f"cannot generate the API of MCP server {name!r}: {exc}") from None
            except Exception as exc:
                await conn.aclose()
                detail = f"{type(exc).__name__}: {exc}"
                raise RegistrationError(f"registering MCP server {name!r} failed: {detail}") from None
            old = self.connections.pop(name, None)
            self.connections[name] = conn  # keep the session we just listed with: the first call is fast
            allowed = {t: m.rsplit(".", 1)[1] for m, t in package.modules.items()}
            self.registry.servers[name] = Registration(name, raw, allowed)
            self.registry.save()
        if old is not None:
            await old.aclose()
        return sorted(package.modules)

    def _install(self, name: str, package: GeneratedPackage) -> None:
        """Write mcptools/<name>/ next to the old one, then swap: a failure leaves the old API intact.

        The kernel can plant symlinks anywhere in mcptools/ between two registrations, so every step
        is relative to a directory descriptor opened without following links (``safefs``).
        """
        try:
            with safefs.opened_dir(self.settings.workspace, PACKAGE_DIR, create=True) as root:
                init = safefs.lstat_or_none(root, "__init__.py")
                if init is None or not stat.S_ISREG(init.st_mode):
                    safefs.write_file(root, "__init__.py", INIT_SOURCE.encode())
                tmp = safefs.make_temp_dir(root, f".tmp-{name}-", mode=0o755)
                try:
                    with safefs.opened_dir(root, tmp) as tmp_fd:
                        for filename, source in package.files.items():
                            safefs.write_file(tmp_fd, filename, source.encode("utf-8"))
                    old = safefs.lstat_or_none(root, name)
                    if old is not None and stat.S_ISDIR(old.st_mode):
                        trash = safefs.make_temp_dir(root, f".old-{name}-")
                        os.rename(name, f"{trash}/{name}", src_dir_fd=root, dst_dir_fd=root)
                        os.rename(tmp, name, src_dir_fd=root, dst_dir_fd=root)
                        safefs.remove(root, trash)
                    else:
                        if old is not None:  # a file or a symlink: the entry itself goes, nothing it points to
                            os.unlink(name, dir_fd=root)
                        os.rename(tmp, name, src_dir_fd=root, dst_dir_fd=root)
                except BaseException:
                    with contextlib.suppress(OSError):
                        safefs.remove(root, tmp)
                    raise
        except (OSError, UnsafePathError) as exc:
            raise RegistrationError(f"cannot write {PACKAGE_DIR}/{name} in the workspace: {exc}") from None

    # -- the bridge ----------------------------------------------------------------------

    async def call(self, server: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Dispatch one kernel request: only registered servers and their listed tools."""
        reg = self.registry.servers.get(server)
        if reg is None:
            return {"ok": False, "kind": "refused", "error": f"MCP server {server!r} is not registered"}
        if tool not in reg.tools:
            return {"ok": False, "kind": "refused", "error": f"MCP server {server!r} has no tool {tool!r}"}
        conn = self.connections.get(server)
        if conn is None:
            try:
                conn = self._connection(server, reg.params)
            except Exception as exc:  # e.g. a ${VAR} that is no longer set
                raise BridgeError(f"cannot prepare MCP server {server!r}: {exc}") from None
            self.connections[server] = conn
        result = await conn.call_tool(tool, arguments)
        return _result_json(result)

    async def attach_kernel(self, kernel_dir: Path, token: str) -> None:
        await self.bridge.attach(kernel_dir / BRIDGE_SOCKET, token)

    async def detach_kernel(self, kernel_dir: Path) -> None:
        await self.bridge.detach(kernel_dir)

    async def aclose(self) -> None:
        await self.bridge.aclose()
        conns, self.connections = list(self.connections.values()), {}
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.aclose()


def _spec(tool: Tool) -> ToolSpec:
    return ToolSpec(
        name=tool.name,
        description=tool.description or "",
        input_schema=dict(tool.input_schema or {}),
        output_schema=dict(tool.output_schema) if tool.output_schema else None,
    )


def _result_json(result: CallToolResult) -> dict[str, Any]:
    content = [block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in result.content]
    if result.is_error:
        texts = [b.get("text", "") for b in content if b.get("type") == "text"]
        return {"ok": False, "kind": "tool", "error": "\n".join(texts) or "the tool reported an error"}
    return {"ok": True, "content": content, "structured": result.structured_content}
