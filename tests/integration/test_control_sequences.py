"""No terminal control sequence reaches the MCP client, whatever the kernel prints or raises.

The kernel prints clipboard writes (OSC 52), disguised links (OSC 8), screen clears, 8-bit C1
controls and progress-bar carriage returns, in output, in an exception, in a registered
server's stderr (a tool error) and in an argument error. The control: the same cell writes the
same text to a workspace file, and the host finds every sequence there, so the bytes were
really produced and only the boundary removed them. The rule is host-side, so it holds with
``--no-sandbox`` too; both modes are run.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_bwrap, text_of

FORBIDDEN = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
HOSTILE = (
    "clip\x1b]52;c;ZWNobyBwd25lZA==\x07board "
    "\x1b]8;;https://evil.example/\x1b\\link\x1b]8;;\x1b\\ "
    "\x1b[2J\x1b[Hcleared \x1b[31mred\x1b[0m "
    "\x9b2J\x9d52;c;aGk=\x9cc1 \x1bPdcs\x1b\\\x1b_apc\x1b\\done"
)
VISIBLE = "clipboard link cleared red c1 done"

CELL = f"""
import pathlib
hostile = {HOSTILE!r}
pathlib.Path("emitted.txt").write_text(hostile, encoding="utf-8")
print("tab\\there")
print(hostile)
print("line1\\r\\nline2")
for p in range(0, 101, 25):
    print(f"\\r{{p}}%", end="")
print()
"""
RAISE = f"raise ValueError({HOSTILE!r})"


def assert_clean(text: str) -> None:
    bad = FORBIDDEN.search(text)
    assert bad is None, f"control {bad.group()!r} reached the client: {text!r}"


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["sandbox", "no-sandbox"])
async def test_control_sequences_never_reach_the_client(make_client: Any, workspace: Path, mode: str) -> None:
    args = ("--no-sandbox",) if mode == "no-sandbox" else ()
    if mode == "sandbox":
        require_bwrap()
    async with make_client(*args) as client:
        result = await client.call_tool("execute_ipython_cell", {"code": CELL})
        out = text_of(result)
        assert not result.is_error, out
        # control: the kernel really produced every sequence
        emitted = (workspace / "emitted.txt").read_text(encoding="utf-8")
        for seq in ("\x1b]52;", "\x1b]8;;", "\x1b[2J", "\x9b", "\x9d"):
            assert seq in emitted
        assert_clean(out)
        assert "tab\there\n" in out  # tabs and newlines survive
        assert VISIBLE in out
        assert "line1\nline2\n" in out  # \r\n became \n
        assert "\n100%\n" in out and "25%" not in out  # a progress bar shows its final state
        assert "ZWNobyBwd25lZA" not in out and "evil.example" not in out

        # a raised exception: traceback and error text
        result = await client.call_tool("execute_ipython_cell", {"code": RAISE})
        out = text_of(result)
        assert result.is_error
        assert_clean(out)
        assert "ValueError" in out and VISIBLE in out

        # a tool error built from a registered server's stderr
        noisy = f"import sys; sys.stderr.write({HOSTILE!r}); sys.exit(3)"
        result = await client.call_tool(
            "register_mcp_server",
            {"server_name": "noisy", "server_params": {"command": sys.executable, "args": ["-c", noisy]}},
        )
        out = text_of(result)
        assert result.is_error
        assert_clean(out)
        assert "done" in out  # the stderr tail is shown, minus its controls

        # an argument error echoing the caller's value
        result = await client.call_tool("execute_ipython_cell", {"code": "1", "timeout": HOSTILE})
        assert result.is_error
        assert_clean(text_of(result))
