"""register_mcp_server input validation and ${VAR} substitution (pure, no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from ipyfence.errors import ToolInputError
from ipyfence.mcptools.params import (
    HttpParams,
    StdioParams,
    resolve,
    substitute,
    validate_server_name,
    validate_server_params,
)


@pytest.mark.parametrize("name", ["time", "brave_search", "_private", "s3", "Server"])
def test_valid_server_names(name: str) -> None:
    assert validate_server_name(name) == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "non-empty"),
        (None, "non-empty"),
        ("1abc", "not a valid Python identifier"),
        ("a-b", "not a valid Python identifier"),
        ("../etc", "not a valid Python identifier"),
        ("a/b", "not a valid Python identifier"),
        ("a.b", "not a valid Python identifier"),
        ("naïve", "not a valid Python identifier"),
        ("class", "keyword"),
        ("match", "keyword"),
        ("__init__", "must not start with '__'"),
        ("x" * 65, "longer than"),
    ],
)
def test_invalid_server_names(name: Any, message: str) -> None:
    with pytest.raises(ToolInputError, match=message):
        validate_server_name(name)


def test_stdio_and_http_shapes() -> None:
    assert validate_server_params({"command": "uvx", "args": ["x"]}) == {"command": "uvx", "args": ["x"], "env": {}}
    assert validate_server_params({"url": "http://h/mcp"}) == {"url": "http://h/mcp", "headers": {}}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("uvx x", "must be an object"),
        ({}, "needs 'command'"),
        ({"args": []}, r"got keys \['args'\]"),
        ({"command": "x", "url": "http://h"}, "both"),
        ({"command": "x", "cwd": "/", "shell": True}, r"unknown key\(s\) \['shell'\]"),
        ({"url": "http://h", "env": {}}, r"unknown key\(s\) \['env'\]"),
        ({"command": ""}, "command must be a non-empty string"),
        ({"command": ["sh"]}, "command must be a non-empty string"),
        ({"command": "x", "args": "a b"}, "args must be a list of strings"),
        ({"command": "x", "args": [1]}, "args must be a list of strings"),
        ({"command": "x", "env": {"A": 1}}, "env must be an object"),
        ({"url": 5}, "url must be a non-empty string"),
        ({"url": "http://h", "headers": ["a"]}, "headers must be an object"),
        ({"command": "x\x00y"}, "NUL"),
    ],
)
def test_bad_server_params(params: Any, message: str) -> None:
    with pytest.raises(ToolInputError, match=message):
        validate_server_params(params)


def test_substitution_everywhere() -> None:
    raw = validate_server_params(
        {"command": "${BIN}/srv", "args": ["--key=${KEY}", "plain"], "env": {"TOKEN": "${KEY}", "X": "a${B}c"}}
    )
    resolved = resolve(raw, {"BIN": "/opt", "KEY": "k3y", "B": "b"})
    assert resolved == StdioParams(command="/opt/srv", args=("--key=k3y", "plain"), env={"TOKEN": "k3y", "X": "abc"})
    http = resolve(
        validate_server_params({"url": "https://${HOST}/mcp", "headers": {"Auth": "Bearer ${KEY}"}}),
        {"HOST": "example.test", "KEY": "k"},
    )
    assert http == HttpParams(url="https://example.test/mcp", headers={"Auth": "Bearer k"})


def test_substituted_value_is_not_substituted_again() -> None:
    assert substitute("${A}", {"A": "${B}", "B": "no"}, "x") == "${B}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("${MISSING}", r"unknown variable \$\{MISSING\}"),
        ("a ${1BAD} b", "malformed placeholder"),
        ("${}", "malformed placeholder"),
        ("${A-B}", "malformed placeholder"),
        ("${UNTERMINATED", "unterminated placeholder"),
    ],
)
def test_bad_placeholders_are_errors_never_literal_text(text: str, message: str) -> None:
    with pytest.raises(ToolInputError, match=message):
        substitute(text, {"A": "1"}, "server_params.env.X")


def test_unknown_variable_error_names_where() -> None:
    raw = validate_server_params({"command": "x", "env": {"API_KEY": "${API_KEY}"}})
    with pytest.raises(ToolInputError, match=r"server_params\.env\.API_KEY: unknown variable"):
        resolve(raw, {})


@pytest.mark.parametrize("url", ["ftp://h/x", "file:///etc/passwd", "http://", "localhost:8000/mcp"])
def test_url_must_be_http_with_host(url: str) -> None:
    with pytest.raises(ToolInputError, match="http:// or https://"):
        resolve(validate_server_params({"url": url}), {})


def test_error_messages_do_not_echo_secret_values() -> None:
    raw = validate_server_params({"url": "ftp://user:${KEY}@h/x"})
    with pytest.raises(ToolInputError) as info:
        resolve(raw, {"KEY": "topsecret"})
    assert "topsecret" not in str(info.value)
