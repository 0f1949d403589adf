"""Validate ``install_package``'s one argument before anything runs.

The spec reaches pip as one argv element (never a shell), but pip would still read a
leading ``-`` as an option and a requirements file line as more than one package, so
the accepted shapes are narrow: one PEP 508 requirement, one URL (VCS, http(s), file),
or one local path. Every rejection names what was wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from packaging.requirements import InvalidRequirement, Requirement

from ipyfence.errors import ToolInputError

MAX_SPEC_CHARS = 2000
EXAMPLES = "e.g. 'requests', 'numpy>=1.20', 'pkg[extra]==1.2' or 'git+https://github.com/org/repo.git'"

# Schemes pip can install from. Anything else (ftp:, javascript:, data:) is a mistake or worse.
URL_SCHEMES = frozenset(
    {"http", "https", "file"}
    | {f"{vcs}+{proto}" for vcs in ("git", "hg", "svn", "bzr") for proto in ("https", "http", "ssh", "file")}
    | {"git+git", "svn+svn"}
)
# Characters that only mean something to a shell. pip never sees a shell, but a spec that
# contains them was almost certainly meant for one (``requests; rm -rf ~``), so say so.
SHELL_META = frozenset(";|`$\\'\"")
# In URLs, '&' separates fragment keys (``#egg=x&subdirectory=y``); elsewhere it is a shell operator.
URL_ONLY = frozenset("&")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class PackageSpec:
    text: str  # exactly what pip gets
    kind: Literal["requirement", "url", "path"]
    name: str | None  # the distribution name when the spec states it


def _reject(spec: str, why: str) -> ToolInputError:
    shown = spec if len(spec) <= 120 else spec[:117] + "..."
    return ToolInputError(f"install_package rejected {shown!r}: {why}")


def parse_spec(raw: str) -> PackageSpec:
    """The validated spec, or ``ToolInputError`` saying what is wrong with it."""
    spec = raw.strip()
    if not spec:
        raise _reject(raw, f"the package spec is empty; give one package, {EXAMPLES}")
    if len(spec) > MAX_SPEC_CHARS:
        raise _reject(spec, f"the spec is {len(spec)} characters long (at most {MAX_SPEC_CHARS})")
    if _CONTROL.search(spec):
        raise _reject(spec, "it contains a newline or control character; give one package spec on one line")
    if spec.startswith("-"):
        option = spec.split()[0].split("=")[0]
        raise _reject(spec, f"{option!r} is a pip option; options are not accepted, only one package spec")
    embedded = next((tok for tok in spec.split() if tok.startswith("-")), None)
    if embedded is not None:
        raise _reject(spec, f"it contains the pip option {embedded!r}; options are not accepted, only one package spec")
    bad = sorted({c for c in spec if c in SHELL_META})
    if bad:
        raise _reject(
            spec,
            f"it contains shell metacharacter(s) {' '.join(bad)}; no shell is involved, and environment markers "
            f"(';') are not supported: give one package spec, {EXAMPLES}",
        )
    if _SCHEME.match(spec):
        return PackageSpec(_check_url(spec, spec), "url", None)
    if spec.startswith(("/", "./", "../")):
        return _path_spec(spec)
    return _requirement_spec(spec)


def _check_url(spec: str, url: str) -> str:
    if any(c.isspace() for c in url):
        raise _reject(spec, "a URL cannot contain spaces; give one URL")
    scheme = url.split(":", 1)[0].lower()
    if scheme not in URL_SCHEMES:
        raise _reject(spec, f"URL scheme {scheme!r} is not supported; use one of {', '.join(sorted(URL_SCHEMES))}")
    parts = urlsplit(url)
    if "&" in parts.scheme + parts.netloc + parts.path:
        raise _reject(spec, "it contains the shell metacharacter '&' outside the URL's query or fragment")
    if not (parts.netloc or parts.path.strip("/")):
        raise _reject(spec, "the URL names no host or path")
    return url


def _path_spec(spec: str) -> PackageSpec:
    if any(c in URL_ONLY for c in spec):
        raise _reject(spec, "it contains the shell metacharacter '&'")
    if any(c.isspace() for c in spec):
        raise _reject(spec, "a local path with spaces is not supported; use a file:// URL with %20")
    return PackageSpec(spec, "path", None)


def _requirement_spec(spec: str) -> PackageSpec:
    if any(c in URL_ONLY for c in spec.split("@", 1)[0]):
        raise _reject(spec, "it contains the shell metacharacter '&'")
    try:
        req = Requirement(spec)
    except InvalidRequirement as exc:
        if _several(spec):
            raise _reject(spec, "it names more than one package; install one package per call") from None
        first_line = str(exc).splitlines()[0] if str(exc) else "invalid syntax"
        raise _reject(spec, f"not a valid requirement ({first_line}); give one package, {EXAMPLES}") from None
    if req.marker is not None:  # unreachable while ';' is rejected, but keep the rule explicit
        raise _reject(spec, "environment markers are not supported")
    if req.url:
        _check_url(spec, req.url)
        return PackageSpec(spec, "url", req.name)
    return PackageSpec(spec, "requirement", req.name)


def _several(spec: str) -> bool:
    """``requests numpy`` or ``requests,numpy``: each piece alone is a valid requirement."""
    pieces = [p for p in re.split(r"[\s,]+", spec) if p]
    if len(pieces) < 2:
        return False
    for piece in pieces:
        try:
            Requirement(piece)
        except InvalidRequirement:
            return False
    return True
