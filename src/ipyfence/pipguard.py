"""Kernel side: ``%pip install`` and ``!pip install`` answer at once with a pointer to install_package.

The kernel has no network, so pip in a cell can only fail, after retrying a connection it
will never get. ``install(shell)`` runs in the kernel before any user code (ipyfence's
start-up step, or as an IPython extension): it replaces the ``%pip`` magic (and
``%conda``/``%mamba``/``%micromamba`` where IPython has them) and guards the shell escapes
(``!cmd``, ``!!cmd``, ``x = !cmd``) so that an install command prints the note and runs
nothing. Other pip commands (``!pip list``, ``!pip show``) still run. A ``pip`` started any
other way (``subprocess``, ``%%bash``) fails fast too: the kernel's environment sets
``PIP_NO_INDEX`` and ``PIP_RETRIES=0`` (see ``sandbox.launch.base_env``).

This is a convenience, not a boundary: the sandbox's missing network is the boundary.
Standard library and IPython only; it runs inside the sandbox.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any

NOTE = (
    "[ipyfence: pip cannot install packages from inside this sandboxed kernel (it has no network), so nothing "
    'was run. Use the install_package tool instead, e.g. install_package("requests"): the package can be '
    "imported here at once and stays installed across reset(). list_packages() shows what is installed.]"
)
INSTALLERS = ("pip", "conda", "mamba", "micromamba")  # magics IPython may define
NETWORK_SUBCOMMANDS = frozenset({"install", "download", "wheel", "create", "update", "upgrade"})
_SEGMENTS = re.compile(r"&&|\|\||[;&|\n()`]")
_PIP = re.compile(r"^(?:pip|pip3(?:\.\d+)?|conda|mamba|micromamba)$")
_PYTHON = re.compile(r"^python(?:\d+(?:\.\d+)?)?$")
_MARK = "_ipyfence_pipguard"


def wants_network_install(command: str) -> bool:
    """True if a shell command runs pip/conda with a subcommand that needs the network."""
    for segment in _SEGMENTS.split(command):
        words = [w.strip("'\"") for w in segment.split()]
        for i, word in enumerate(words):
            base = os.path.basename(word)
            rest: list[str] | None = None
            if _PIP.match(base):
                rest = words[i + 1 :]
            elif (_PYTHON.match(base) or word == sys.executable) and words[i + 1 : i + 3] == ["-m", "pip"]:
                rest = words[i + 3 :]
            elif base == "uv" and words[i + 1 : i + 2] == ["pip"]:
                rest = words[i + 2 :]
            subcommand = next((w for w in rest or () if not w.startswith("-")), None)
            if subcommand in NETWORK_SUBCOMMANDS:
                return True
    return False


def _note() -> None:
    print(NOTE, file=sys.stderr, flush=True)


def _magic(line: str = "") -> None:
    _note()


def _guard(run: Callable[..., Any], empty: Callable[[], Any]) -> Callable[..., Any]:
    def guarded(cmd: str, *args: Any, **kwargs: Any) -> Any:
        if isinstance(cmd, str) and wants_network_install(cmd):
            _note()
            return empty()
        return run(cmd, *args, **kwargs)

    guarded.__doc__ = run.__doc__
    return guarded


def install(shell: Any) -> None:
    """Install the guards on an IPython ``InteractiveShell``. Idempotent."""
    if getattr(shell, _MARK, False):
        return
    line_magics = shell.magics_manager.magics.get("line", {})
    for name in INSTALLERS:
        if name == "pip" or name in line_magics:
            shell.register_magic_function(_magic, magic_kind="line", magic_name=name)
    if hasattr(shell, "system"):
        shell.system = _guard(shell.system, lambda: None)
    if hasattr(shell, "getoutput"):
        from IPython.utils.text import SList

        shell.getoutput = _guard(shell.getoutput, SList)
    setattr(shell, _MARK, True)


def load_ipython_extension(shell: Any) -> None:
    """``--IPKernelApp.extra_extensions=ipyfence.pipguard`` also installs it."""
    install(shell)
