"""Issue 6: hostile or buggy cells against the real sandbox — limits, kernel death, floods, orphans.

Every test ends by showing the server still answers and the next cell works.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from ipyfence.policy import LimitsPolicy
from ipyfence.sandbox import cgroups
from tests.conftest import require_bwrap, run_cell, text_of
from tests.integration.procs import processes_matching, server_pid, wait_until_gone

pytestmark = pytest.mark.anyio


def limits_config(tmp_path: Path, **limits: int) -> str:
    cfg = tmp_path / "limits.json"
    cfg.write_text(json.dumps({"limits": limits}))
    return str(cfg)


def has_cgroup(controller: str) -> bool:
    """Can this host give a kernel its own cgroup for ``controller``? (probe, then clean up)"""
    found = cgroups.detect(LimitsPolicy(memory_mb=1, max_processes=1))
    for h in found:
        with contextlib.suppress(OSError):
            h.base.rmdir()
    return any(h.controller == controller for h in found)


async def assert_next_cell_works(client: Client) -> None:
    text, err = await run_cell(client, "print(6 * 7)")
    assert (text.strip(), err) == ("42", False), text


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


# --- resource limits ----------------------------------------------------------------------


async def test_memory_bomb_is_a_memory_error_and_state_is_kept(make_client: Any, tmp_path: Path) -> None:
    require_bwrap()
    async with make_client("--sandbox-config", limits_config(tmp_path, memoryMb=1024)) as client:
        await run_cell(client, "kept = 'yes'")
        code = "hog = []\nwhile True:\n    hog.append(bytearray(64 * 2**20))"
        text, err = await run_cell(client, code)
        assert err and "MemoryError" in text
        assert "limit hit: the cell ran out of memory (memoryMb=1024" in text
        assert "variables are kept" in text
        text, err = await run_cell(client, "del hog\nprint(kept)")
        assert (text.strip(), err) == ("yes", False), text


async def test_oom_kill_of_the_kernel_is_reported(make_client: Any, tmp_path: Path) -> None:
    """A process tree over the cgroup memory limit: the OOM killer takes the kernel."""
    require_bwrap()
    if not has_cgroup("memory"):
        pytest.skip("no writable cgroup memory controller on this host (memoryMb is per process only)")
    async with make_client("--sandbox-config", limits_config(tmp_path, memoryMb=1024)) as client:
        await run_cell(client, "lost = 1")
        # Fresh children (each with a small address space of its own, so RLIMIT_AS does not stop
        # them first) push the group over the limit once the kernel has volunteered as the OOM
        # victim; they start before that, so they do not inherit its oom_score_adj.
        code = (
            "import subprocess, sys\n"
            "hog = 'import sys\\nsys.stdin.read(1)\\na = []\\nwhile True: a.append(b\"x\" * 2**24)'\n"
            "children = [subprocess.Popen([sys.executable, '-c', hog], stdin=subprocess.PIPE) for _ in range(2)]\n"
            "open('/proc/self/oom_score_adj', 'w').write('1000')\n"
            "for child in children:\n"
            "    child.stdin.write(b'go')\n"
            "    child.stdin.close()\n"
            "for child in children:\n"
            "    child.wait()\n"
        )
        text, err = await run_cell(client, code)
        assert err
        assert "kernel died (killed by SIGKILL: the memory limit (memoryMb=1024 MiB in total) was hit)" in text
        assert "State lost" in text and "a new kernel is ready" in text
        await assert_next_cell_works(client)
        text, err = await run_cell(client, "lost")
        assert err and "NameError" in text


FORK_BOMB = """
import os, time
kids, failure = [], None
try:
    while len(kids) < 10_000:  # bounded: a sandbox without a limit still ends the loop
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        kids.append(pid)
except OSError as exc:
    failure = exc
finally:
    if {clean}:
        for pid in kids:
            os.kill(pid, 9)
        for pid in kids:
            os.waitpid(pid, 0)
