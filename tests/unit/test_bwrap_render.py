"""The bwrap renderer as data, and the mount plan on a real temporary workspace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ipyfence.policy import Policy, apply_settings, load_profile, resolve_paths
from ipyfence.sandbox.bwrap import LaunchOptions, render
from ipyfence.sandbox.plan import MountPlan, SandboxPaths, plan_mounts

ALWAYS_FLAGS = [
    "--die-with-parent",
    "--new-session",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--clearenv",
]
ALWAYS_PAIRS = [("--cap-drop", "ALL"), ("--proc", "/proc"), ("--tmpfs", "/tmp")]


def sandbox_paths(tmp_path: Path, ws: Path) -> SandboxPaths:
    return SandboxPaths(
        workspace=ws,
        kernel_dir=tmp_path / "rt" / "k1",
        runtime_root=tmp_path / "rt",
        state_root=tmp_path / "state",
        packages_dir=None,
        server_install=(Path("/opt/venv"),),
        python=Path("/opt/venv/bin/python"),
    )


def triples(argv: list[str], flag: str) -> list[tuple[int, str, str]]:
    """(index, src, dest) for every two-argument mount flag ``flag``."""
    return [(i, argv[i + 1], argv[i + 2]) for i, a in enumerate(argv[:-2]) if a == flag]


def pairs(argv: list[str], flag: str) -> list[tuple[int, str]]:
    return [(i, argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == flag]


def sandbox_part(argv: list[str]) -> list[str]:
    """bwrap's own options: everything before the first ``--``."""
    return argv[: argv.index("--")]


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / ".env").write_text("SECRET=1\n")
    (ws / "sub" / ".env.local").write_text("SECRET=2\n")
    (ws / ".env.example").write_text("x\n")
    (ws / "ok.txt").write_text("fine\n")
    (ws / ".git" / "hooks").mkdir(parents=True)
    (ws / ".git" / "config").write_text("[core]\n")
    (ws / ".mcp.json").write_text("{}\n")
    (ws / "sub" / ".bashrc").write_text("\n")
    return ws


def resolved_default(ws: Path, extra: dict[str, object] | None = None) -> Policy:
    policy = load_profile("default")
    if extra:
        policy = apply_settings(policy, extra, "extra.json")
    return resolve_paths(policy, ws)


def rendered(tmp_path: Path, ws: Path, policy: Policy, **kw: object) -> tuple[list[str], MountPlan]:
    paths = sandbox_paths(tmp_path, ws)
    plan = plan_mounts(policy, paths)
    env = {"PATH": "/usr/bin:/bin", "FOO": "bar baz", "HOME": str(paths.kernel_dir / "home")}
    argv = render(policy, plan, paths, env, ["python", "-m", "ipykernel_launcher"], bwrap="/usr/bin/bwrap", **kw)  # type: ignore[arg-type]
    return argv, plan


# --- plan_mounts --------------------------------------------------------------------------


def test_plan_masks_env_files_at_any_depth(tmp_path: Path, ws: Path) -> None:
    plan = plan_mounts(resolved_default(ws), sandbox_paths(tmp_path, ws))
    assert set(plan.masked_files) == {str(ws / ".env"), str(ws / "sub" / ".env.local"), str(ws / ".env.example")}
    assert plan.writable == (str(ws),)


def test_plan_protects_whole_git_dir_mcp_json_rc_files(tmp_path: Path, ws: Path) -> None:
    # The whole .git is read-only by default: git rewrites .git/config via rename(), which
    # would detach a mount on the file itself.
    plan = plan_mounts(resolved_default(ws), sandbox_paths(tmp_path, ws))
    assert {
        str(ws / ".git"),
        str(ws / ".mcp.json"),
        str(ws / "sub" / ".bashrc"),
    } <= set(plan.readonly)
    assert str(ws / "ok.txt") not in plan.readonly


def test_plan_makes_absent_protected_names_read_only_placeholders(tmp_path: Path, ws: Path) -> None:
    plan = plan_mounts(resolved_default(ws), sandbox_paths(tmp_path, ws))
    assert set(plan.absent_dirs) == {str(ws / d) for d in (".claude", ".vscode", ".idea", ".cursor")}
    assert plan.absent_files == ()  # .mcp.json exists in this workspace
    argv, _ = rendered(tmp_path, ws, resolved_default(ws))
    i = argv.index(str(ws / ".claude"))
    assert argv[i - 3 : i] == ["--perms", "0555", "--tmpfs"]
    remounts = [argv[j + 1] for j, arg in enumerate(argv) if arg == "--remount-ro"]
    assert str(ws / ".claude") in remounts


