"""Host process inspection for the integration tests (read-only /proc scans)."""

from __future__ import annotations

import os
import time


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes_matching(*needles: str) -> dict[int, str]:
    """Live host processes whose command line contains any of ``needles`` (zombies excluded)."""
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        line = cmdline(pid)
        if line and any(n in line for n in needles):
            found[pid] = line
    return found


def wait_until_gone(*needles: str, within: float = 20.0) -> dict[int, str]:
    """Poll until no process matches; returns what is left at the deadline (empty = all gone)."""
    deadline = time.monotonic() + within
    left = processes_matching(*needles)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_matching(*needles)
    return left


def server_pid(workspace: str) -> int:
    """The pid of the `ipyfence --workspace WS` server serving ``workspace``."""
    for pid, line in processes_matching(f"--workspace {workspace}").items():
        if "ipyfence" in line and "bwrap" not in line and "ipykernel" not in line:
            return pid
    raise LookupError(f"no ipyfence server for {workspace}")