print("forked", len(kids), "then", failure)
"""


async def test_fork_bomb_is_contained(make_client: Any, tmp_path: Path, workspace: Path) -> None:
    require_bwrap()
    async with make_client("--sandbox-config", limits_config(tmp_path, maxProcesses=64)) as client:
        await run_cell(client, "kept = 'yes'")
        text, err = await run_cell(client, FORK_BOMB.format(clean=True))
        assert not err, text
        forked = int(text.split("forked ")[1].split()[0])
        assert 0 < forked < 64, text  # the kernel's own threads count too
        assert "Resource temporarily unavailable" in text
        assert "limit hit: the process limit was reached (maxProcesses=64" in text
        assert "variables are kept" in text
        text, err = await run_cell(client, "print(kept)")
        assert (text.strip(), err) == ("yes", False)

        # A hostile bomb leaves its children running; reset() gets rid of all of them.
        text, err = await run_cell(client, FORK_BOMB.format(clean=False))
        assert "maxProcesses=64" in text
        result = await client.call_tool("reset", {})
        assert not result.is_error, text_of(result)
        text, err = await run_cell(client, "import subprocess\nprint(subprocess.run(['true']).returncode)")
        assert (text.strip(), err) == ("0", False), text


async def test_filling_tmp_fails_with_enospc(make_client: Any, tmp_path: Path) -> None:
    require_bwrap()
    async with make_client("--sandbox-config", limits_config(tmp_path, tmpSizeMb=16)) as client:
        await run_cell(client, "kept = 'yes'")
        code = "with open('/tmp/fill', 'wb') as f:\n    for _ in range(64):\n        f.write(b'x' * 2**20)"
        text, err = await run_cell(client, code)
        assert err and "No space left on device" in text
        assert "limit hit: a filesystem is full; the private /tmp holds at most tmpSizeMb=16 MiB" in text
        text, err = await run_cell(client, "import os\nos.remove('/tmp/fill')\nprint(kept)")
        assert (text.strip(), err) == ("yes", False), text


async def test_file_size_limit_is_efbig(make_client: Any, tmp_path: Path) -> None:
    require_bwrap()
    async with make_client("--sandbox-config", limits_config(tmp_path, maxFileSizeMb=1)) as client:
        text, err = await run_cell(client, "open('big.bin', 'wb').write(b'x' * 2 * 2**20)")
        assert err and "File too large" in text
        assert "maxFileSizeMb=1 MiB" in text
        await assert_next_cell_works(client)


async def test_cpu_time_limit_kills_the_kernel_with_a_clear_note(make_client: Any, tmp_path: Path) -> None:
    require_bwrap()
    async with make_client("--sandbox-config", limits_config(tmp_path, cpuSeconds=6)) as client:
        text, err = await run_cell(client, "while True:\n    pass", timeout=300)
        assert err
        assert "killed by SIGXCPU: the CPU time limit (cpuSeconds=6) was hit" in text
        assert "State lost" in text
        await assert_next_cell_works(client)


async def test_cgroup_files_are_read_only_in_the_sandbox(make_client: Any) -> None:
    """Kernel code cannot lift its own limits by leaving its cgroup or raising pids.max."""
    require_bwrap()
    async with make_client() as client:
        code = (
            "import glob, os\n"
            "for path in glob.glob('/sys/fs/cgroup/**/cgroup.procs', recursive=True)[:50] + "
            "glob.glob('/sys/fs/cgroup/**/pids.max', recursive=True)[:50]:\n"
            "    try:\n"
            "        open(path, 'w').write(str(os.getpid()) if path.endswith('procs') else 'max')\n"
            "        print('WROTE', path)\n"
            "    except OSError as exc:\n"
            "        pass\n"
            "print('done')"
        )
        text, err = await run_cell(client, code)
        assert not err and "WROTE" not in text and "done" in text, text


# --- kernel lifecycle ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "how"),
    [
        ("import os\nos._exit(3)", "exit code 3"),
        ("import ctypes\nctypes.string_at(0)", "killed by SIGSEGV"),
    ],
)
async def test_kernel_death_is_reported_and_next_call_works(make_client: Any, code: str, how: str) -> None:
    require_bwrap()
    async with make_client() as client:
        await run_cell(client, "lost = 1")
        text, err = await run_cell(client, code, timeout=600)  # death is detected, not timed out
        assert err
        assert f"the kernel died ({how})" in text
        assert "State lost" in text and "a new kernel is ready" in text
        await assert_next_cell_works(client)
        text, err = await run_cell(client, "lost")
        assert err and "NameError" in text


async def test_kernel_death_between_calls_is_reported(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    async with make_client() as client:
        code = (
            "import os, threading, time\n"
            "def die():\n"
            "    time.sleep(0.5)\n"
            "    open('dying', 'w').close()\n"
            "    os._exit(7)\n"
            "threading.Thread(target=die).start()"
        )
        text, err = await run_cell(client, code)
        assert not err, text
        with anyio.fail_after(30):
            while not (workspace / "dying").exists():
                await anyio.sleep(0.1)
        await anyio.sleep(1)  # os._exit follows the file at once
        text, err = await run_cell(client, "print('fresh')")
        assert not err and "fresh" in text
        assert "the kernel died (exit code 7) after the previous call" in text


async def test_input_fails_fast_with_a_clear_message(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        text, err = await run_cell(client, "name = input('name? ')", timeout=600)
        assert err and "StdinNotImplementedError" in text
        assert "input() is not available" in text
        await assert_next_cell_works(client)


async def _cancel_when_started(client: Client, workspace: Path, code: str) -> None:
    """Call execute_ipython_cell and cancel the call once the cell has written ``started``."""
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            await client.call_tool("execute_ipython_cell", {"code": code, "timeout": 600})

        tg.start_soon(call)
        with anyio.fail_after(60):
            while not (workspace / "started").exists():
                await anyio.sleep(0.1)
        tg.cancel_scope.cancel()
    (workspace / "started").unlink()


async def test_cancellation_interrupts_the_cell(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    async with make_client() as client:
        await run_cell(client, "kept = 'yes'")
        await _cancel_when_started(client, workspace, "import time\nopen('started', 'w').close()\ntime.sleep(600)")
        # Were the cell still running, this call would queue behind a 600 s sleep.
        with anyio.fail_after(60):
            text, err = await run_cell(client, "print(kept)")
        assert (text.strip(), err) == ("yes", False), text


async def test_cancellation_escalates_to_a_restart(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    async with make_client() as client:
        await run_cell(client, "lost = 1")
        code = (
            "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "open('started', 'w').close()\nwhile True:\n    pass"
        )
        await _cancel_when_started(client, workspace, code)
        with anyio.fail_after(60):
            text, err = await run_cell(client, "lost")
        assert err and "NameError" in text
        await assert_next_cell_works(client)


async def test_progress_reports_elapsed_time_and_last_line(make_client: Any) -> None:
    require_bwrap()
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    async with make_client() as client:
        code = "import time\nprint('first', flush=True)\nprint('step two', flush=True)\ntime.sleep(6.5)\nprint('end')"
        result = await client.call_tool(
            "execute_ipython_cell", {"code": code, "timeout": 60}, progress_callback=on_progress
        )
        assert not result.is_error
        assert seen, "no progress notification arrived"
        elapsed, _, message = seen[0]
        assert elapsed >= 5
        assert message is not None and "last output: step two" in message


# --- no orphans ---------------------------------------------------------------------------


def spawn_children(marker: int) -> str:
    """Cell code starting a plain child, a double-forked daemon and a setsid child."""
    return (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '{marker}'])\n"
        f"subprocess.Popen(['setsid', 'sleep', '{marker}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '{marker}'])\n"
        "    os._exit(0)\n"
        "print('spawned')"
    )


def children(marker: int) -> dict[int, str]:
    return {p: c for p, c in processes_matching(f"sleep {marker}").items() if c.startswith("sleep")}


async def _spawn(client: Client, marker: int) -> None:
    text, err = await run_cell(client, spawn_children(marker))
    assert not err and "spawned" in text, text
    with anyio.fail_after(20):
        while len(children(marker)) < 3:
            await anyio.sleep(0.1)


async def test_cell_children_die_on_reset(make_client: Any) -> None:
    require_bwrap()
    marker = 900_000 + os.getpid() % 1000
    async with make_client() as client:
        await _spawn(client, marker)
        result = await client.call_tool("reset", {})
        assert not result.is_error
        left = wait_until_gone(f"sleep {marker}")
        assert not left, f"children survived reset: {left}"
        await assert_next_cell_works(client)


async def test_cell_children_die_on_restart_after_timeout(make_client: Any) -> None:
    require_bwrap()
    marker = 901_000 + os.getpid() % 1000
    async with make_client() as client:
        await _spawn(client, marker)
        code = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"
        text, err = await run_cell(client, code, timeout=2)
        assert err and "restarted" in text
        left = wait_until_gone(f"sleep {marker}")
        assert not left, f"children survived the restart: {left}"
        await assert_next_cell_works(client)


@pytest.mark.parametrize("how", ["disconnect", "SIGTERM", "SIGKILL"])
async def test_cell_children_die_when_the_server_exits(make_client: Any, workspace: Path, how: str) -> None:
    require_bwrap()
    marker = 902_000 + ["disconnect", "SIGTERM", "SIGKILL"].index(how) * 100 + os.getpid() % 100
    try:
        with contextlib.suppress(Exception):  # the client sees its server vanish
            async with make_client() as client:
                await _spawn(client, marker)
                if how != "disconnect":
                    os.kill(server_pid(str(workspace)), getattr(signal, how))
                    with anyio.fail_after(20):
                        with contextlib.suppress(LookupError):
                            while server_pid(str(workspace)):
                                await anyio.sleep(0.1)
        left = wait_until_gone(f"sleep {marker}")
        assert not left, f"children survived server {how}: {left}"
    finally:
        for pid in children(marker):  # never leave them behind, even when the test fails
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# --- floods and bad input -----------------------------------------------------------------


async def test_20mb_of_output_in_bounded_memory(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    async with make_client() as client:
        await assert_next_cell_works(client)
        pid = server_pid(str(workspace))
        before = rss_kb(pid)
        code = "import sys\nline = 'y' * 1023 + '\\n'\nfor _ in range(20 * 1024):\n    sys.stdout.write(line)"
        text, err = await run_cell(client, code, max_output_chars=5000)
        assert not err
        assert len(text) < 6000
        assert "characters truncated" in text
        dropped = int(text.split("[... ")[1].split(" characters")[0])
        assert dropped == 20 * 1024 * 1024 - 5000
        peak_growth_mb = (rss_kb(pid, "VmHWM") - before) / 1024
        assert peak_growth_mb < 100, f"server peak RSS grew by {peak_growth_mb:.0f} MB"
        await assert_next_cell_works(client)


async def test_one_megabyte_of_code(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        code = "data = '" + "z" * 2**20 + "'\n" + "total = 0\n" + "total += 1\n" * 20_000 + "print(len(data), total)"
        assert len(code) > 2**20
        text, err = await run_cell(client, code)
        assert (text.strip(), err) == (f"{2**20} 20000", False), text[:500]


async def test_binary_and_invalid_utf8_output(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        code = (
            "import os, sys\n"
            "os.write(1, bytes(range(256)) + b'\\xff\\xfe\\xc3(\\n')\n"
            "print(b'\\xff\\xfe'.decode('utf-8', 'surrogateescape').encode('utf-8', 'replace').decode())\n"
            "print('nul: \\x00 end')\n"
            "sys.stderr.write('after binary\\n')"
        )
        text, _ = await run_cell(client, code)
        assert "after binary" in text, text
        assert "nul:" in text
        await assert_next_cell_works(client)


VALIDATION_CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("execute_ipython_cell", {}, ["'code' is required"]),
    ("execute_ipython_cell", {"code": 123}, ["'code' must be a string, got int"]),
    ("execute_ipython_cell", {"code": "1", "timeout": 86401}, ["'timeout' must be at most 86400"]),
    ("execute_ipython_cell", {"code": "1", "timeout": 0}, ["'timeout' must be greater than 0"]),
    ("execute_ipython_cell", {"code": "1", "timeout": True}, ["'timeout' must be a number, got bool"]),
    ("execute_ipython_cell", {"code": "1", "timeout": "10"}, ["'timeout' must be a number, got str"]),
    ("execute_ipython_cell", {"code": "1", "max_output_chars": 1.5}, ["'max_output_chars' must be a whole number"]),
    ("execute_ipython_cell", {"code": "1", "max_output_chars": True}, ["'max_output_chars' must be a whole number"]),
    (
        "execute_ipython_cell",
        {"code": "1", "max_output_chars": 10_000_001},
        ["'max_output_chars' must be at most 10000000"],
    ),
    ("register_mcp_server", {"server_name": 5, "server_params": {}}, ["'server_name' must be a string"]),
    ("register_mcp_server", {"server_name": "ok", "server_params": "x"}, ["'server_params' must be an object"]),
    ("register_mcp_server", {"server_name": "1bad", "server_params": {"command": "x"}}, ["identifier"]),
    ("install_package", {"package_name": 5}, ["'package_name' must be a string"]),
    ("install_package", {"package_name": ""}, ["empty"]),
    # unknown arguments are refused, not ignored (a misspelt timeout would run with the default)
    ("execute_ipython_cell", {"code": "1", "timout": 5}, ["unknown argument(s) 'timout'", "'timeout'"]),
    ("reset", {"force": True}, ["unknown argument(s) 'force'", "no arguments"]),
]


async def test_parameter_validation_says_what_is_allowed(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        unclear = []
        for tool, args, needles in VALIDATION_CASES:
            result = await client.call_tool(tool, args)
            text = text_of(result)
            if not result.is_error or not all(n in text for n in needles) or "pydantic.dev" in text:
                unclear.append((tool, args, text))
        assert not unclear, unclear
        await assert_next_cell_works(client)
