"""The srt renderer as data: settings, argv and environment for Linux and macOS.

Snapshots live in tests/unit/snapshots/srt_<platform>.json. After an intended change,
regenerate them with ``UPDATE_SNAPSHOTS=1 pytest tests/unit/test_srt_render.py`` and review
the diff. The macOS output is verified only here (CI runs Linux), plus srt's own schema.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ipyfence.policy import apply_settings, load_profile, resolve_paths
from ipyfence.sandbox import srt
from ipyfence.sandbox.bwrap import LaunchOptions
from ipyfence.sandbox.plan import MountPlan, SandboxPaths

SNAPSHOTS = Path(__file__).parent / "snapshots"
SRT_PACKAGE = Path("/usr/lib/node_modules/@anthropic-ai/sandbox-runtime")

# Fixed, machine-independent paths as each platform would have them.
FAKE = {
    "linux": {
        "workspace": "/home/user/project",
        "runtime_root": "/tmp/ipyfence-abcd1234",
        "state_root": "/home/user/.local/state/ipyfence",
        "python": "/home/user/project/.venv/bin/python",
        "venv": "/home/user/project/.venv",
        "tools": ["/usr/bin", "/usr/local/bin"],
    },
    "darwin": {
        "workspace": "/Users/me/project",
        "runtime_root": "/var/folders/xy/abc123/T/ipyfence-abcd1234",
        "state_root": "/Users/me/.local/state/ipyfence",
        "python": "/Users/me/.venvs/ipyfence/bin/python",
        "venv": "/Users/me/.venvs/ipyfence",
        "tools": ["/opt/homebrew/bin", "/usr/bin"],
    },
}


def fake_paths(platform: srt.Platform) -> SandboxPaths:
    f = FAKE[platform]
    runtime = Path(str(f["runtime_root"]))
    state = Path(str(f["state_root"]))
    return SandboxPaths(
        workspace=Path(str(f["workspace"])),
        kernel_dir=runtime / "k1",
        runtime_root=runtime,
        state_root=state,
        packages_dir=state / "workspaces" / "project-0123456789ab" / "site-packages",
        server_install=(Path(str(f["venv"])),),
        python=Path(str(f["python"])),
    )


def fake_plan(paths: SandboxPaths, platform: srt.Platform) -> MountPlan:
    """What plan_mounts would find on such a machine (it is the impure step, tested elsewhere)."""
    ws = str(paths.workspace)
    socket_dirs = ["/run", "/var/run", "/var/tmp", "/dev/shm"] if platform == "linux" else ["/var/tmp"]
    readonly = [f"{ws}/.git/hooks", f"{ws}/.git/config", f"{ws}/.vscode"]
    if platform == "linux":
        readonly.append(f"{ws}/.venv")  # the server's own venv inside the workspace
    return MountPlan(
        writable=(ws,),
        hidden_dirs=(*socket_dirs, str(paths.runtime_root), str(paths.state_root)),
        masked_files=(f"{ws}/.env", f"{ws}/app/.env.local"),
        readonly=tuple(readonly),
        reallowed=(str(paths.packages_dir),),
        warnings=(),
    )


def kernel_env(paths: SandboxPaths) -> dict[str, str]:
    k = paths.kernel_dir
    return {
        "PATH": f"{paths.python.parent}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(k / "home"),
        "TMPDIR": "/tmp",
        "IPYTHONDIR": str(k / "ipython"),
        "MPLCONFIGDIR": str(k / "mpl"),
        "JUPYTER_RUNTIME_DIR": str(k / "jupyter"),
        "PYTHONPATH": f"{paths.packages_dir}:{paths.workspace}",
        "PYTHONNOUSERSITE": "1",
        "TERM": "dumb",
        "API_KEY": "from-KERNEL_ENV_API_KEY",
        "IPYFENCE_BRIDGE_SOCKET": str(k / "bridge.sock"),
        "IPYFENCE_BRIDGE_TOKEN": "<token>",
    }


def render_for(platform: srt.Platform, **policy_doc: Any) -> srt.SrtRender:
    paths = fake_paths(platform)
    policy = load_profile("default")
    if policy_doc:
        policy = apply_settings(policy, policy_doc, "test-config.json")
    policy = resolve_paths(policy, paths.workspace)
    argv = [str(paths.python), "-m", "ipykernel_launcher", "-f", str(paths.kernel_dir / "kernel.json")]
    return srt.render(
        policy,
        fake_plan(paths, platform),
        paths,
        kernel_env(paths),
        argv,
        platform=platform,
        srt=f"{FAKE[platform]['tools'][0]}/srt",  # type: ignore[index]
        tool_dirs=FAKE[platform]["tools"],  # type: ignore[arg-type]
    )


def check_snapshot(name: str, data: Any) -> None:
    path = SNAPSHOTS / name
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1" or not path.exists():
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs; rerun with UPDATE_SNAPSHOTS=1 if the change is intended"


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_snapshot(platform: srt.Platform) -> None:
    r = render_for(platform)
    check_snapshot(f"srt_{platform}.json", {"settings": r.settings, "argv": r.argv, "env": r.env})


def test_linux_unix_sockets_all_allowed_because_seccomp_cannot_filter_by_path() -> None:
    net = render_for("linux").settings["network"]
    assert net["allowAllUnixSockets"] is True
    assert "allowUnixSockets" not in net
    assert net["allowLocalBinding"] is False


def test_darwin_unix_sockets_only_the_kernel_dir() -> None:
    paths = fake_paths("darwin")
    net = render_for("darwin").settings["network"]
    assert net["allowUnixSockets"] == [str(paths.kernel_dir)]
    assert "allowAllUnixSockets" not in net
    assert net["allowLocalBinding"] is False


def test_linux_hides_host_sockets_tmp_state_and_runtime_but_not_own_kernel_dir() -> None:
    paths = fake_paths("linux")
    fs = render_for("linux").settings["filesystem"]
    for hidden in ("/tmp", "/run", "/var/run", "/dev/shm", str(paths.runtime_root), str(paths.state_root)):
        assert hidden in fs["denyRead"]
    assert str(paths.kernel_dir) in fs["allowRead"]
    assert str(paths.kernel_dir) in fs["allowWrite"]
    assert str(paths.packages_dir) in fs["allowRead"]
    assert srt.srt_dir(paths) in fs["allowRead"]  # the socat bridge socket
    assert srt.settings_path(paths).startswith(str(paths.runtime_root))  # the policy file is hidden too


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_env_denies_and_protected_writes(platform: srt.Platform) -> None:
    paths = fake_paths(platform)
    ws = str(paths.workspace)
    fs = render_for(platform).settings["filesystem"]
    assert f"{ws}/**/.env" in fs["denyRead"] and f"{ws}/**/.env.*" in fs["denyRead"]
    assert f"{ws}/.env" in fs["denyRead"] and f"{ws}/app/.env.local" in fs["denyRead"]
    assert f"{ws}/.git/hooks" in fs["denyWrite"] and f"{ws}/.git/config" in fs["denyWrite"]
    assert fs["allowGitConfig"] is False
    if platform == "darwin":  # Seatbelt matches globs at access time: protect paths not yet created
        assert f"{ws}/**/.git/hooks" in fs["denyWrite"] and f"{ws}/**/.bashrc" in fs["denyWrite"]


def test_clean_environment_for_srt() -> None:
    paths = fake_paths("linux")
    env = render_for("linux").env
    assert set(env) == set(kernel_env(paths)) | {"CLAUDE_CODE_TMPDIR"}
    assert env["PATH"].endswith(":/usr/local/bin:/usr/bin:/bin")  # tool dirs already present: not repeated
    assert env["TMPDIR"] == srt.srt_dir(paths)
    assert env["CLAUDE_CODE_TMPDIR"] == str(paths.kernel_dir / "tmp")


def test_linux_argv_wraps_srt_for_cleanup_and_applies_rlimits() -> None:
    argv = render_for("linux").argv
    srt_at = argv.index("/usr/bin/srt")
    paths = fake_paths("linux")
    assert argv[:srt_at] == [
        "setpriv", "--pdeathsig", "KILL", "--", "setsid", "-f", "-w", "setpriv", "--pdeathsig", "TERM", "--",
        "env", "-C", str(paths.kernel_dir),
    ]  # fmt: skip
    assert argv[srt_at + 1 : srt_at + 4] == ["--settings", srt.settings_path(paths), "--"]
    assert argv[srt_at + 4 : srt_at + 7] == ["env", "-C", str(paths.workspace)]
    assert argv[srt_at + 7] == "prlimit" and "--as=8589934592" in argv and "--core=0" in argv
    assert argv[-3:-1] == ["ipykernel_launcher", "-f"]


def test_darwin_argv_has_no_linux_tools() -> None:
    argv = render_for("darwin").argv
    assert argv[:4] == ["/opt/homebrew/bin/srt", "--settings", srt.settings_path(fake_paths("darwin")), "--"]
    assert not {"prlimit", "setpriv", "setsid"} & set(argv)


def test_passthrough_keys_reach_srt() -> None:
    doc = {
        "network": {"allowedDomains": ["example.org"], "parentProxy": {"https": "http://127.0.0.1:3"}},
        "ignoreViolations": {"*": ["/x"]},
    }
    s = render_for("linux", **doc).settings
    assert s["network"]["allowedDomains"] == ["example.org"]
    assert s["network"]["parentProxy"] == {"https": "http://127.0.0.1:3"}
    assert s["ignoreViolations"] == {"*": ["/x"]}


def test_passthrough_cannot_override_socket_rules() -> None:
    policy = load_profile("default")
    policy = replace(policy, network=replace(policy.network, srt_extra={"allowAllUnixSockets": False}))
    paths = fake_paths("linux")
    s = srt.render_settings(resolve_paths(policy, paths.workspace), fake_plan(paths, "linux"), paths, "linux")
    assert s["network"]["allowAllUnixSockets"] is True


def test_extra_writable_for_installs() -> None:
    paths = fake_paths("linux")
    policy = resolve_paths(load_profile("default"), paths.workspace)
    opts = LaunchOptions(extra_writable=(str(paths.packages_dir),))
    s = srt.render_settings(policy, fake_plan(paths, "linux"), paths, "linux", opts)
    assert str(paths.packages_dir) in s["filesystem"]["allowWrite"]


def test_key_warnings() -> None:
    doc = {
        "allowPty": True,
        "enableWeakerNestedSandbox": True,
        "network": {"allowMachLookup": ["com.x"], "allowUnixSockets": ["/var/run/docker.sock"], "httpProxyPort": 9},
    }
    policy = apply_settings(load_profile("default"), doc, "cfg.json")
    linux = "\n".join(srt.key_warnings(policy, "linux"))
    assert "'allowPty' only applies on macOS" in linux
    assert "'network.allowMachLookup' only applies on macOS" in linux
    assert "allowUnixSockets has no effect on Linux" in linux
    assert "host's /proc" in linux
    assert "httpProxyPort replaces srt's filtering proxy" in linux
    darwin = "\n".join(srt.key_warnings(policy, "darwin"))
    assert "'enableWeakerNestedSandbox' only applies on Linux" in darwin
    assert "not enforced on macOS" in darwin  # the default profile sets limits
    assert "allowPty" not in darwin


def test_no_warnings_for_default_profile_on_linux() -> None:
    assert srt.key_warnings(load_profile("default"), "linux") == []


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_rendered_settings_pass_srts_own_schema(platform: srt.Platform, tmp_path: Path) -> None:
    """srt's zod schema (the one `srt --settings` applies) accepts what we render for both OSes."""
    node = shutil.which("node")
    if node is None or not (SRT_PACKAGE / "dist" / "index.js").is_file():
        pytest.skip("node / sandbox-runtime not installed")
    settings = render_for(platform, network={"parentProxy": {"https": "http://127.0.0.1:3"}}).settings
    cfg = tmp_path / "s.json"
    cfg.write_text(json.dumps(settings))
    script = (
        f"import('{SRT_PACKAGE}/dist/index.js').then(m => {{"
        f"const r = m.SandboxRuntimeConfigSchema.safeParse(JSON.parse(require('fs').readFileSync('{cfg}','utf8')));"
        "if (!r.success) { console.error(JSON.stringify(r.error.issues)); process.exit(1); } })"
    )
    proc = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_new_plan_fields_fail_closed_in_srt() -> None:
    """srt cannot pin or seal: pinned ancestors and sealed dot entries become read-only; unscanned
    subtrees and host sockets are denied for reading."""
    paths = fake_paths("linux")
    ws = str(paths.workspace)
    plan = replace(
        fake_plan(paths, "linux"),
        pinned=(f"{ws}/nest",),
        unscanned=(f"{ws}/flood",),
        sockets=(f"{ws}/agent.sock",),
        sealed=(ws,),
        rebound=(f"{ws}/proj",),
        sealed_entries=(f"{ws}/.config",),
    )
    policy = resolve_paths(load_profile("default"), paths.workspace)
    fs = srt.render_settings(policy, plan, paths, platform="linux")["filesystem"]
    assert f"{ws}/nest" in fs["denyWrite"] and f"{ws}/.config" in fs["denyWrite"]
    assert f"{ws}/flood" in fs["denyRead"] and f"{ws}/flood" in fs["denyWrite"]
    assert f"{ws}/agent.sock" in fs["denyRead"]
