"""Policy loading: profiles, the srt-format JSON layer, merge order, path resolution, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipyfence.errors import PolicyError
from ipyfence.policy import (
    Policy,
    apply_settings,
    available_profiles,
    load_config_file,
    load_policy,
    load_profile,
    resolve_paths,
    to_srt_settings,
    weakenings,
)
from ipyfence.settings import build_settings


def write_config(tmp_path: Path, data: Any, name: str = "cfg.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


# --- profiles ----------------------------------------------------------------------------


def test_profiles_are_listed() -> None:
    assert {"default", "strict"} <= set(available_profiles())


def test_default_profile_denies_env_files_writes_workspace_no_network() -> None:
    policy = load_profile("default")
    assert set(policy.filesystem.deny_read) >= {"**/.env", "**/.env.*"}
    assert policy.filesystem.allow_write == (".",)
    assert policy.filesystem.allow_read == ()
    assert policy.network.allowed_domains == ()
    assert policy.network.allow_local_binding is False
    assert policy.filesystem.allow_git_config is False
    assert policy.sources and policy.sources[0].endswith("default.yaml")


def test_strict_profile_adds_home_credentials() -> None:
    strict = load_profile("strict")
    assert "~/.ssh" in strict.filesystem.deny_read
    assert "**/.env" in strict.filesystem.deny_read


@pytest.mark.parametrize("name", ["nope", "", "../default", ".hidden", "a/b"])
def test_bad_profile_names_are_errors(name: str) -> None:
    with pytest.raises(PolicyError, match="profile"):
        load_profile(name)


def test_policy_is_frozen() -> None:
    policy = load_profile("default")
    with pytest.raises(AttributeError):
        policy.filesystem = policy.filesystem  # type: ignore[misc]


# --- merge order -------------------------------------------------------------------------


def test_json_layers_over_profile_lists_unioned(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        {
            "filesystem": {"denyRead": ["secrets/", "**/.env"], "allowWrite": ["out"], "allowGitConfig": True},
            "network": {"allowLocalBinding": True, "deniedDomains": ["evil.example"]},
            "limits": {"memoryMb": 100},
        },
    )
    policy = load_policy("default", cfg)
    # lists: profile entries first, then new ones, no duplicates
    assert policy.filesystem.deny_read == ("**/.env", "**/.env.*", "secrets/")
    assert policy.filesystem.allow_write == (".", "out")
    # scalars: the later source wins
    assert policy.filesystem.allow_git_config is True
    assert policy.network.allow_local_binding is True
    assert policy.network.denied_domains == ("evil.example",)
    assert policy.limits.memory_mb == 100
    assert policy.limits.max_processes == load_profile("default").limits.max_processes  # untouched
    assert policy.sources[-1] == str(cfg)
    assert len(policy.sources) == 2


def test_config_cannot_drop_profile_env_denies(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {"filesystem": {"denyRead": []}})
    assert "**/.env" in load_policy("default", cfg).filesystem.deny_read


def test_srt_settings_file_is_a_valid_config(tmp_path: Path) -> None:
    """A real sandbox-runtime settings file, passthrough keys included."""
    cfg = write_config(
        tmp_path,
        {
            "$schema": "https://example.invalid/srt.schema.json",
            "network": {"allowedDomains": [], "deniedDomains": [], "httpProxyPort": 0, "allowUnixSockets": []},
            "filesystem": {"denyRead": ["~/.ssh"], "allowWrite": ["."], "denyWrite": []},
            "ignoreViolations": {},
            "enableWeakerNestedSandbox": False,
        },
    )
    policy = load_policy("default", cfg)
    assert policy.network.srt_extra == {"httpProxyPort": 0}
    assert policy.srt_extra == {"ignoreViolations": {}, "enableWeakerNestedSandbox": False}
    out = to_srt_settings(policy)
    assert out["network"]["httpProxyPort"] == 0
    assert out["enableWeakerNestedSandbox"] is False


def test_resolve_paths_against_workspace(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    cfg = write_config(
        tmp_path,
        {"filesystem": {"denyRead": ["~/.aws", "/etc/shadow", "sub/../data"], "denyWrite": ["./x/**"]}},
    )
    policy = resolve_paths(load_policy("default", cfg), ws)
    fs = policy.filesystem
    assert fs.allow_write == (str(ws),)
    assert fs.deny_read == (
        f"{ws}/**/.env",
        f"{ws}/**/.env.*",
        os.path.expanduser("~/.aws"),
        "/etc/shadow",
        f"{ws}/data",
    )
    assert fs.deny_write == (f"{ws}/x/**",)


def test_build_settings_resolves_profile_then_json_then_paths(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    cfg = write_config(tmp_path, {"filesystem": {"allowWrite": ["build"]}})
    s = build_settings(ws, sandbox_config=cfg, environ={"IPYFENCE_STATE_DIR": str(tmp_path / "st")})
    assert s.policy.filesystem.allow_write == (str(ws), str(ws / "build"))
    assert s.state_root == (tmp_path / "st").resolve()


def test_weakenings_are_reported(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    cfg = write_config(tmp_path, {"filesystem": {"allowRead": [".env"], "allowWrite": ["/opt"]}})
    found = weakenings(resolve_paths(load_policy("default", cfg), ws), ws)
    assert any("allowRead" in w and ".env" in w for w in found)
    assert any("allowWrite" in w and "/opt" in w for w in found)
    assert weakenings(resolve_paths(load_profile("default"), ws), ws) == []


# --- bad configs: the error names the file and the key path --------------------------------

BAD_CONFIGS: list[tuple[str, str | dict[str, Any], str]] = [
    ("bad-json", '{"filesystem": {"denyRead": [".env",]}}', "invalid JSON at line 1"),
    ("not-an-object", "[1, 2]", "expected an object, got array"),
    ("unknown-top-key", {"filesytem": {}}, "filesytem: unknown key"),
    ("unknown-nested-key", {"filesystem": {"denyReed": []}}, "filesystem.denyReed: unknown key"),
    ("unknown-network-key", {"network": {"allowDomains": []}}, "network.allowDomains: unknown key"),
    ("wrong-type-list", {"filesystem": {"denyRead": ".env"}}, "filesystem.denyRead: expected an array"),
    ("wrong-type-item", {"filesystem": {"allowWrite": [".", 3]}}, "filesystem.allowWrite[1]: expected a string"),
    ("wrong-type-bool", {"network": {"allowLocalBinding": "yes"}}, "network.allowLocalBinding: expected true"),
    ("wrong-type-section", {"network": []}, "network: expected an object"),
    ("negative-limit", {"limits": {"memoryMb": -1}}, "limits.memoryMb: expected a whole number"),
    ("bool-limit", {"limits": {"openFiles": True}}, "limits.openFiles: expected a whole number"),
    ("empty-path", {"filesystem": {"denyRead": ["ok", "  "]}}, "filesystem.denyRead[1]: path cannot be empty"),
    ("nul-path", {"filesystem": {"denyWrite": ["a\x00b"]}}, "filesystem.denyWrite[0]: contains a NUL"),
    ("disabled", {"filesystem": {"disabled": True}}, "filesystem.disabled: ipyfence does not support disabling"),
]


@pytest.mark.parametrize(("kind", "content", "expected"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_error_names_file_and_key(tmp_path: Path, kind: str, content: Any, expected: str) -> None:
    cfg = write_config(tmp_path, content, name=f"{kind}.json")
    with pytest.raises(PolicyError) as info:
        load_policy("default", cfg)
    message = str(info.value)
    assert message.startswith(f"{cfg}: "), message
    assert expected in message, message
    assert "\n" not in message


def test_disabled_false_is_accepted(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {"filesystem": {"disabled": False}})
    assert load_policy("default", cfg).filesystem.deny_read


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(PolicyError, match=r"nope\.json: sandbox config file not found"):
        load_config_file(Policy(), missing)


def test_undecodable_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "latin1.json"
    cfg.write_bytes(b'{"x": "\xff"}')
    with pytest.raises(PolicyError, match=r"latin1\.json: cannot read sandbox config"):
        load_config_file(Policy(), cfg)


@pytest.mark.parametrize(
    ("key", "entry"),
    [("denyRead", "../outside"), ("allowWrite", "sub/../../x"), ("denyWrite", ".."), ("allowRead", "../**/.env")],
)
def test_relative_path_escaping_workspace(tmp_path: Path, key: str, entry: str) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    cfg = write_config(tmp_path, {"filesystem": {key: [entry]}})
    policy = load_policy("default", cfg)
    with pytest.raises(PolicyError) as info:
        resolve_paths(policy, ws)
    message = str(info.value)
    assert message.startswith(f"{cfg}: filesystem.{key}["), message
    assert "escapes the workspace" in message
    assert repr(entry) in message


def test_relative_unix_socket_escaping_workspace(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    cfg = write_config(tmp_path, {"network": {"allowUnixSockets": ["../agent.sock"]}})
    with pytest.raises(PolicyError, match=r"cfg\.json: network\.allowUnixSockets.*escapes the workspace"):
        resolve_paths(load_policy("default", cfg), ws)


def test_absolute_paths_outside_workspace_are_allowed(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    cfg = write_config(tmp_path, {"filesystem": {"denyRead": [str(tmp_path / "other")]}})
    assert str(tmp_path / "other") in resolve_paths(load_policy("default", cfg), ws).filesystem.deny_read


# --- fuzz ---------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats(allow_nan=True) | st.text(max_size=8)
_keys = st.sampled_from(
    [
        "filesystem",
        "network",
        "limits",
        "denyRead",
        "allowRead",
        "allowWrite",
        "denyWrite",
        "allowGitConfig",
        "disabled",
        "allowedDomains",
        "deniedDomains",
        "allowLocalBinding",
        "allowUnixSockets",
        "allowAllUnixSockets",
        "httpProxyPort",
        "memoryMb",
        "tmpSizeMb",
        "ignoreViolations",
        "$schema",
        "_comment",
    ]
) | st.text(max_size=6)
_json = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_json)
def test_apply_settings_fuzz(data: object) -> None:
    try:
        result = apply_settings(load_profile("default"), data, "fuzz.json")
    except PolicyError as exc:
        assert str(exc).startswith("fuzz.json")
        return
    assert isinstance(result, Policy)
    to_srt_settings(result)  # a loaded policy always renders back


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(
        st.text(alphabet="~ab./*-", max_size=12)
        | st.text(max_size=12).filter(lambda s: bool(s.strip()) and "\x00" not in s),
        max_size=4,
    )
)
def test_resolve_paths_fuzz(entries: list[str]) -> None:
    ws = Path("/fuzz/ws")
    try:
        policy = apply_settings(Policy(), {"filesystem": {"denyRead": entries}}, "fuzz.json")
        resolved = resolve_paths(policy, ws)
    except PolicyError:
        return
    for entry in resolved.filesystem.deny_read:
        assert os.path.isabs(entry)


def test_unknown_user_home_is_an_error(tmp_path: Path) -> None:
    """``~nosuchuser/x`` does not expand; it must not stay a relative path."""
    cfg = write_config(tmp_path, {"filesystem": {"denyRead": ["~nosuchuser-ipyfence/x"]}})
    with pytest.raises(PolicyError, match=r"cfg\.json: filesystem\.denyRead\[2\]: cannot expand"):
        resolve_paths(load_policy("default", cfg), tmp_path)
