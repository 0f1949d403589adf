"""ipyfence is a normal Python package: a wheel built from this checkout installs into a fresh venv
and serves a sandboxed cell, with its profiles (what `pipx install` / `uv tool install` do)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import require_bwrap, run_cell, server_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.anyio


def _run(*argv: str | Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


async def test_wheel_installs_and_serves_a_sandboxed_cell(tmp_path: Path, state_dir: Path) -> None:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    require_bwrap()
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, ROOT)
    wheel = next(dist.glob("ipyfence-*.whl"))
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    # The dependencies come from the test environment (no second download); the package itself only
    # from the wheel: a plain path in a .pth file does not run the editable install's finder there.
    purelib = Path(sysconfig.get_paths()["purelib"])
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "test-deps.pth").write_text(f"{purelib}\n")
    _run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", wheel)
    where = _run(venv / "bin" / "python", "-c", "import ipyfence; print(ipyfence.__file__)")
    assert where.startswith(str(site)), where  # the wheel's copy, not the checkout
    assert "default" in _run(venv / "bin" / "ipyfence", "profiles").split()
    params = StdioServerParameters(
        command=str(venv / "bin" / "ipyfence"), args=["--workspace", str(tmp_path)], env=server_env(state_dir)
    )
    async with Client(params) as client:
        text, err = await run_cell(client, "import sys; print(sys.prefix, 6 * 7)")
        assert not err and f"{venv} 42" in text, text
        text, err = await run_cell(client, "open('/etc/ipyfence-wheel-test', 'w')")
        assert err and "Read-only file system" in text  # sandboxed
