"""The real `ipyfence` CLI in a subprocess: --print-policy snapshot, bad configs, doctor, no-bwrap."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import ipyfence
from ipyfence.policy import profiles_dir
from ipyfence.sandbox.plan import default_server_install
from tests.conftest import IPYFENCE, require_bwrap, server_env

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("IPYFENCE_UPDATE_SNAPSHOTS") == "1"


def run_cli(
    *args: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [IPYFENCE, *args],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def normalise(text: str, workspace: Path, state_dir: Path) -> str:
    """Replace the machine- and run-specific parts so the snapshot is stable."""
    replacements = {
        str(workspace): "<WORKSPACE>",
        str(state_dir): "<STATE>",
        str(profiles_dir()): "<PROFILES>",
        str(Path(IPYFENCE).parent): "<VENV_BIN>",
        str(Path(ipyfence.__file__).resolve().parent): "<IPYFENCE_PKG>",
    }
    for old in sorted(replacements, key=len, reverse=True):
        text = text.replace(old, replacements[old])
    # the temp dir only as a whole leading path component (not the /tmp inside /var/tmp)
    tmp = re.escape(tempfile.gettempdir())
    text = re.sub(rf"(?<![\w/<]){tmp}(?=[/\s'\"]|$)", "<TMP>", text, flags=re.MULTILINE)
    text = re.sub(r"workspaces/ws-[0-9a-f]{12}", "workspaces/ws-<DIGEST>", text)
    text = re.sub(r"^\S*/bwrap ", "<BWRAP> ", text, flags=re.MULTILINE)
    text = re.sub(r"<VENV_BIN>/python3?(\.\d+)?\b", "<VENV_BIN>/python", text)
    return text


def check_snapshot(name: str, actual: str) -> None:
    path = SNAPSHOTS / name
    if UPDATE or not path.exists():
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(actual)
        if not UPDATE:
            pytest.fail(f"snapshot {path} did not exist and was written; check it in and re-run")
    assert actual == path.read_text(), f"{name} changed; re-run with IPYFENCE_UPDATE_SNAPSHOTS=1 if intended"


def test_print_policy_snapshot(workspace: Path, state_dir: Path) -> None:
    require_bwrap()
    proc = run_cli("--workspace", str(workspace), "--print-policy", env=server_env(state_dir))
    assert proc.returncode == 0, proc.stderr
    report_text, _, command = proc.stdout.partition("\n\n# kernel launch command\n")
    report = json.loads(report_text)
    # the parts that matter, asserted directly as well as through the snapshot
    assert report["sandbox"] is True
    assert report["backend"] == "bwrap"
    assert report["workspace"] == str(workspace)
    assert report["policy"]["filesystem"]["allowWrite"] == [str(workspace)]
    assert report["policy"]["network"]["allowedDomains"] == []
    assert report["weakenings"] == []
    assert not any(k.startswith("KERNEL_ENV_") for k in report["kernel_env_keys"])
    assert "--unshare-net" in command and "--clearenv" in command
    check_snapshot("print_policy_default.txt", normalise(without_install_binds(report, command), workspace, state_dir))


def without_install_binds(report: dict[str, object], command: str) -> str:
    """The report minus the binds of the server's own install.

    They appear only when the checkout lives under a directory the sandbox replaces (a clone in
    /tmp), so the snapshot would otherwise depend on where the repository was cloned.
    """
    installs = [str(p) for p in default_server_install()]
    mounts = report.get("mounts")
    if isinstance(mounts, dict):
        mounts["reallowed"] = [p for p in mounts["reallowed"] if p not in installs]
    for p in installs:
        command = command.replace(f" --ro-bind {p} {p}", "")
    return json.dumps(report, indent=2) + "\n\n# kernel launch command\n" + command


def test_print_policy_redacts_kernel_env_and_masks_env_files(workspace: Path, state_dir: Path) -> None:
    require_bwrap()
    (workspace / ".env").write_text("KERNEL_ENV_API_KEY=sk-very-secret-value\n")
    (workspace / "sub").mkdir()
    (workspace / "sub" / ".env.local").write_text("X=1\n")
    proc = run_cli("--workspace", str(workspace), "--print-policy", env=server_env(state_dir))
    assert proc.returncode == 0, proc.stderr
    assert "sk-very-secret-value" not in proc.stdout
    assert "API_KEY" in proc.stdout
    report = json.loads(proc.stdout.partition("\n\n# kernel launch command\n")[0])
    assert set(report["mounts"]["masked_files"]) == {str(workspace / ".env"), str(workspace / "sub" / ".env.local")}


def test_print_policy_no_sandbox(workspace: Path, state_dir: Path) -> None:
    proc = run_cli("--workspace", str(workspace), "--no-sandbox", "--print-policy", env=server_env(state_dir))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.partition("\n\n# kernel launch command\n")[0])
    assert report["sandbox"] is False
    assert report["backend"] == "none"
    check_snapshot("print_policy_no_sandbox.txt", normalise(proc.stdout, workspace, state_dir))


BAD_CONFIGS = {
    "bad-json": ("{not json", "invalid JSON at line 1"),
    "unknown-key": ('{"filesystem": {"denyReed": []}}', "filesystem.denyReed: unknown key"),
    "wrong-type": ('{"network": {"allowLocalBinding": "no"}}', "network.allowLocalBinding: expected true or false"),
    "escaping-path": ('{"filesystem": {"allowWrite": ["../.."]}}', "filesystem.allowWrite[1]: relative path"),
    "empty-path": ('{"filesystem": {"denyRead": [""]}}', "filesystem.denyRead[0]: path cannot be empty"),
    "disabled": ('{"filesystem": {"disabled": true}}', "filesystem.disabled: ipyfence does not support"),
    "not-object": ("42", "expected an object, got integer"),
    "missing": (None, "sandbox config file not found"),
}


@pytest.mark.parametrize("mode", ["serve", "print-policy"])
@pytest.mark.parametrize("kind", sorted(BAD_CONFIGS))
def test_bad_sandbox_config_is_one_clear_line(
    tmp_path: Path, workspace: Path, state_dir: Path, kind: str, mode: str
) -> None:
    content, expected = BAD_CONFIGS[kind]
    cfg = tmp_path / f"{kind}.json"
    if content is not None:
        cfg.write_text(content)
    extra = ["--print-policy"] if mode == "print-policy" else []
    proc = run_cli("--workspace", str(workspace), "--sandbox-config", str(cfg), *extra, env=server_env(state_dir))
    assert proc.returncode != 0
    assert proc.stdout == ""  # stdout belongs to MCP; nothing leaks there
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("Error: ")
    assert str(cfg) in lines[0]
    assert expected in lines[0], lines[0]


def test_missing_workspace_is_created(tmp_path: Path, state_dir: Path) -> None:
    """As ipybox does: a workspace that does not exist yet is created, with a log line."""
    missing = tmp_path / "no-such-dir" / "ws"
    proc = run_cli("--workspace", str(missing), "--print-policy", env=server_env(state_dir))
    assert proc.returncode == 0, proc.stderr
    assert missing.is_dir()
    assert f"created the workspace {missing}" in proc.stderr


def test_root_workspace_is_refused_naming_the_workspace(state_dir: Path) -> None:
    proc = run_cli("--workspace", "/", "--print-policy", env=server_env(state_dir))
    assert proc.returncode != 0
    assert "workspace '/' is the filesystem root" in proc.stderr
    assert "profile" not in proc.stderr and "Traceback" not in proc.stderr


def test_version(state_dir: Path) -> None:
    import ipyfence

    proc = run_cli("--version", env=server_env(state_dir))
    assert proc.returncode == 0 and proc.stdout.strip() == f"ipyfence, version {ipyfence.__version__}"


def test_ipybox_flags_are_accepted_with_a_warning(workspace: Path, state_dir: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "srt.json"
    cfg.write_text('{"filesystem": {"denyRead": ["~/.ssh"]}}')
    args = ["--workspace", str(workspace), "--sandbox", "--tool-server-port", "8900", "--kernel-gateway-host"]
    args += ["localhost", "--sandbox-settings", str(cfg), "--log-level", "CRITICAL", "--print-policy"]
    proc = run_cli(*args, env=server_env(state_dir))
    assert proc.returncode == 0, proc.stderr
    assert os.path.expanduser("~/.ssh") in json.loads(proc.stdout.split("\n\n#")[0])["policy"]["filesystem"]["denyRead"]
    proc = run_cli(*args[:-3], "--log-level", "warning", "--print-policy", env=server_env(state_dir))
    assert "--tool-server-port is an ipybox option that does not apply" in proc.stderr
    assert "--sandbox-settings is ipybox's older name" in proc.stderr


def test_workspace_that_is_a_file_is_a_clean_error(tmp_path: Path, state_dir: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    proc = run_cli("--workspace", str(f), env=server_env(state_dir))
    assert proc.returncode != 0
    assert "not a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_profile(workspace: Path, state_dir: Path) -> None:
    proc = run_cli("--workspace", str(workspace), "--profile", "nope", "--print-policy", env=server_env(state_dir))
    assert proc.returncode != 0
    assert "unknown profile 'nope'" in proc.stderr and "default" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_doctor_exits_zero_here(state_dir: Path) -> None:
    require_bwrap()
    proc = run_cli("doctor", env=server_env(state_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ok ] bwrap" in proc.stdout
    assert "namespaces work" in proc.stdout


@pytest.fixture
def path_without_bwrap(tmp_path: Path) -> Path:
    """A PATH directory holding only python (and prlimit), so that `bwrap` cannot be found."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    return bindir


