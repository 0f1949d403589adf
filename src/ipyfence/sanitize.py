"""Make kernel-controlled text safe to show in an MCP client: no terminal control sequences.

Everything a tool returns can carry text the kernel chose (cell output, tracebacks, pip output,
a registered server's stderr). Clients often render it in a terminal, where an escape sequence
can set the clipboard (OSC 52), plant a disguised link (OSC 8), clear the screen or retitle the
window. ``clean`` removes every ECMA-48 control sequence and every other control character
except newline and tab, and settles carriage returns the way a terminal finally shows the line.

The result never contains a C0 control other than ``\\n``/``\\t``, DEL, or a C1 control
(U+0080-U+009F): whatever part of a malformed sequence is left is plain printable text.
"""

from __future__ import annotations

import re

# String sequences: OSC (ESC ] / U+009D), DCS (ESC P / U+0090), SOS (ESC X / U+0098),
# PM (ESC ^ / U+009E), APC (ESC _ / U+009F), ended by BEL or ST (ESC \ / U+009C). The body may
# not cross a newline: an unterminated OSC could otherwise swallow the lines after it, including
# ipyfence's own notes, which always start on a new line. A body that does is left as visible
# text once its introducer is removed below. The body also stops at any ESC or C1 character,
# so a failed match never scans past the next introducer: cleaning stays linear in the input.
_STRING = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x80-\x9f\n]*(?:\x07|\x1b\\|\x9c)"
# CSI (ESC [ / U+009B): parameter bytes, intermediate bytes, one final byte.
_CSI = r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]"
# Any other escape sequence: ESC, intermediate bytes, one final byte (ESC c, ESC 7, ESC ( B, ...).
_ESC = r"\x1b[\x20-\x2f]*[\x30-\x7e]"
SEQUENCE = re.compile(f"{_STRING}|{_CSI}|{_ESC}")
# Whatever control is left (a lone ESC, BEL, backspace, NUL, DEL, C1), except \t \n and \r.
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _settle_carriage_returns(line: str) -> str:
    """What a terminal finally shows for a line written with ``\\r`` (progress bars).

    The text after the last ``\\r``; if that is empty (the line ended with ``\\r``), the last
    non-empty part, since a bare ``\\r`` moves the cursor but erases nothing.
    """
    for part in reversed(line.split("\r")):
        if part:
            return part
    return ""


def clean(text: str) -> str:
    """``text`` without terminal control sequences, ``\\r\\n`` as ``\\n``, ``\\r`` settled."""
    text = CONTROL.sub("", SEQUENCE.sub("", text))
    if "\r" not in text:
        return text
    text = text.replace("\r\n", "\n")
    return "\n".join(_settle_carriage_returns(line) if "\r" in line else line for line in text.split("\n"))
