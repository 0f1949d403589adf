"""Which rule refused a write: pure, from the error text, the plan and the policy."""

from __future__ import annotations

from ipyfence.policy import FilesystemPolicy, Policy
from ipyfence.refusalnotes import ipybox_leftover, write_refusal
from ipyfence.sandbox.plan import MountPlan

WS = "/home/u/proj"
PLAN = MountPlan(
    writable=(WS,),
    hidden_dirs=(),
    masked_files=(f"{WS}/.env",),
    readonly=(f"{WS}/.git", f"{WS}/sub/.bashrc"),
    reallowed=(),
    warnings=(),
    absent_dirs=(f"{WS}/.claude",),
)
POLICY = Policy(filesystem=FilesystemPolicy(allow_write=(WS,)))


def note(value: str) -> str | None:
    return write_refusal(value, PLAN, POLICY, WS)


def test_protected_git_says_allow_git_config() -> None:
    text = note(f"[Errno 30] Read-only file system: '{WS}/.git/config'")
    assert text is not None and ".git is a protected path" in text and "allowGitConfig: true" in text


def test_protected_placeholder_and_relative_path() -> None:
    text = note("[Errno 30] Read-only file system: '.claude/settings.json'")
    assert text is not None and ".claude is a protected path" in text and "always on" in text


def test_outside_the_writable_roots_names_allow_write() -> None:
    text = note("[Errno 30] Read-only file system: '/etc/cron.d/x'")
    assert text is not None and "outside the writable roots" in text and "allowWrite" in text


def test_masked_env_and_unrelated_errors() -> None:
    assert "masked secret" in (note(f"[Errno 30] Read-only file system: '{WS}/.env'") or "")
    assert note(f"[Errno 2] No such file or directory: '{WS}/x'") is None
    assert note(f"[Errno 30] Read-only file system: '{WS}/ok.txt'") is None  # no rule explains it
    assert note("[Errno 30] Read-only file system: '/tmp/x'") is None
    assert write_refusal("[Errno 30] Read-only file system: '/etc/x'", None, POLICY, WS) is None


def test_ipybox_leftover() -> None:
    assert ipybox_leftover("ModuleNotFoundError", "No module named 'mcpygen'") is not None
    assert ipybox_leftover("ModuleNotFoundError", "No module named 'ipybox.mcp_tools'") is not None
    assert ipybox_leftover("ModuleNotFoundError", "No module named 'pandas'") is None
    assert ipybox_leftover("ImportError", "No module named 'mcpygen'") is None
