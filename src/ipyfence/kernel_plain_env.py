"""Run by IPython inside the kernel at start-up (via ``PYTHONSTARTUP``): no colour forcing.

ipykernel sets ``TERM=xterm-color``, ``CLICOLOR``, ``FORCE_COLOR`` and ``CLICOLOR_FORCE`` in
every kernel so that ``!`` commands and subprocesses print colour. ipyfence's output goes to
an MCP client, not a terminal: colour codes only eat ``max_output_chars`` (and are stripped
from results anyway). This file runs after ipykernel has set them and before any cell, in the
user namespace, so it leaves no names behind. Stdlib only.
"""

import os as _os

for _name in ("CLICOLOR", "FORCE_COLOR", "CLICOLOR_FORCE", "PYTHONSTARTUP"):
    _os.environ.pop(_name, None)
_os.environ["TERM"] = "dumb"
del _os, _name

# Then the rest of the trusted start-up: into the workspace, the bridge connection, the seccomp filter.
from ipyfence.kernel_boot import after_start as _after_start  # noqa: E402

_after_start()
del _after_start
