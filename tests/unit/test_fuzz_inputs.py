"""Hypothesis fuzz of the two parsers that take untrusted input: any input gives a valid
result or a clean, specific error — never another exception, never a silent half-result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipyfence.errors import PolicyError, ToolInputError
from ipyfence.mcptools.params import HttpParams, StdioParams, resolve, validate_server_name, validate_server_params
from ipyfence.policy import Policy, load_config_file, load_profile, to_srt_settings
from ipyfence.sandbox import bwrap

# --- server_params -----------------------------------------------------------------------

_text = st.text(max_size=12) | st.sampled_from(["${HOME}", "${MISSING}", "${", "$${X}", "http://h", "https://h:1/p"])
_scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | _text
_value = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3), max_leaves=10)
_params = st.dictionaries(st.sampled_from(["command", "args", "env", "url", "headers", "extra"]) | _text, _value)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=_params | _value, variables=st.dictionaries(st.sampled_from(["HOME", "X", "TOKEN"]), _text))
def test_server_params_fuzz(params: Any, variables: dict[str, str]) -> None:
    try:
        clean = validate_server_params(params)
    except ToolInputError as exc:
        assert str(exc).startswith("server_params"), exc
        return
    json.dumps(clean)  # what the registry stores is plain JSON
    try:
        resolved = resolve(clean, variables)
    except ToolInputError as exc:
        assert "server_params" in str(exc), exc
        return
    assert isinstance(resolved, StdioParams | HttpParams)


@settings(max_examples=300, deadline=None)
@given(name=_scalar)
def test_server_name_fuzz(name: Any) -> None:
    try:
        valid = validate_server_name(name)
    except ToolInputError as exc:
        assert "server_name" in str(exc), exc
        return
    assert valid.isidentifier()


# --- policy loader from raw file bytes ----------------------------------------------------

_limit_keys = st.sampled_from(["memoryMb", "maxProcesses", "cpuSeconds", "maxFileSizeMb", "openFiles", "tmpSizeMb"])
_limits_doc = st.dictionaries(_limit_keys | st.text(max_size=4), _scalar, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_config_file_bytes_fuzz(tmp_path: Path, raw: bytes) -> None:
    cfg = tmp_path / "fuzz.json"
    cfg.write_bytes(raw)
    try:
        policy = load_config_file(load_profile("default"), cfg)
    except PolicyError as exc:
        assert str(exc).startswith(str(cfg)), exc
        return
    assert isinstance(policy, Policy)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limits=_limits_doc)
def test_limits_section_fuzz(tmp_path: Path, limits: dict[str, Any]) -> None:
    """Limits load only as whole numbers >= 0, and any loaded set renders a valid prlimit prefix."""
    cfg = tmp_path / "fuzz.json"
    cfg.write_text(json.dumps({"limits": limits}))
    try:
        policy = load_config_file(load_profile("default"), cfg)
    except PolicyError as exc:
        assert f"{cfg}: limits" in str(exc), exc
        return
    prefix = bwrap.limits_prefix(policy.limits)
    assert prefix[0] == "prlimit" and prefix[-1] == "--"
    for flag in prefix[1:-1]:
        value = flag.split("=", 1)[1]
        assert all(part.isdigit() for part in value.split(":")), flag
    to_srt_settings(policy)
