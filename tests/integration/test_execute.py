"""Acceptance 1–6, 9, 10 of issue 2: real bwrap, real kernel, real MCP client over stdio."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IPYFENCE, require_bwrap, run_cell, server_env, text_of
from tests.integration.procs import processes_matching, server_pid, wait_until_gone

pytestmark = pytest.mark.anyio

ANSI_ESC = "\x1b"


async def test_state_persists_and_errors_are_clean(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        text, err = await run_cell(client, "x = 41\ndef bump(v):\n    return v + 1")
        assert not err, text
        text, err = await run_cell(client, "print(bump(x))")
        assert (text.strip(), err) == ("42", False)
        # an expression's value comes back as execute_result text
        text, err = await run_cell(client, "x * 2")
        assert (text.strip(), err) == ("82", False)

        text, err = await run_cell(client, "print('before the error')\nraise ValueError('boom')")
        assert err is True
        assert ANSI_ESC not in text
        assert "ValueError" in text and "boom" in text
        assert text.index("before the error") < text.index("ValueError")
        assert "Traceback" in text or "---" in text

        # the kernel survives an exception and still has its state
        text, err = await run_cell(client, "print(x)")
        assert (text.strip(), err) == ("41", False)


async def test_reset_clears_state(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        await run_cell(client, "gone = 1")
        result = await client.call_tool("reset", {})
        assert not result.is_error
        assert "reset" in text_of(result).lower()
        text, err = await run_cell(client, "gone")
        assert err and "NameError" in text


async def test_timeout_returns_partial_output_and_keeps_state(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        await run_cell(client, "kept = 'still here'")
        code = "import time\nprint('partial output', flush=True)\nwhile True:\n    time.sleep(0.05)"
        text, err = await run_cell(client, code, timeout=2)
        assert err is True
        assert "partial output" in text
        assert "timed out" in text
        assert "state is kept" in text.lower()
        text, err = await run_cell(client, "print(kept)")
        assert (text.strip(), err) == ("still here", False)


async def test_sigint_ignoring_loop_is_recovered_by_restart(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        await run_cell(client, "lost = 1")
        code = (
            "import signal\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "print('ignoring SIGINT', flush=True)\n"
            "while True:\n    pass\n"
        )
        text, err = await run_cell(client, code, timeout=2)
        assert err is True
        assert "ignoring SIGINT" in text
        assert "restarted" in text and "lost" in text  # says plainly that state was lost
        # a fresh, working kernel; the old variables are gone
        text, err = await run_cell(client, "print(1 + 1)")
        assert (text.strip(), err) == ("2", False)
        text, err = await run_cell(client, "lost")
        assert err and "NameError" in text


async def test_truncation_keeps_head_and_tail(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        code = "for i in range(2000):\n    print(f'line{i:04d}')"
        text, err = await run_cell(client, code, max_output_chars=200)
        assert not err
        assert text.startswith("line0000\n")
        assert text.rstrip().endswith("line1999")
        assert "characters truncated" in text and "max_output_chars=200" in text
        assert "line1000" not in text
        dropped = int(text.split("[... ")[1].split(" characters")[0])
        assert dropped == 2000 * 9 - 200
        assert len(text) < 400


async def test_matplotlib_png_is_image_content(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        code = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
        result = await client.call_tool("execute_ipython_cell", {"code": code, "timeout": 120})
        assert not result.is_error, text_of(result)
        images = [b for b in result.content if getattr(b, "type", None) == "image"]
        assert len(images) == 1
        assert images[0].mime_type == "image/png"
        assert base64.b64decode(images[0].data).startswith(b"\x89PNG\r\n\x1a\n")
        assert "image/png" in text_of(result)  # plus a short text note


async def test_only_kernel_env_variables_reach_the_kernel(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    (workspace / ".env").write_text("KERNEL_ENV_FROM_DOTENV=dotenv-value\nDOTENV_SECRET=dotenv-secret-xyz\n")
    env = {"KERNEL_ENV_FROM_SERVER": "server-value", "SERVER_SECRET": "server-secret-xyz"}
    async with make_client(env=env) as client:
        code = (
            "import os, json\n"
            "proc = open('/proc/self/environ', 'rb').read().decode()\n"
            "print(json.dumps({'env': dict(os.environ), 'proc': proc}))"
        )
        text, err = await run_cell(client, code)
        assert not err, text
        import json

        seen = json.loads(text)
        kenv, proc = seen["env"], seen["proc"]
        assert kenv["FROM_SERVER"] == "server-value"
        assert kenv["FROM_DOTENV"] == "dotenv-value"
        for blob in (repr(kenv), proc):
            assert "KERNEL_ENV_" not in blob
            assert "server-secret-xyz" not in blob and "SERVER_SECRET" not in blob
            assert "dotenv-secret-xyz" not in blob and "DOTENV_SECRET" not in blob
            assert "IPYFENCE_STATE_DIR" not in blob
        # nothing else from the server's environment leaked in
        allowed = {
            "FROM_SERVER",
            "FROM_DOTENV",
            "PATH",
            "LANG",
            "HOME",
            "TMPDIR",
            "IPYTHONDIR",
            "MPLCONFIGDIR",
            "JUPYTER_RUNTIME_DIR",
            "PYTHONPATH",
            "PYTHONNOUSERSITE",
            "PYDEVD_DISABLE_FILE_VALIDATION",
            "TERM",
            "PIP_NO_INDEX",  # pip in a cell fails at once (pipguard)
            "PIP_RETRIES",
            "PIP_DISABLE_PIP_VERSION_CHECK",
            "IPYFENCE_BRIDGE_SOCKET",
            "IPYFENCE_BRIDGE_TOKEN",
        }
        # bwrap sets PWD (--chdir); ipykernel sets a few of its own when it starts
        kernel_own = {
            "PWD",
            "MPLBACKEND",
            "PAGER",
            "GIT_PAGER",
            "PYDEVD_USE_FRAME_EVAL",
        }
        extra = set(kenv) - allowed - kernel_own
        assert not extra, f"unexpected variables in the kernel: {sorted(extra)}"
        # ipykernel's colour forcing is undone before the first cell (ipyfence.kernel_plain_env)
        assert kenv["TERM"] == "dumb"
        assert "PYTHONSTARTUP" not in kenv


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"max_output_chars": 0}, "max_output_chars"),
        ({"max_output_chars": -5}, "max_output_chars"),
        ({"timeout": "soon"}, "timeout"),
    ],
)
async def test_invalid_arguments_are_tool_errors(make_client: Any, args: dict[str, Any], needle: str) -> None:
    require_bwrap()
    async with make_client() as client:
        result = await client.call_tool("execute_ipython_cell", {"code": "print('ran')", **args})
        assert result.is_error
        text = text_of(result)
        assert needle in text
        assert text.strip() != "ran"  # the cell did not run
        # the server is still fine afterwards
        text, err = await run_cell(client, "print('ok')")
        assert (text.strip(), err) == ("ok", False)


async def test_no_kernel_left_after_client_disconnects(make_client: Any, workspace: Path) -> None:
    require_bwrap()
    async with make_client() as client:
        text, err = await run_cell(client, "import os\nprint(os.environ['IPYFENCE_BRIDGE_SOCKET'])")
        assert not err
        runtime_root = str(Path(text.strip()).parent.parent)  # <runtime_root>/k1/bridge.sock
        await client.call_tool("reset", {})  # a second kernel (and a standby) to clean up too
        before = processes_matching(str(workspace), runtime_root)
        assert any("ipyfence.kernel_boot" in line for line in before.values()), before
        assert any("bwrap" in line for line in before.values()), before
    left = wait_until_gone(str(workspace), runtime_root)
    assert not left, f"processes left after disconnect: {left}"
    assert not os.path.exists(runtime_root)


def _start_server(workspace: Path, state_dir: Path) -> subprocess.Popen[bytes]:
    """A server whose stdin stays open (as under a supervisor), once its kernel is up."""
    proc = subprocess.Popen(
        [IPYFENCE, "--workspace", str(workspace), "--no-standby"],
        env=server_env(state_dir),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any("ipyfence.kernel_boot" in c for c in processes_matching(str(workspace)).values()):
            return proc
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    pytest.fail("the kernel never started")


def _kernel_processes(workspace: Path, server: int) -> dict[int, str]:
    return {p: c for p, c in processes_matching(str(workspace)).items() if p != server}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_kernel_left_after_server_is_signalled(workspace: Path, state_dir: Path, sig: signal.Signals) -> None:
    """SIGTERM: a clean shutdown; SIGKILL: the parent died, bwrap --die-with-parent takes the kernel down."""
    require_bwrap()
    proc = _start_server(workspace, state_dir)
    try:
        proc.send_signal(sig)
        deadline = time.monotonic() + 20
        left = _kernel_processes(workspace, proc.pid)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _kernel_processes(workspace, proc.pid)
        assert not left, f"processes left after {sig.name}: {left}"
    finally:
        proc.kill()
        proc.wait()


def test_server_exits_on_sigterm_while_stdin_is_open(workspace: Path, state_dir: Path) -> None:
    require_bwrap()
    proc = _start_server(workspace, state_dir)
    try:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 20s of SIGTERM while its stdin stays open")
    finally:
        proc.kill()
        proc.wait()


async def test_server_pid_lookup_helper(make_client: Any, workspace: Path) -> None:
    """The escape tests rely on finding the server by its command line; check that here."""
    require_bwrap()
    async with make_client() as client:
        pid = server_pid(str(workspace))
        assert "ipyfence" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        await run_cell(client, "1")


async def test_500_consecutive_cells_return_exactly_their_output(make_client: Any) -> None:
    require_bwrap()
    async with make_client("--no-standby") as client:
        wrong: list[tuple[int, str, bool]] = []
        for i in range(500):
            text, err = await run_cell(client, f"print({i})")
            if text != f"{i}\n" or err:
                wrong.append((i, text, err))
        assert not wrong, f"{len(wrong)} of 500 cells returned the wrong output, e.g. {wrong[:5]}"
