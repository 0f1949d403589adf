"""The systems under test and how to start each one (argv + environment)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
IPYFENCE = str(Path(sys.executable).with_name("ipyfence"))
IPYBOX_VENV = BENCH_DIR / ".venv-ipybox"
IPYBOX_VERSION = "0.9.2"


@dataclass
class System:
    key: str
    label: str
    argv: list[str]  # the workspace is appended as --workspace DIR
    kind: str = "mcp"  # "mcp" or "floor"
    ipyfence: bool = True
    error: str | None = None  # set when the system cannot be run at all
    extra_env: dict[str, str] = field(default_factory=dict)

    def command(self, workspace: Path) -> list[str]:
        return [*self.argv, "--workspace", str(workspace)]


def server_env(pip_env: dict[str, str], state_dir: Path, errlog: Path, extra: dict[str, str]) -> dict[str, str]:
    """The host env minus KERNEL_ENV_* and PIP_*, plus the bench's pip settings (same for every system)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERNEL_ENV_", "PIP_"))}
    env.update(pip_env)
    env["IPYFENCE_STATE_DIR"] = str(state_dir)
    env["BENCH_ERRLOG"] = str(errlog)
    env.update(extra)
    return env


# An earlier ipyfence build (its own venv's `ipyfence`), measured in the same run for before/after figures.
BASELINE_ENV = "BENCH_BASELINE_IPYFENCE"


def ipyfence_systems() -> list[System]:
    common = [IPYFENCE, "--log-level", "WARNING"]
    systems = [
        System("ipyfence", "ipyfence (bwrap)", [*common, "--sandbox-backend", "bwrap"]),
        System("nosandbox", "ipyfence --no-sandbox", [*common, "--no-sandbox"]),
        System("srt", "ipyfence (srt)", [*common, "--sandbox-backend", "srt"]),
    ]
    baseline = os.environ.get(BASELINE_ENV)
    base = System("baseline", "ipyfence baseline (bwrap)", [baseline or "", "--log-level", "WARNING"])
    base.argv += ["--sandbox-backend", "bwrap"]
    if not baseline or not os.access(baseline, os.X_OK):
        base.error = f"set {BASELINE_ENV} to an earlier build's ipyfence executable"
    return [*systems, base]


def ensure_ipybox(log: object = None) -> System:
    """ipybox 0.9.2 from PyPI in bench/.venv-ipybox (mcp<2, or it does not import). Never raises."""
    exe = IPYBOX_VENV / "bin" / "ipybox"
    py = IPYBOX_VENV / "bin" / "python"
    system = System("ipybox", f"ipybox {IPYBOX_VERSION}", [str(exe), "--log-level", "WARNING"], ipyfence=False)
    probe = [str(py), "-c", "import importlib.metadata as m, ipybox.mcp_server; print(m.version('ipybox'))"]
    try:
        ok = exe.exists() and subprocess.run(probe, capture_output=True, text=True, timeout=60).stdout.strip()
        if ok != IPYBOX_VERSION:
            print(f"bench: installing ipybox {IPYBOX_VERSION} into {IPYBOX_VENV}", file=sys.stderr)
            venv.create(IPYBOX_VENV, with_pip=True, clear=True)
            pip = [str(py), "-m", "pip", "install", "-q", f"ipybox=={IPYBOX_VERSION}", "mcp<2"]
            proc = subprocess.run(pip, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                tail = [ln for ln in proc.stderr.splitlines() if "is ignored" not in ln][-5:]
                system.error = "pip install failed: " + " | ".join(tail)
                return system
            check = subprocess.run(probe, capture_output=True, text=True, timeout=60)
            if check.stdout.strip() != IPYBOX_VERSION:
                system.error = f"ipybox does not import: {check.stderr.strip().splitlines()[-1:]}"
    except (OSError, subprocess.SubprocessError) as exc:
        system.error = f"install failed: {exc}"
    return system


def ipybox_uninstall(package: str) -> None:
    """Between install_package repetitions: ipybox installs into its own venv."""
    py = IPYBOX_VENV / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-y", "-q", package],
        capture_output=True,
        env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
        timeout=120,
    )
