"""`make demo`: a real MCP client drives a real ipyfence server for ten seconds.

It starts `ipyfence --workspace <temp dir>` over stdio (the same way Claude Code does), runs a
few cells, and shows the sandbox refusing to read a .env secret and to reach the internet.
Nothing here leaves the machine: the kernel has no network interface besides its own loopback.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

IPYFENCE = str(Path(sys.executable).with_name("ipyfence"))

CELLS = [
    ("state persists across cells", "x = 21\nprint('x is', x)"),
    ("...", "print('x * 2 =', x * 2)"),
    ("read the workspace .env (a secret)", "print(open('.env').read())"),
    (
        "reach the internet (example.org)",
        "import socket\nsocket.create_connection(('example.org', 443), timeout=3)",
    ),
    (
        "connect to an IP directly (TEST-NET, no DNS)",
        "import socket\nsocket.create_connection(('192.0.2.1', 443), timeout=3)",
    ),
    ("write outside the workspace", "open('/etc/ipyfence-demo', 'w')"),
    ("KERNEL_ENV_ variables arrive, prefix stripped", "import os\nprint(os.environ.get('GREETING'))"),
]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="ipyfence-demo-") as tmp:
        ws = Path(tmp)
        (ws / ".env").write_text("OPENAI_API_KEY=sk-demo-not-a-real-key\nKERNEL_ENV_GREETING=hello from .env\n")
        params = StdioServerParameters(command=IPYFENCE, args=["--workspace", str(ws), "--log-level", "WARNING"])
        started = time.monotonic()
        async with Client(params) as client:
            print(f"connected to ipyfence (workspace {ws})\n")
            for title, code in CELLS:
                result = await client.call_tool("execute_ipython_cell", {"code": code, "timeout": 10})
                text = "".join(getattr(b, "text", "") for b in result.content)
                verdict = "BLOCKED" if result.is_error else "ok"
                print(f"── {title}")
                print("   " + code.replace("\n", "\n   "))
                print(f"   → [{verdict}] {last_line(text)}\n")
        print(f"done in {time.monotonic() - started:.1f}s")


if __name__ == "__main__":
    anyio.run(main)