def test_no_bwrap_server_refuses_to_start(workspace: Path, state_dir: Path, path_without_bwrap: Path) -> None:
    env = {**server_env(state_dir), "PATH": str(path_without_bwrap)}
    proc = run_cli("--workspace", str(workspace), env=env)
    assert proc.returncode != 0
    assert proc.stdout == ""  # never answered MCP: it did not start at all
    assert "Traceback" not in proc.stderr
    assert "bwrap" in proc.stderr
    assert "apt-get install bubblewrap" in proc.stderr  # says how to fix it
    assert "serving MCP" not in proc.stderr


def test_no_bwrap_doctor_fails_with_fix(state_dir: Path, path_without_bwrap: Path) -> None:
    env = {**server_env(state_dir), "PATH": str(path_without_bwrap)}
    proc = run_cli("doctor", env=env)
    assert proc.returncode != 0
    assert "[FAIL] bwrap: not found" in proc.stdout
    assert "fix: sudo apt-get install bubblewrap" in proc.stdout


def test_broken_bwrap_server_refuses_to_start(workspace: Path, state_dir: Path, path_without_bwrap: Path) -> None:
    """bwrap is installed but cannot create namespaces (userns disabled): refuse, say how to fix."""
    fake = path_without_bwrap / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {**server_env(state_dir), "PATH": f"{path_without_bwrap}:/usr/bin:/bin"}
    proc = run_cli("--workspace", str(workspace), env=env)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert "cannot create namespaces" in proc.stderr
    assert "sysctl" in proc.stderr  # the fix
    assert "serving MCP" not in proc.stderr


