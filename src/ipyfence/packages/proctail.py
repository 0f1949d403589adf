"""Read a child process's output while it runs, keeping only the tail (bounded memory)."""

from __future__ import annotations

import asyncio


async def drain_tail(proc: asyncio.subprocess.Process, buf: bytearray, keep: int) -> None:
    """Append ``proc``'s stdout to ``buf`` until EOF, dropping all but the last ``keep`` bytes; then wait."""
    assert proc.stdout is not None
    while chunk := await proc.stdout.read(65536):
        buf.extend(chunk)
        if len(buf) > keep:
            del buf[: len(buf) - keep]
    await proc.wait()
