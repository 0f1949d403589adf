"""The MCP server: ipybox's four tools, plus list_packages and uninstall_package, as thin adapters.

Expected failures raise ``ToolError`` (→ ``isError``); nothing here writes to stdout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, ContentBlock, ImageContent, InputRequiredResult, TextContent
from pydantic import Field

from ipyfence import __version__, sanitize, tooldocs
from ipyfence.app import App
from ipyfence.errors import IpyfenceError, KernelStartError
from ipyfence.kernel import ExecutionResult, KernelSession
from ipyfence.toolargs import StrictArgsServer

log = logging.getLogger(__name__)

MAX_TIMEOUT = 24 * 3600
MAX_OUTPUT_CHARS = 10_000_000

INSTRUCTIONS = """\
A stateful IPython kernel running inside an OS sandbox: it can read most files but not .env
files, can write only inside the workspace, and has no internet. Variables persist across
execute_ipython_cell calls until reset(). Use register_mcp_server to generate a Python API
(mcptools.<server>.<tool>) for another MCP server's tools and call them from code.
Install packages with install_package (pip inside a cell has no network); list_packages and
uninstall_package show and repair what was installed.
"""


def result_to_mcp(result: ExecutionResult) -> CallToolResult:
    out = result.output
    text = out.render()
    if not text.strip() and not out.images:
        text = "" if not result.error else "(no output)"
    content: list[ContentBlock] = [TextContent(type="text", text=text)]
    content += [ImageContent(type="image", data=img.data, mime_type=img.mime) for img in out.images]
    return CallToolResult(content=content, is_error=result.error)


def _clean_value(value: Any) -> Any:
    """Structured content with every string cleaned (a str tool result is also sent this way)."""
    if isinstance(value, str):
        return sanitize.clean(value)
    if isinstance(value, list):
        return [_clean_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean_value(v) for k, v in value.items()}
    return value


def clean_result(result: CallToolResult) -> CallToolResult:
    """The one place tool results are made safe for a terminal: every text block, structured content."""
    content = [
        block.model_copy(update={"text": sanitize.clean(block.text)}) if isinstance(block, TextContent) else block
        for block in result.content
    ]
    update: dict[str, Any] = {"content": content}
    if result.structured_content is not None:
        update["structured_content"] = _clean_value(result.structured_content)
    return result.model_copy(update=update)


class CleanMCPServer(StrictArgsServer):
    """An MCPServer whose every tool result and tool error text has no terminal control sequences
    (and whose tools refuse unknown arguments, see ``toolargs``).

    Cleaning here, where results leave the tools, covers the four tools, argument errors and
    whatever a future tool returns; a ToolError message (pip output, a server's stderr, a
    kernel's exception text) is cleaned in place so its type and cause stay as the SDK expects.
    """

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        try:
            result = await super().call_tool(name, arguments, context)
        except ToolError as exc:
            exc.args = (sanitize.clean(str(exc)),)
            raise
        return clean_result(result) if isinstance(result, CallToolResult) else result


async def _tool_error(app: App, exc: IpyfenceError, prefix: str = "") -> ToolError:
    """The error as a tool error; a kernel that cannot start because of the package dir says so."""
    if isinstance(exc, KernelStartError):
        explained = await app.installer().explain_start_failure(exc)
        if explained is not None:
            return ToolError(explained)
    return ToolError(f"{prefix}{exc}")


async def _ready(app: App) -> KernelSession:
    try:
        return await app.ready()
    except IpyfenceError as exc:
        raise await _tool_error(app, exc, "the sandboxed kernel could not start: ") from None


def build_server(app: App) -> MCPServer[Any]:
    @contextlib.asynccontextmanager
    async def lifespan(_: MCPServer[Any]) -> AsyncIterator[None]:
        try:
            yield
        finally:
            # Shielded: on SIGTERM the surrounding scope is cancelled, and the kernel must still go.
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                await app.stop()

    mcp: MCPServer[Any] = CleanMCPServer(
        "ipyfence", version=__version__, instructions=INSTRUCTIONS, lifespan=lifespan, log_level="WARNING"
    )

    @mcp.tool(description=tooldocs.EXECUTE_IPYTHON_CELL)
    async def execute_ipython_cell(
        code: Annotated[str, Field(description="Python code to execute")],
        ctx: Context,
        # strict: a JSON true/false is not silently taken as 1/0
        timeout: Annotated[
            float,
            Field(
                gt=0,
                le=MAX_TIMEOUT,
                strict=True,
                description=f"Maximum execution time in seconds (> 0, <= {MAX_TIMEOUT})",
            ),
        ] = 120,
        max_output_chars: Annotated[
            int,
            Field(
                ge=1, le=MAX_OUTPUT_CHARS, strict=True, description=f"Output character limit (1 to {MAX_OUTPUT_CHARS})"
            ),
        ] = 5000,
    ) -> CallToolResult:
        """Execute Python code in a stateful IPython kernel. Executed code can use the generated Python tool API
        of registered MCP servers. MCP tool calls from executed code are auto-approved. Returns the output."""
        session = await _ready(app)

        async def progress(elapsed: float, last_line: str) -> None:
            last = sanitize.clean(last_line)[:200]  # progress messages reach the client's terminal too
            await ctx.report_progress(elapsed, None, f"running for {elapsed:.0f}s; last output: {last}")

        try:
            result = await session.execute(code, timeout=timeout, max_output_chars=max_output_chars, progress=progress)
        except IpyfenceError as exc:
            raise await _tool_error(app, exc) from None
        return result_to_mcp(result)

    @mcp.tool(description=tooldocs.REGISTER_MCP_SERVER)
    async def register_mcp_server(
        server_name: Annotated[str, Field(description="Application-defined MCP server name (valid Python identifier)")],
        server_params: Annotated[
            dict[str, Any],
            Field(description='Server config: {"command", "args", "env"} for stdio or {"url", "headers"} for HTTP'),
        ],
    ) -> str:
        """Connects to an MCP server and generates a Python API for its tools under mcptools/{server_name}/.
        Returns the importable module names."""
        try:
            modules = await (await app.tools()).register(server_name, server_params)
        except IpyfenceError as exc:
            raise ToolError(str(exc)) from None
        return "\n".join(modules)

    @mcp.tool(description=tooldocs.INSTALL_PACKAGE)
    async def install_package(
        package_name: Annotated[
            str, Field(description="Package spec (e.g., requests, numpy>=1.20.0, or git+https://...)")
        ],
    ) -> str:
        """Installs a Python package via pip (inside the sandbox). Supports version specifiers and git URLs."""
        await _ready(app)
        try:
            return await app.installer().install(package_name)
        except IpyfenceError as exc:
            raise ToolError(str(exc)) from None

    @mcp.tool(description=tooldocs.LIST_PACKAGES)
    async def list_packages() -> str:
        """Thin adapter: see tooldocs.LIST_PACKAGES."""
        with contextlib.suppress(IpyfenceError):
            await app.ready()  # wait for the first start; a kernel that cannot start must not block this
        try:
            return await app.installer().list_packages()
        except IpyfenceError as exc:
            raise ToolError(str(exc)) from None

    @mcp.tool(description=tooldocs.UNINSTALL_PACKAGE)
    async def uninstall_package(
        package_name: Annotated[str, Field(description="Distribution name as list_packages() shows it, e.g. requests")],
    ) -> str:
        """Thin adapter: see tooldocs.UNINSTALL_PACKAGE."""
        with contextlib.suppress(IpyfenceError):
            await app.ready()  # a kernel that cannot start is what this tool repairs
        try:
            return await app.installer().uninstall(package_name)
        except IpyfenceError as exc:
            raise ToolError(str(exc)) from None

    @mcp.tool(description=tooldocs.RESET)
    async def reset() -> str:
        """Creates a new kernel, clearing all variables and imports. Installed packages and generated mcptools/
        persist."""
        session = await _ready(app)
        try:
            await session.reset()
        except IpyfenceError as exc:
            raise await _tool_error(app, exc) from None
        return "Kernel reset: all variables and imports are cleared. Installed packages and mcptools/ persist."

    return mcp


async def serve_stdio(app: App) -> None:
    """Serve until stdin closes or SIGTERM/SIGHUP/SIGINT arrives; the kernel is stopped either way."""
    server = build_server(app)
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                        await app.stop()
                    # The stdio transport reads stdin in a worker thread that no cancellation can
                    # reach; waiting for it would keep us alive until the client closes the pipe.
                    sys.stderr.flush()
                    os._exit(0)

        tg.start_soon(stop_on_signal)
        await server.run_stdio_async()
        tg.cancel_scope.cancel()
