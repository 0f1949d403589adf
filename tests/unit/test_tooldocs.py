"""Tool descriptions: as helpful as ipybox's, and clean text (no docstring indentation)."""

from __future__ import annotations

import anyio

from ipyfence.app import App
from ipyfence.server import build_server


def _descriptions() -> dict[str, str]:
    server = build_server(App.__new__(App))  # list_tools needs no running app
    tools = anyio.run(server.list_tools)
    return {t.name: t.description or "" for t in tools}


def test_descriptions_teach_the_generated_api_and_the_reset_rule() -> None:
    docs = _descriptions()
    assert "from mcptools.<server_name>.<tool_name> import Params, run" in docs["execute_ipython_cell"]
    assert "await" in docs["execute_ipython_cell"] and "asyncio.run()" in docs["execute_ipython_cell"]
    assert "install_package" in docs["execute_ipython_cell"]
    assert "reset()" in docs["register_mcp_server"] and "${VAR}" in docs["register_mcp_server"]
    assert "persist" in docs["reset"] and "persist" in docs["install_package"]


def test_descriptions_have_no_stray_indentation() -> None:
    for name, text in _descriptions().items():
        assert text == text.strip(), name
        for line in text.splitlines():
            assert not line.startswith("        "), (name, line)  # docstring continuation indentation
