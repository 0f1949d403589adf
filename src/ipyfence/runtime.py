"""The server's private runtime directory and its housekeeping across crashes.

One 0700 directory per server under the temp dir holds every kernel's private dir, their logs,
the server's pid and the placeholders bwrap created. A server killed with SIGKILL cannot clean
up, so the next server start removes what dead servers left behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

RUNTIME_PREFIX = "ipyfence-"
OWNER_FILE = "server.pid"
PLACEHOLDERS_FILE = "placeholders"


def remove_placeholders(paths: list[str]) -> None:
    """Remove the empty read-only placeholders bwrap created; anything with content stays."""
    for path in paths:
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)  # only succeeds when empty
            elif os.path.isfile(path) and os.path.getsize(path) == 0:
                os.unlink(path)


def remove_stale_runtime_dirs() -> None:
    """Delete runtime dirs left by servers that were killed (SIGKILL skips our cleanup)."""
    for owner in Path(tempfile.gettempdir()).glob(f"{RUNTIME_PREFIX}*/{OWNER_FILE}"):
        try:
            pid = int(owner.read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                remove_placeholders((owner.parent / PLACEHOLDERS_FILE).read_text().splitlines())
            shutil.rmtree(owner.parent, ignore_errors=True)
        except (OSError, ValueError):
            continue
