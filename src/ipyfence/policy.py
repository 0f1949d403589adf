"""The sandbox policy: frozen data, loaded from a YAML profile and an srt-format JSON file.

Files use sandox-runtime's settings keys (camelCase) so that a real ``~/.srt-settings.json``
is a valid ``--sandbox-config``. Merge order: profile, then the JSON file, then paths are
resolved against the workspace (see ``resolve_paths``).

Merge rule: lists are *unioned* (a config file adds rules; it cannot silently drop the
profile's ``.env`` denies), scalars and mappings from the later source replace earlier ones.
To weaken a deny, a file says so explicitly (``allowRead: [".env"]``); ``weakenings`` finds
such choices so the CLI can log them loudly.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml
from wcmatch import glob as wcglob

from ipyfence.errors import PolicyError

GLOB_CHARS = frozenset("*?[")

# srt settings keys ipyfence accepts but does not enforce itself. They are passed through
# to the srt backend; the bwrap backend rejects the ones that would change behaviour.
SRT_NETWORK_PASSTHROUGH = frozenset(
    {
        "deniedDomainReasons",
        "strictAllowlist",
        "deniedResolvedAddresses",
        "allowMachLookup",
        "httpProxyPort",
        "socksProxyPort",
        "mitmProxy",
        "tlsTerminate",
        "parentProxy",
    }
)
SRT_TOP_PASSTHROUGH = frozenset(
    {
        "credentials",
        "ignoreViolations",
        "enableWeakerNestedSandbox",
        "enableWeakerNetworkIsolation",
        "allowAppleEvents",
        "ripgrep",
        "mandatoryDenySearchDepth",
        "allowPty",
        "seccomp",
        "bwrapPath",
        "socatPath",
        "javaAgentJarPath",
        "windows",
        "git",
    }
)


@dataclass(frozen=True)
class FilesystemPolicy:
    """Which paths the kernel may read and write. Entries are paths or globs (``**`` = any depth)."""

    deny_read: tuple[str, ...] = ()  # never readable (masked); globs match at launch time
    allow_read: tuple[str, ...] = ()  # re-allowed inside deny_read (takes precedence)
    allow_write: tuple[str, ...] = ()  # writable roots; everything else is read-only
    deny_write: tuple[str, ...] = ()  # read-only even inside allow_write
    allow_git_config: bool = False  # let the kernel write .git/config (hooks stay protected)


@dataclass(frozen=True)
class NetworkPolicy:
    """Network reach of the kernel. Empty ``allowed_domains`` means no network at all."""

    allowed_domains: tuple[str, ...] = ()  # hosts reachable through srt's filtering proxy
    denied_domains: tuple[str, ...] = ()  # hosts refused even if allowed by a wildcard
    allow_local_binding: bool = False  # may the kernel listen on localhost ports (srt only)
    allow_unix_sockets: tuple[str, ...] = ()  # macOS/srt: unix socket paths the kernel may connect to
    allow_all_unix_sockets: bool = False  # srt: disable the unix-socket block entirely
    srt_extra: Mapping[str, Any] = field(default_factory=dict)  # other srt network keys, passed through


@dataclass(frozen=True)
class LimitsPolicy:
    """Resource limits for the kernel process tree. ``0`` means no limit."""

    memory_mb: int = 0  # address-space limit per process (RLIMIT_AS)
    max_processes: int = 0  # processes/threads (cgroup pids.max when delegated, else RLIMIT_NPROC)
    cpu_seconds: int = 0  # CPU seconds per kernel process (RLIMIT_CPU)
    max_file_size_mb: int = 0  # largest file a process may write (RLIMIT_FSIZE)
    open_files: int = 0  # open file descriptors per process (RLIMIT_NOFILE)
    tmp_size_mb: int = 0  # size of the private /tmp tmpfs
    install_seconds: int = 600  # wall-clock bound of each install_package pip run (0 = none)


@dataclass(frozen=True)
class Policy:
    """Everything a sandbox backend needs to know about what the kernel may do."""

    filesystem: FilesystemPolicy = FilesystemPolicy()
    network: NetworkPolicy = NetworkPolicy()
    limits: LimitsPolicy = LimitsPolicy()
    srt_extra: Mapping[str, Any] = field(default_factory=dict)  # other top-level srt keys
    sources: tuple[str, ...] = ()  # files this policy was loaded from, in merge order


# --- key tables: file key -> (dataclass field, kind) ---------------------------------------

_FS_KEYS = {
    "denyRead": ("deny_read", "paths"),
    "allowRead": ("allow_read", "paths"),
    "allowWrite": ("allow_write", "paths"),
    "denyWrite": ("deny_write", "paths"),
    "allowGitConfig": ("allow_git_config", "bool"),
    "disabled": (None, "disabled"),
}
_NET_KEYS = {
    "allowedDomains": ("allowed_domains", "strings"),
    "deniedDomains": ("denied_domains", "strings"),
    "allowLocalBinding": ("allow_local_binding", "bool"),
    "allowUnixSockets": ("allow_unix_sockets", "paths"),
    "allowAllUnixSockets": ("allow_all_unix_sockets", "bool"),
}
_LIMIT_KEYS = {
    "memoryMb": "memory_mb",
    "maxProcesses": "max_processes",
    "cpuSeconds": "cpu_seconds",
    "maxFileSizeMb": "max_file_size_mb",
    "openFiles": "open_files",
    "tmpSizeMb": "tmp_size_mb",
    "installSeconds": "install_seconds",
}


class _Loc:
    """A file name plus a key path, for error messages like ``cfg.json: filesystem.denyRead[2]``."""

    def __init__(self, source: str, path: str = "") -> None:
        self.source = source
        self.path = path

    def child(self, key: str | int) -> _Loc:
        if isinstance(key, int):
            return _Loc(self.source, f"{self.path}[{key}]")
        return _Loc(self.source, f"{self.path}.{key}" if self.path else key)

    def error(self, message: str) -> PolicyError:
        where = f"{self.source}: {self.path}" if self.path else self.source
        return PolicyError(f"{where}: {message}")


def _type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}.get(
        type(value), type(value).__name__
    )


def _expect_mapping(value: object, loc: _Loc) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise loc.error(f"expected an object, got {_type_name(value)}")
    return value


def _strings(value: object, loc: _Loc, *, non_empty: bool) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise loc.error(f"expected an array of strings, got {_type_name(value)}")
    out: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise loc.child(i).error(f"expected a string, got {_type_name(item)}")
        if non_empty and not item.strip():
            raise loc.child(i).error("path cannot be empty")
        if "\x00" in item:
            raise loc.child(i).error("contains a NUL byte")
        out.append(item)
    return tuple(out)


def _bool(value: object, loc: _Loc) -> bool:
    if not isinstance(value, bool):
        raise loc.error(f"expected true or false, got {_type_name(value)}")
    return value


def _unknown(key: str, loc: _Loc, known: object) -> PolicyError:
    names = ", ".join(sorted(str(k) for k in known))  # type: ignore[attr-defined]
    return loc.child(key).error(f"unknown key (known keys: {names})")


def _apply_section(
    current: Any, data: Mapping[str, Any], table: Mapping[str, tuple[str | None, str]], loc: _Loc
) -> Any:
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key not in table:
            raise _unknown(key, loc, table)
        attr, kind = table[key]
        here = loc.child(key)
        if kind == "disabled":
            if _bool(value, here):
                raise here.error("ipyfence does not support disabling filesystem rules; use --no-sandbox instead")
            continue
        assert attr is not None
        if kind == "bool":
            changes[attr] = _bool(value, here)
        else:
            items = _strings(value, here, non_empty=kind == "paths")
            changes[attr] = _union(getattr(current, attr), items)
    return replace(current, **changes)


def _union(old: tuple[str, ...], new: tuple[str, ...]) -> tuple[str, ...]:
    return old + tuple(item for item in new if item not in old)


def _apply_limits(current: LimitsPolicy, data: Mapping[str, Any], loc: _Loc) -> LimitsPolicy:
    changes: dict[str, int] = {}
    for key, value in data.items():
        if key not in _LIMIT_KEYS:
            raise _unknown(key, loc, _LIMIT_KEYS)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise loc.child(key).error(f"expected a whole number >= 0, got {value!r}")
        changes[_LIMIT_KEYS[key]] = value
    return replace(current, **changes)


def apply_settings(policy: Policy, data: object, source: str) -> Policy:
    """Layer one parsed settings document (profile or srt JSON) over ``policy``."""
    loc = _Loc(source)
    doc = _expect_mapping(data, loc)
    fs, net, limits = policy.filesystem, policy.network, policy.limits
    extra = dict(policy.srt_extra)
    for key, value in doc.items():
        here = loc.child(key)
        if key == "filesystem":
            fs = _apply_section(fs, _expect_mapping(value, here), _FS_KEYS, here)
        elif key == "network":
            section = dict(_expect_mapping(value, here))
            net_extra = dict(net.srt_extra)
            for passthrough in SRT_NETWORK_PASSTHROUGH & section.keys():
                net_extra[passthrough] = section.pop(passthrough)
            net = replace(_apply_section(net, section, _NET_KEYS, here), srt_extra=net_extra)
        elif key == "limits":
            limits = _apply_limits(limits, _expect_mapping(value, here), here)
        elif key in SRT_TOP_PASSTHROUGH:
            extra[key] = value
        elif key.startswith("$") or key.startswith("_comment"):
            continue  # JSON-schema refs and comments are harmless
        else:
            raise _unknown(key, loc, {"filesystem", "network", "limits", *SRT_TOP_PASSTHROUGH})
    return Policy(filesystem=fs, network=net, limits=limits, srt_extra=extra, sources=(*policy.sources, source))


# --- loading -----------------------------------------------------------------------------


def profiles_dir() -> Path:
    """Where named profiles live: the repo's ``sandbox-profiles/`` or the copy shipped in the package."""
    override = os.environ.get("IPYFENCE_PROFILES_DIR")
    if override:
        return Path(override)
    shipped = Path(__file__).parent / "profiles"
    if shipped.is_dir():
        return shipped
    return Path(__file__).resolve().parents[2] / "sandbox-profiles"


