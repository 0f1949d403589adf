"""Tool arguments checked once, at the MCP boundary, with one plain sentence per problem.

The SDK ignores unknown arguments (a misspelt ``timout`` would silently run with the default)
and reports bad ones as raw pydantic text with documentation URLs. ``StrictArgsServer``
refuses unknown names and rewrites validation errors before any tool body runs.
"""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import ValidationError

_TYPES = {
    "string_type": "a string",
    "int_type": "a whole number",
    "int_parsing": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "dict_type": "an object",
    "list_type": "an array",
}


def _sentence(error: Any) -> str:
    """One validation error from pydantic's ``errors()`` as a sentence about the argument."""
    name = ".".join(str(part) for part in error.get("loc", ())) or "the arguments"
    kind = str(error.get("type", ""))
    ctx = error.get("ctx") or {}
    if kind == "missing":
        return f"'{name}' is required"
    if kind in _TYPES:
        return f"'{name}' must be {_TYPES[kind]}, got {type(error.get('input')).__name__}"
    bounds = {"greater_than": "greater than", "greater_than_equal": "at least", "less_than": "less than"}
    bounds["less_than_equal"] = "at most"
    for key, words in bounds.items():
        if kind == key:
            limit = next(iter(ctx.values()), "?")
            if isinstance(limit, float) and limit.is_integer():
                limit = int(limit)
            return f"'{name}' must be {words} {limit}, got {error.get('input')!r}"
    message = str(error.get("msg", "is not valid")).rstrip(".")
    return f"'{name}': {message[0].lower() + message[1:] if message else 'is not valid'}"


def describe(tool: str, exc: ValidationError) -> str:
    problems = [_sentence(err) for err in exc.errors(include_url=False)]
    return f"{tool}: " + "; ".join(problems) + "."


class StrictArgsServer(MCPServer[Any]):
    """An MCPServer whose tools refuse unknown arguments and explain bad ones in plain words."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        tool = self._tool_manager.get_tool(name)
        if tool is not None:
            known = set((tool.parameters or {}).get("properties", {}))
            unknown = sorted(set(arguments) - known)
            if unknown:
                raise ToolError(
                    f"{name}: unknown argument(s) {', '.join(repr(u) for u in unknown)}; "
                    f"it takes {', '.join(repr(k) for k in sorted(known)) or 'no arguments'}."
                )
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            if isinstance(exc.__cause__, ValidationError):
                raise ToolError(describe(name, exc.__cause__)) from None
            raise