def test_plan_allow_git_config_keeps_hooks_protected(tmp_path: Path, ws: Path) -> None:
    plan = plan_mounts(resolved_default(ws, {"filesystem": {"allowGitConfig": True}}), sandbox_paths(tmp_path, ws))
    assert str(ws / ".git" / "config") not in plan.readonly
    assert str(ws / ".git" / "hooks") in plan.readonly


def test_plan_allow_read_reopens_a_file(tmp_path: Path, ws: Path) -> None:
    plan = plan_mounts(
        resolved_default(ws, {"filesystem": {"allowRead": [".env.example"]}}), sandbox_paths(tmp_path, ws)
    )
    assert str(ws / ".env.example") not in plan.masked_files
    assert str(ws / ".env") in plan.masked_files


def test_plan_hides_runtime_and_state_roots(tmp_path: Path, ws: Path) -> None:
    paths = sandbox_paths(tmp_path, ws)
    paths.runtime_root.mkdir()
    paths.state_root.mkdir()
    plan = plan_mounts(resolved_default(ws), paths)
    assert str(paths.runtime_root) in plan.hidden_dirs
    assert str(paths.state_root) in plan.hidden_dirs


def test_plan_server_install_inside_workspace_is_readonly(tmp_path: Path, ws: Path) -> None:
    venv = ws / ".venv"
    venv.mkdir()
    paths = sandbox_paths(tmp_path, ws)
    paths = SandboxPaths(**{**vars(paths), "server_install": (venv,)})
    assert str(venv) in plan_mounts(resolved_default(ws), paths).readonly


def test_plan_warns_on_missing_and_glob_writable(tmp_path: Path, ws: Path) -> None:
    policy = resolved_default(ws, {"filesystem": {"allowWrite": ["nope", "out/*"]}})
    plan = plan_mounts(policy, sandbox_paths(tmp_path, ws))
    assert plan.writable == (str(ws),)
    assert any("nope" in w and "does not exist" in w for w in plan.warnings)
    assert any("out/*" in w and "not supported" in w for w in plan.warnings)


# --- render -------------------------------------------------------------------------------


def test_always_on_flags(tmp_path: Path, ws: Path) -> None:
    argv, _ = rendered(tmp_path, ws, resolved_default(ws))
    assert argv[0] == "/usr/bin/bwrap"
    opts = sandbox_part(argv)
    for flag in ALWAYS_FLAGS:
        assert flag in opts, flag
    for flag, value in ALWAYS_PAIRS:
        assert value in [v for _, v in pairs(opts, flag)], (flag, value)
    # the whole of / is read-only, before anything else is mounted over it
    ro = triples(opts, "--ro-bind")
    assert ro[0][1:] == ("/", "/")
    # and the command comes last, started in its private dir (never the workspace: kernel_boot enters it later)
    assert argv[argv.index("--chdir") + 1] == str(tmp_path / "rt" / "k1")
    assert argv[-3:] == ["python", "-m", "ipykernel_launcher"]


def test_network_option_only_drops_unshare_net(tmp_path: Path, ws: Path) -> None:
    argv, _ = rendered(tmp_path, ws, resolved_default(ws), options=LaunchOptions(network=True))
    opts = sandbox_part(argv)
    assert "--unshare-net" not in opts
    for flag in ALWAYS_FLAGS:
        if flag != "--unshare-net":
            assert flag in opts


def test_env_only_via_setenv_after_clearenv(tmp_path: Path, ws: Path) -> None:
    argv, _ = rendered(tmp_path, ws, resolved_default(ws))
    opts = sandbox_part(argv)
    clear = opts.index("--clearenv")
    setenvs = triples(opts, "--setenv")
    assert {(k, v) for _, k, v in setenvs} == {
        ("PATH", "/usr/bin:/bin"),
        ("FOO", "bar baz"),
        ("HOME", str(tmp_path / "rt" / "k1" / "home")),
    }
    assert all(i > clear for i, _, _ in setenvs)
    assert "--setenv" not in argv[argv.index("--") :]
    # no other way to pass environment through
    for forbidden in ("--unsetenv", "--preserve-env"):
        assert forbidden not in argv