def test_no_sandbox_warns_on_stderr(workspace: Path, state_dir: Path) -> None:
    """--no-sandbox is explicit and loud; with stdin closed the server exits cleanly."""
    proc = run_cli("--workspace", str(workspace), "--no-sandbox", env=server_env(state_dir))
    assert "UNCONFINED" in proc.stderr
    # The banner's connect line is runnable as printed: absolute executable, every flag.
    connect = next(line for line in proc.stderr.splitlines() if "connect: claude mcp add" in line)
    command = shlex.split(connect.split(" -- ", 1)[1])
    assert command == [os.path.abspath(IPYFENCE), "--workspace", str(workspace), "--no-sandbox"]
    assert "Traceback" not in proc.stderr


@pytest.mark.anyio
async def test_state_lists_and_removes_a_workspace(workspace: Path, state_dir: Path) -> None:
    """`ipyfence state` shows where each workspace's state lives; a running server's state is not removed."""
    from tests.conftest import ipyfence_client, run_cell

    async with ipyfence_client(workspace, state_dir, "--no-sandbox") as client:
        await run_cell(client, "1")
        listing = run_cli("state", env=server_env(state_dir))
        assert listing.returncode == 0 and str(workspace) in listing.stdout and "running (pid" in listing.stdout
        busy = run_cli("state", "--remove", str(workspace), env=server_env(state_dir))
        assert busy.returncode != 0 and "stop it first" in busy.stderr
    gone = run_cli("state", "--remove", str(workspace), env=server_env(state_dir))
    assert gone.returncode == 0, gone.stderr
    assert str(workspace) not in run_cli("state", env=server_env(state_dir)).stdout
    unknown = run_cli("state", "--remove", "/no/such/workspace", env=server_env(state_dir))
    assert unknown.returncode != 0 and "no ipyfence state for" in unknown.stderr and "Traceback" not in unknown.stderr


def test_workspace_with_glob_characters_is_escaped(tmp_path: Path, state_dir: Path) -> None:
    """`ws[1]*` joined with `**/.env` must not become a pattern that never matches `ws[1]*/.env`."""
    ws = tmp_path / "ws[1]*"
    ws.mkdir()
    (ws / ".env").write_text("S=1\n")
    proc = run_cli("--workspace", str(ws), "--print-policy", env=server_env(state_dir))
    assert proc.returncode == 0, proc.stderr
    assert str(ws / ".env") in json.loads(proc.stdout.split("\n\n#")[0])["mounts"]["masked_files"]
    # Control: joined unescaped, the same pattern does not match the literal path.
    from wcmatch import glob as wcglob

    assert not wcglob.globmatch(str(ws / ".env"), f"{ws}/**/.env", flags=wcglob.GLOBSTAR | wcglob.DOTGLOB)
