"""Validate ``register_mcp_server`` input and substitute ``${VAR}`` placeholders.

The registry stores the params as the agent sent them (placeholders intact), so substituted
secrets never reach disk; ``resolve`` substitutes them on the host right before connecting.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ipyfence.errors import ToolInputError

STDIO_KEYS = frozenset({"command", "args", "env", "cwd"})  # cwd: accepted as ipybox does
HTTP_KEYS = frozenset({"url", "headers"})
MAX_NAME_LEN = 64

_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class StdioParams:
    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # may hold secrets
    cwd: str | None = None  # None: ipyfence's private directory (see hostlaunch)


@dataclass(frozen=True)
class HttpParams:
    url: str = field(repr=False)  # may carry a token in the query
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)


ServerParams = StdioParams | HttpParams


def validate_server_name(server_name: object) -> str:
    """A non-keyword identifier: it becomes a package directory under ``mcptools/``."""
    if not isinstance(server_name, str) or not server_name:
        raise ToolInputError("server_name must be a non-empty string")
    if not server_name.isidentifier() or not server_name.isascii():
        raise ToolInputError(
            f"server_name {server_name!r} is not a valid Python identifier "
            "(use ASCII letters, digits and underscores, not starting with a digit)"
        )
    if keyword.iskeyword(server_name) or keyword.issoftkeyword(server_name):
        raise ToolInputError(f"server_name {server_name!r} is a Python keyword; choose another name")
    if server_name.startswith("__"):
        raise ToolInputError(f"server_name {server_name!r} must not start with '__'")
    if len(server_name) > MAX_NAME_LEN:
        raise ToolInputError(f"server_name is longer than {MAX_NAME_LEN} characters")
    return server_name


def _str_map(value: object, key: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ToolInputError(f"server_params.{key} must be an object of string keys to string values")
    return dict(value)


def validate_server_params(server_params: object) -> dict[str, Any]:
    """Check the shape (stdio or HTTP, known keys, right types). Returns a plain-JSON copy."""
    if not isinstance(server_params, dict):
        raise ToolInputError("server_params must be an object")
    keys = set(server_params)
    if "command" in keys and "url" in keys:
        raise ToolInputError("server_params has both 'command' (stdio) and 'url' (HTTP); give one")
    if "command" in keys:
        allowed, kind = STDIO_KEYS, "stdio"
    elif "url" in keys:
        allowed, kind = HTTP_KEYS, "HTTP"
    else:
        raise ToolInputError(
            "server_params needs 'command' (stdio: command, args, env) or 'url' (HTTP: url, headers); "
            f"got keys {sorted(keys)}"
        )
    unknown = sorted(keys - allowed)
    if unknown:
        raise ToolInputError(
            f"server_params has unknown key(s) {unknown} for a {kind} server; allowed: {sorted(allowed)}"
        )
    out: dict[str, Any] = {}
    if kind == "stdio":
        command = server_params["command"]
        if not isinstance(command, str) or not command.strip():
            raise ToolInputError("server_params.command must be a non-empty string")
        args = server_params.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ToolInputError("server_params.args must be a list of strings")
        out = {"command": command, "args": list(args), "env": _str_map(server_params.get("env", {}), "env")}
        if "cwd" in server_params:
            cwd = server_params["cwd"]
            if not isinstance(cwd, str) or not cwd.strip():
                raise ToolInputError("server_params.cwd must be a non-empty string (a directory)")
            out["cwd"] = cwd
    else:
        url = server_params["url"]
        if not isinstance(url, str) or not url.strip():
            raise ToolInputError("server_params.url must be a non-empty string")
        out = {"url": url, "headers": _str_map(server_params.get("headers", {}), "headers")}
    for text in _strings(out):
        if "\x00" in text:
            raise ToolInputError("server_params must not contain NUL characters")
    return out


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def substitute(text: str, variables: Mapping[str, str], where: str) -> str:
    """Replace every ``${VAR}``; an unknown or malformed placeholder is an error, never left as is."""

    def repl(match: re.Match[str]) -> str:
        name = match.group(1)
        if not _VAR_NAME.fullmatch(name):
            raise ToolInputError(f"{where}: malformed placeholder {match.group(0)!r} (expected ${{NAME}})")
        if name not in variables:
            raise ToolInputError(
                f"{where}: unknown variable ${{{name}}}; set {name} in ipyfence's environment or in the workspace .env"
            )
        return variables[name]

    result = _PLACEHOLDER.sub(repl, text)
    # An unterminated "${" would otherwise silently pass through as literal text.
    if "${" in _PLACEHOLDER.sub("", text):
        raise ToolInputError(f"{where}: unterminated placeholder '${{' (expected ${{NAME}})")
    return result


def _sub_map(values: Mapping[str, str], variables: Mapping[str, str], where: str) -> dict[str, str]:
    return {
        substitute(k, variables, f"{where} key"): substitute(v, variables, f"{where}.{k}") for k, v in values.items()
    }


def resolve(params: Mapping[str, Any], variables: Mapping[str, str]) -> ServerParams:
    """Validated params (see ``validate_server_params``) → concrete params with secrets filled in."""
    if "command" in params:
        return StdioParams(
            command=substitute(params["command"], variables, "server_params.command"),
            args=tuple(substitute(a, variables, f"server_params.args[{i}]") for i, a in enumerate(params["args"])),
            env=_sub_map(params["env"], variables, "server_params.env"),
            cwd=substitute(params["cwd"], variables, "server_params.cwd") if params.get("cwd") else None,
        )
    url = substitute(params["url"], variables, "server_params.url")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ToolInputError("server_params.url must be an http:// or https:// URL with a host")
    return HttpParams(url=url, headers=_sub_map(params["headers"], variables, "server_params.headers"))
