"""The persisted registry of registered MCP servers (in the state dir, hidden from the kernel).

Params are stored as the agent sent them, ``${VAR}`` placeholders intact, so substituted
secrets are not written to disk. The tool list is what the bridge allows the kernel to call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

VERSION = 1


@dataclass(frozen=True)
class Registration:
    name: str
    params: dict[str, Any]  # validated, unsubstituted server_params
    tools: dict[str, str]  # MCP tool name → module name

    def to_json(self) -> dict[str, Any]:
        return {"params": self.params, "tools": self.tools}


class Registry:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.servers: dict[str, Registration] = {}

    def load(self) -> None:
        """Read the file; a missing file is empty, a corrupt one is set aside (kept) and logged."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            # Keep the bad file for the user to inspect; the next save would otherwise overwrite it.
            kept = self.path.with_name(f"{self.path.stem}.unreadable-{int(time.time())}{self.path.suffix}")
            with contextlib.suppress(OSError):
                self.path.rename(kept)
            log.warning("ignoring unreadable MCP server registry %s (kept as %s): %s", self.path, kept, exc)
            return
        servers = data.get("servers", {}) if isinstance(data, dict) else {}
        for name, entry in servers.items() if isinstance(servers, dict) else ():
            try:
                params, tools = entry["params"], entry["tools"]
                if isinstance(params, dict) and isinstance(tools, dict):
                    self.servers[name] = Registration(name, params, {str(k): str(v) for k, v in tools.items()})
            except (KeyError, TypeError):
                log.warning("ignoring malformed registry entry %r", name)

    def save(self) -> None:
        """Atomic replace, owner-only: the params may hold literal secrets."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = {"version": VERSION, "servers": {n: r.to_json() for n, r in sorted(self.servers.items())}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".registry-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
