"""The environment pip runs with: the machine's pip configuration, nothing of the workspace.

Plain pip reads PIP_* variables, the global config files (/etc/xdg/pip, /etc/pip.conf),
the user's files under $HOME, and the proxy and certificate variables. The sandboxed pip
gets a private, writable $HOME, so the user's pip config files are copied into it at the
same relative places: pip then finds and layers them exactly as it would on the host.
The workspace ``.env`` is never consulted (plain pip does not read it either). Under bwrap
the proxy variables are then replaced by the index proxy's (packages/proxy.py), which
chains to the host's own proxy when there is one.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from ipyfence.settings import Settings

# PIP_* variables that would change where or what pip installs, which ipyfence decides.
PIP_OWNED = frozenset(
    {
        "PIP_TARGET",
        "PIP_PREFIX",
        "PIP_ROOT",
        "PIP_USER",
        "PIP_REQUIREMENT",
        "PIP_REQUIREMENTS",
        "PIP_EDITABLE",
        "PIP_SRC",
        "PIP_PYTHON",
        "PIP_NO_DEPS",
        "PIP_IGNORE_INSTALLED",
        "PIP_FORCE_REINSTALL",
        "PIP_UPGRADE",
        "PIP_DRY_RUN",
        "PIP_REPORT",
        "PIP_CACHE_DIR",
        "PIP_LOG",
        "PIP_LOG_FILE",
    }
)
# Network and certificate settings plain pip (requests, git, compilers' downloads) honours.
PASSTHROUGH = frozenset(
    {
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "all_proxy",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
        "XDG_CONFIG_DIRS",  # where pip looks for its global config
        "LANG",
        "LC_ALL",
    }
)


def user_config_files(environ: Mapping[str, str]) -> list[tuple[Path, str]]:
    """(host file, path relative to $HOME) for the user-level pip configs pip would read."""
    home = Path(environ.get("HOME") or os.path.expanduser("~"))
    xdg = environ.get("XDG_CONFIG_HOME") or str(home / ".config")
    candidates = [
        (home / ".pip" / "pip.conf", ".pip/pip.conf"),
        (Path(xdg) / "pip" / "pip.conf", ".config/pip/pip.conf"),
    ]
    return [(src, rel) for src, rel in candidates if src.is_file()]


def pip_env(
    settings: Settings, work: Path, cache_dir: Path, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment for a pip run whose private directory (home, tmp) is ``work``."""
    host = os.environ if environ is None else environ
    home = work / "home"
    for src, rel in user_config_files(host):
        dest = home / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    bindir = os.path.dirname(sys.executable)
    env = {k: v for k, v in host.items() if k in PASSTHROUGH}
    env.update({k: v for k, v in host.items() if k.startswith("PIP_") and k not in PIP_OWNED})
    env.update(
        {
            "PATH": f"{bindir}:{host.get('PATH') or '/usr/local/bin:/usr/bin:/bin'}",
            "HOME": str(home),
            "TMPDIR": str(work / "tmp"),
            "LANG": host.get("LANG", "C.UTF-8"),
            # pip sees what the kernel sees: user packages over the server's environment.
            "PYTHONPATH": str(settings.packages_dir),
            "PYTHONNOUSERSITE": "1",
            # No cwd or script directory on sys.path for pip or any Python it starts: pip's cwd
            # is its private dir, but build code could write there between the two pip runs.
            "PYTHONSAFEPATH": "1",
            "PIP_CACHE_DIR": str(cache_dir),
            "PIP_NO_INPUT": "1",
            "PIP_PROGRESS_BAR": "off",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "TERM": "dumb",
        }
    )
    (work / "tmp").mkdir(mode=0o700, exist_ok=True)
    home.mkdir(mode=0o700, exist_ok=True)
    return env
