"""The server may die at any moment, including while a kernel is still starting: no sandbox survives it.

bwrap's --die-with-parent is set only once bwrap runs; a server killed before that would leave an
orphan that never gets the signal. The launch goes through `setpriv --pdeathsig` plus a parent check
to close that window. Killing the server at staggered moments during start-up exercises it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from ipyfence.sandbox.launch import parent_guard
from tests.conftest import IPYFENCE, require_bwrap, server_env
from tests.integration.procs import processes_matching, wait_until_gone

DELAYS = [0.05 * i for i in range(1, 13)]  # 50 ms … 600 ms after spawn: before, during and after kernel start


def test_parent_guard_sets_the_death_signal_before_checking_the_parent() -> None:
    argv = parent_guard(["bwrap", "--", "python"], 4242, "/run/k1.args")
    assert argv[:4] == ["setpriv", "--pdeathsig", "KILL", "--"]
    assert argv[-5:] == ["4242", "/run/k1.args", "bwrap", "--", "python"]


@pytest.mark.parametrize("delay", DELAYS)
def test_server_killed_during_kernel_start_leaves_no_sandbox(tmp_path: Path, state_dir: Path, delay: float) -> None:
    require_bwrap()
    workspace = tmp_path / f"ws-{int(delay * 1000)}"
    workspace.mkdir()
    proc = subprocess.Popen(
        [IPYFENCE, "--workspace", str(workspace), "--log-level", "ERROR"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=server_env(state_dir),
    )
    try:
        time.sleep(delay)
        proc.kill()
        proc.wait()
        left = wait_until_gone(str(workspace), within=10)
        assert not left, f"processes outlived the server killed {delay:.2f}s after start: {describe(left)}"
    finally:
        for pid in processes_matching(str(workspace)):
            subprocess.run(["kill", "-9", str(pid)], check=False)


def describe(procs: dict[int, str]) -> str:
    """pid, parent and pid-namespace ids of each leftover, to tell which stage of the launch leaked."""
    lines = []
    for pid, cmd in procs.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            status = []
        ids = [line for line in status if line.startswith(("PPid", "NSpid"))]
        lines.append(f"{pid} {ids} {cmd[:160]}")
    return "\n".join(lines)
