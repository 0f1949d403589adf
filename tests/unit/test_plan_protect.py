"""The mount plan fails closed: pinned ancestors, unfinished scans, sockets, glob-escaped paths."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipyfence.errors import SandboxError
from ipyfence.policy import is_glob, literal_path, resolve_entry
from ipyfence.sandbox import plan as plan_mod
from ipyfence.sandbox.plan import plan_mounts
from tests.unit.test_bwrap_render import pairs, rendered, resolved_default, sandbox_paths, triples


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "a" / "b" / "repo" / ".git" / "hooks").mkdir(parents=True)
    (ws / "top").mkdir()
    return ws


def test_every_ancestor_of_a_nested_protected_path_is_pinned_before_it(tmp_path: Path, ws: Path) -> None:
    argv, plan = rendered(tmp_path, ws, resolved_default(ws))
    nested = [str(ws / "a"), str(ws / "a" / "b"), str(ws / "a" / "b" / "repo")]
    assert list(plan.pinned) == nested
    binds = {dest: i for i, src, dest in triples(argv, "--bind") if src == dest}
    ro = {dest: i for i, src, dest in triples(argv, "--ro-bind") if src == dest}
    git = str(ws / "a" / "b" / "repo" / ".git")
    assert binds[str(ws)] < binds[nested[0]] < binds[nested[1]] < binds[nested[2]] < ro[git]
    assert str(ws / "top") not in plan.pinned and str(ws) not in plan.pinned


def test_unfinished_scan_hides_pending_subtrees(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_mod, "SCAN_LIMIT", 4)
    for i in range(5):
        (ws / "top" / f"f{i}").write_text("x")
    (ws / "z" / "deep").mkdir(parents=True)
    (ws / "z" / "deep" / ".env").write_text("SECRET=1")
    argv, plan = rendered(tmp_path, ws, resolved_default(ws))
    assert plan.unscanned and all(p.startswith(str(ws) + "/") for p in plan.unscanned)
    assert any(str(ws / "z" / "deep" / ".env").startswith(p + "/") for p in plan.unscanned)
    hidden = {p for _, p in pairs(argv, "--tmpfs")}
    assert set(plan.unscanned) <= hidden


def test_too_many_unfinished_subtrees_refuse(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_mod, "SCAN_LIMIT", 3)
    monkeypatch.setattr(plan_mod, "UNSCANNED_CAP", 3)
    for i in range(10):
        (ws / f"d{i}").mkdir()
    with pytest.raises(SandboxError, match="at most 3 can be hidden"):
        plan_mounts(resolved_default(ws), sandbox_paths(tmp_path, ws))


def test_huge_root_listing_refuses(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_mod, "SCAN_LIMIT", 2)
    for i in range(20):
        (ws / f"f{i}").write_text("")
    with pytest.raises(SandboxError, match=r"the kernel needs it.*ws \(\d+ entries\)"):
        plan_mounts(resolved_default(ws), sandbox_paths(tmp_path, ws))


@pytest.fixture
def nontmp(tmp_path: Path) -> Iterator[Path]:
    """A directory outside /tmp (which the sandbox replaces anyway, hiding its sockets)."""
    base = Path(os.environ.get("IPYFENCE_TEST_NONTMP", "/var/lib")) / f"ipyfence-test-{os.getpid()}"
    base.mkdir(parents=True)
    try:
        yield base
    finally:
        shutil.rmtree(base)


def test_sockets_in_workspace_and_agent_env_are_masked(
    tmp_path: Path, nontmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws, home = nontmp / "ws", nontmp / "home"
    (ws / "top").mkdir(parents=True)
    (home / ".gnupg").mkdir(parents=True)
    (home / ".ssh" / "agent").mkdir(parents=True)
    paths = [ws / "top" / "agent.sock", home / ".gnupg" / "S.gpg-agent", nontmp / "ssh.sock"]
    paths += [home / ".ssh" / "agent" / "s.1", nontmp / "docker.sock"]
    made = []
    for path in paths:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        made.append(s)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SSH_AUTH_SOCK", str(nontmp / "ssh.sock"))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{nontmp / 'docker.sock'}")
    try:
        argv, plan = rendered(tmp_path, ws, resolved_default(ws))
    finally:
        for s in made:
            s.close()
    assert set(plan.sockets) == {str(p) for p in paths}
    masked = {dest for _, src, dest in triples(argv, "--ro-bind") if src == "/dev/null"}
    assert {str(p) for p in paths} <= masked


def test_socket_scan_finds_sockets_outside_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(os.environ.get("IPYFENCE_TEST_NONTMP", "/var/lib")) / f"ipyfence-sock-{os.getpid()}"
    root.mkdir(parents=True)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(root / "x.sock"))
        tree = plan_mod._list_tree(str(root), 100)
        assert tree.sockets == (str(root / "x.sock"),)
    finally:
        s.close()
        (root / "x.sock").unlink()
        root.rmdir()


@pytest.mark.parametrize("name", ["ws[1]", "a*b", "q?", "br{x,y}", "w\\s"])
def test_glob_characters_in_workspace_are_escaped(tmp_path: Path, name: str) -> None:
    ws = tmp_path / name
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / ".env").write_text("S=1")
    (ws / ".env").write_text("S=1")
    deep = resolve_entry("**/.env", ws, "t")
    assert is_glob(deep)
    lit = resolve_entry(".env", ws, "t")
    assert not is_glob(lit) and literal_path(lit) == str(ws / ".env")
    plan = plan_mounts(resolved_default(ws), sandbox_paths(tmp_path, ws))
    assert {str(ws / ".env"), str(ws / "sub" / ".env")} <= set(plan.masked_files)
    assert str(ws) in plan.writable


def test_socket_in_a_workspace_under_tmp_is_masked_but_not_the_kernels_own(tmp_path: Path, ws: Path) -> None:
    paths = sandbox_paths(tmp_path, ws)
    paths.kernel_dir.mkdir(parents=True)
    made = []
    for path in (ws / "agent.sock", paths.kernel_dir / "bridge.sock"):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        made.append(s)
    policy = resolved_default(ws, {"filesystem": {"allowWrite": [str(paths.kernel_dir)]}})
    try:
        plan = plan_mounts(policy, paths)
    finally:
        for s in made:
            s.close()
    assert str(ws / "agent.sock") in plan.sockets
    assert str(paths.kernel_dir / "bridge.sock") not in plan.sockets


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env={"PATH": "/usr/bin:/bin"})


def test_git_config_hook_and_include_paths_in_tree_are_protected(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".gitconfig").write_text("[core]\n\thooksPath = global-hooks\n")
    _git(ws, "init", "-q")
    _git(ws, "config", "core.hooksPath", "tools/hooks")
    _git(ws, "config", "include.path", "../extra.cfg")
    _git(ws, "config", "includeIf.gitdir:/nowhere/.path", "../cond/x.cfg")
    (ws / "extra.cfg").write_text("[core]\n\thooksPath = more/hooks\n")
    (ws / "tools" / "hooks").mkdir(parents=True)
    nested = ws / "a" / "b" / "repo"
    _git(nested, "config", "--file", str(nested / ".git" / "config"), "core.hooksPath", "h")
    argv, plan = rendered(tmp_path, ws, resolved_default(ws))
    assert str(ws / "tools" / "hooks") in plan.readonly  # exists: read-only
    assert str(ws / "extra.cfg") in plan.readonly
    assert str(ws / "more") in plan.absent_dirs  # missing: topmost missing ancestor is a placeholder
    assert str(ws / "cond") in plan.absent_dirs
    assert str(ws / "global-hooks") in plan.absent_dirs  # global relative hooksPath, per work tree
    assert str(nested / "h") in plan.absent_dirs and str(nested / "global-hooks") in plan.absent_dirs
    assert str(ws / "tools") in plan.pinned
    ro = {dest for _, src, dest in triples(argv, "--ro-bind") if src == dest}
    assert str(ws / "tools" / "hooks") in ro


def test_git_missing_is_a_warning(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_mod, "GIT_SEARCH_PATH", str(tmp_path / "nogit"))
    plan = plan_mounts(resolved_default(ws), sandbox_paths(tmp_path, ws))
    assert any("git not found" in w for w in plan.warnings)


def test_home_as_workspace_is_sealed_with_non_dot_entries_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    for d in (".config/fish", ".local/bin", "proj/sub/.git", "bin", "docs"):
        (home / d).mkdir(parents=True)
    (home / "notes.txt").write_text("n")
    (home / ".bash_aliases").write_text("")
    monkeypatch.setenv("HOME", str(home))
    argv, plan = rendered(tmp_path, home, resolved_default(home))
    assert plan.sealed == (str(home),)
    assert set(plan.rebound) == {str(home / "proj"), str(home / "docs"), str(home / "notes.txt")}
    assert {str(home / ".config"), str(home / ".local"), str(home / ".bash_aliases")} <= set(plan.sealed_entries)
    binds = {dest: i for i, src, dest in triples(argv, "--bind") if src == dest}
    ro = {dest: i for i, src, dest in triples(argv, "--ro-bind") if src == dest}
    assert binds[str(home)] < ro[str(home)] < binds[str(home / "proj")] < binds[str(home / "proj" / "sub")]
    assert str(home / "bin") not in binds and str(home / ".config") not in binds
    # No placeholder mount points at the sealed root (bwrap could not create them there).
    made = {dest for _, src, dest in triples(argv, "--ro-bind") if src == "/dev/null"}
    assert str(home / ".bashrc") not in made and str(home / ".bashrc") in plan.absent_files


def test_home_elsewhere_is_not_sealed(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    plan = plan_mounts(resolved_default(ws), sandbox_paths(tmp_path, ws))
    assert plan.sealed == () and plan.rebound == ()


def test_host_rename_of_a_pinned_dir_counts_as_a_detached_mask(tmp_path: Path, ws: Path) -> None:
    from ipyfence.sandbox import integrity

    plan = plan_mounts(resolved_default(ws), sandbox_paths(tmp_path, ws))
    snap = integrity.snapshot(plan, ws)
    assert integrity.replaced_paths(snap) == []
    (ws / "a").rename(ws / "a2")  # on the host: the sandbox's read-only .git mount is detached
    assert str(ws / "a") in integrity.replaced_paths(snap)