def available_profiles() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def load_profile(name: str) -> Policy:
    if not name or "/" in name or name.startswith("."):
        raise PolicyError(f"profile name {name!r} is not valid; choose one of: {', '.join(available_profiles())}")
    path = profiles_dir() / f"{name}.yaml"
    if not path.is_file():
        raise PolicyError(f"unknown profile {name!r}; choose one of: {', '.join(available_profiles())}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: invalid YAML: {exc}") from None
    return apply_settings(Policy(), data or {}, str(path))


def load_config_file(policy: Policy, path: Path) -> Policy:
    """Layer an srt-format JSON settings file over ``policy``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyError(f"{path}: sandbox config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"{path}: cannot read sandbox config: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    return apply_settings(policy, data, str(path))


def load_policy(profile: str, config_file: Path | None) -> Policy:
    policy = load_profile(profile)
    if config_file is not None:
        policy = load_config_file(policy, config_file)
    return policy


# --- path resolution ---------------------------------------------------------------------


_ESCAPED = re.compile(r"\\(.)", re.DOTALL)


def is_glob(entry: str) -> bool:
    """True when ``entry`` has an unescaped glob character (``\\[`` is a literal ``[``)."""
    return any(ch in GLOB_CHARS for ch in _ESCAPED.sub("", entry))


def literal_path(entry: str) -> str:
    """The path a non-glob entry names: resolved entries escape glob characters of real paths."""
    return _ESCAPED.sub(r"\1", entry) if "\\" in entry else entry


def _escape(path: str) -> str:
    # Only when needed, so ordinary paths stay as written (and as --print-policy shows them).
    return wcglob.escape(path) if any(ch in path for ch in "*?[]{}()|!\\") else path


def resolve_entry(entry: str, workspace: Path, loc: str) -> str:
    """Make one path or glob absolute: ``~`` → home, relative → workspace.

    A relative entry may not climb out of the workspace with ``..``; write it as an
    absolute path if that is really meant.
    """
    if entry.startswith("~"):
        expanded = os.path.expanduser(entry)
        if not os.path.isabs(expanded):  # "~user" for an unknown user stays relative
            raise PolicyError(f"{loc}: cannot expand {entry!r} to a home directory; use an absolute path")
        # The home part is a literal path: escape its glob characters (a home named "a[1]" would
        # otherwise turn "~/.ssh/**" into a pattern that never matches). A literal entry is
        # escaped whole, so "is this a glob" still reads right on the resolved entry.
        user, _, rest = entry.partition("/")
        home = os.path.expanduser(user)
        if not is_glob(entry):
            return _escape(os.path.normpath(expanded))
        return os.path.normpath(_escape(home) + ("/" + rest if rest else ""))
    if os.path.isabs(entry):
        return os.path.normpath(entry)
    joined = os.path.normpath(os.path.join(workspace, entry))
    if joined != str(workspace) and not joined.startswith(str(workspace) + os.sep):
        raise PolicyError(f"{loc}: relative path {entry!r} escapes the workspace; use an absolute path")
    if not is_glob(entry):
        return _escape(joined)
    # Same for the workspace part of a relative glob ("ws[1]" + "**/.env").
    return os.path.normpath(_escape(str(workspace)) + "/" + entry)


def resolve_paths(policy: Policy, workspace: Path) -> Policy:
    """Return ``policy`` with every filesystem entry made absolute against ``workspace``."""
    source = policy.sources[-1] if policy.sources else "policy"
    fs = policy.filesystem
    changes: dict[str, Any] = {}
    for f in fields(FilesystemPolicy):
        value = getattr(fs, f.name)
        if isinstance(value, tuple):
            changes[f.name] = tuple(
                resolve_entry(e, workspace, f"{source}: filesystem.{_camel(f.name)}[{i}]") for i, e in enumerate(value)
            )
    net = policy.network
    sockets = tuple(resolve_entry(e, workspace, f"{source}: network.allowUnixSockets") for e in net.allow_unix_sockets)
    return replace(policy, filesystem=replace(fs, **changes), network=replace(net, allow_unix_sockets=sockets))


def _all_entries(policy: Policy) -> list[str]:
    fs = policy.filesystem
    return [*fs.deny_read, *fs.allow_read, *fs.allow_write, *fs.deny_write, *policy.network.allow_unix_sockets]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def weakenings(policy: Policy, workspace: Path) -> list[str]:
    """Choices in a resolved policy that open up the default boundary, for a loud log line."""
    found: list[str] = []
    fs, net = policy.filesystem, policy.network
    for entry in fs.allow_read:
        if ".env" in os.path.basename(entry) or entry.endswith("**"):
            found.append(f"allowRead {entry!r} re-allows reading secrets (.env files)")
    for entry in fs.allow_write:
        if entry != str(workspace) and not entry.startswith(str(workspace) + os.sep):
            found.append(f"allowWrite {entry!r} lets the kernel write outside the workspace")
    if "*" in net.allowed_domains:
        found.append("allowedDomains '*' lets the kernel reach any host on the internet")
    elif net.allowed_domains:
        found.append(f"the kernel may reach: {', '.join(net.allowed_domains)}")
    if net.allow_all_unix_sockets:
        found.append("allowAllUnixSockets lets the kernel connect to any unix socket it can see")
    return found


def to_srt_settings(policy: Policy) -> dict[str, Any]:
    """The policy in sandbox-runtime's settings format (used by --print-policy and the srt backend)."""
    fs, net = policy.filesystem, policy.network
    network: dict[str, Any] = {
        "allowedDomains": list(net.allowed_domains),
        "deniedDomains": list(net.denied_domains),
        "allowLocalBinding": net.allow_local_binding,
    }
    if net.allow_unix_sockets:
        network["allowUnixSockets"] = list(net.allow_unix_sockets)
    if net.allow_all_unix_sockets:
        network["allowAllUnixSockets"] = True
    network.update(net.srt_extra)
    filesystem: dict[str, Any] = {
        "denyRead": list(fs.deny_read),
        "allowWrite": list(fs.allow_write),
        "denyWrite": list(fs.deny_write),
    }
    if fs.allow_read:
        filesystem["allowRead"] = list(fs.allow_read)
    if fs.allow_git_config:
        filesystem["allowGitConfig"] = True
    return {"network": network, "filesystem": filesystem, **policy.srt_extra}