def test_masks_and_protection_come_after_writable_bind(tmp_path: Path, ws: Path) -> None:
    argv, plan = rendered(tmp_path, ws, resolved_default(ws))
    opts = sandbox_part(argv)
    binds = {dest: i for i, _, dest in triples(opts, "--bind")}
    ro = {dest: (i, src) for i, src, dest in triples(opts, "--ro-bind")}
    ws_bind = binds[str(ws)]
    for masked in (ws / ".env", ws / "sub" / ".env.local"):
        i, src = ro[str(masked)]
        assert src == "/dev/null"
        assert i > ws_bind
    for protected in plan.readonly:
        i, src = ro[protected]
        assert src == protected
        assert i > ws_bind
    # the kernel's private dir is writable
    assert str(tmp_path / "rt" / "k1") in binds
    # the workspace bind comes after the private /tmp (the workspace lives under /tmp here)
    tmpfs = [i for i, dest in pairs(opts, "--tmpfs") if dest == "/tmp"]
    assert tmpfs and tmpfs[0] < ws_bind


def test_hidden_dirs_are_empty_and_read_only(tmp_path: Path, ws: Path) -> None:
    paths = sandbox_paths(tmp_path, ws)
    paths.state_root.mkdir()
    policy = resolved_default(ws)
    plan = plan_mounts(policy, paths)
    argv = render(policy, plan, paths, {}, ["true"])
    opts = sandbox_part(argv)
    state = str(paths.state_root)
    assert state in [dest for _, dest in pairs(opts, "--tmpfs")]
    assert state in [dest for _, dest in pairs(opts, "--remount-ro")]


def test_limits_are_applied_with_prlimit(tmp_path: Path, ws: Path) -> None:
    argv, _ = rendered(tmp_path, ws, resolved_default(ws))
    tail = argv[argv.index("--") + 1 :]
    assert tail[0] == "prlimit"
    assert "--core=0" in tail
    assert f"--as={8192 * 1024 * 1024}" in tail
    size = argv.index("--size")
    assert argv[size + 2 : size + 4] == ["--tmpfs", "/tmp"]


def test_render_is_pure_and_deterministic(tmp_path: Path, ws: Path) -> None:
    first, _ = rendered(tmp_path, ws, resolved_default(ws))
    second, _ = rendered(tmp_path, ws, resolved_default(ws))
    assert first == second


def test_server_install_under_tmp_is_bound_back_read_only(tmp_path: Path, ws: Path) -> None:
    """A checkout (and its venv) under /tmp must stay visible: the sandbox replaces /tmp."""
    venv = tmp_path / "checkout" / ".venv"
    venv.mkdir(parents=True)
    paths = dataclasses.replace(sandbox_paths(tmp_path, ws), server_install=(venv,))
    plan = plan_mounts(resolved_default(ws), paths)
    assert str(venv) in plan.reallowed
    argv = render(resolved_default(ws), plan, paths, {}, ["python"], bwrap="bwrap")
    i = argv.index("--tmpfs")
    assert argv.index(str(venv)) > i and argv[argv.index(str(venv)) - 1] == "--ro-bind"


@pytest.mark.parametrize(
    ("pattern", "name"),
    [("**/.env", ".env"), ("**/.env.*", ".env.local"), ("**/secret-?.txt", "secret-1.txt"), ("**/[!a]x", "bx"),
     ("**/[^a]x", "bx"), ("**/*", "anything"), ("sub/**", "deep")],
)  # fmt: skip
def test_glob_prefilter_never_misses_a_match(tmp_path: Path, ws: Path, pattern: str, name: str) -> None:
    """The fast last-component pre-filter must agree with wcmatch, or a secret would stay unmasked."""
    target = ws / "sub" / "deeper" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("x")
    policy = resolve_paths(apply_settings(Policy(), {"filesystem": {"denyRead": [pattern]}}, "t.json"), ws)
    plan = plan_mounts(policy, sandbox_paths(tmp_path, ws))
    assert str(target) in plan.masked_files


def test_scan_limit_is_announced_for_masks_and_protection(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ipyfence.sandbox.plan.SCAN_LIMIT", 5)
    for i in range(10):
        (ws / f"d{i}").mkdir()
    argv, plan = rendered(tmp_path, ws, resolved_default(ws))
    # Fail closed: the subdirectories the scan did not reach are hidden, none stays unmasked.
    assert str(ws / "d9") in plan.unscanned and str(ws) not in plan.unscanned
    remounted = {p for _, p in pairs(argv, "--remount-ro")}
    assert set(plan.unscanned) <= remounted


def test_chdir_option_sets_the_working_directory(tmp_path: Path, ws: Path) -> None:
    """install_package's pip starts in its private dir, never in the workspace the kernel writes."""
    argv, _ = rendered(tmp_path, ws, resolved_default(ws), options=LaunchOptions(chdir="/private/pip-dir"))
    assert argv[argv.index("--chdir") + 1] == "/private/pip-dir"
    assert "--unshare-net" in sandbox_part(argv)
