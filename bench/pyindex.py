"""A PEP 503 index on loopback serving one wheel, so install_package never leaves the machine."""

from __future__ import annotations

import functools
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

WHEELS = Path(__file__).resolve().parent / ".wheels"


def fetch_wheel(requirement: str) -> Path:
    """The wheel for ``requirement`` in bench/.wheels, downloaded once with the machine's pip config."""
    WHEELS.mkdir(exist_ok=True)
    name = canonicalize_name(requirement.split("=")[0])
    found = [w for w in WHEELS.glob("*.whl") if parse_wheel_filename(w.name)[0] == name]
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
        subprocess.run([*cmd, "-d", str(WHEELS), requirement], check=True, capture_output=True, timeout=300)
        found = [w for w in WHEELS.glob("*.whl") if parse_wheel_filename(w.name)[0] == name]
    return sorted(found)[-1]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serve_index(wheel: Path, root: Path) -> Iterator[str]:
    """Yield http://127.0.0.1:PORT/simple/ listing ``wheel``."""
    name = parse_wheel_filename(wheel.name)[0]
    page = root / "simple" / name
    page.mkdir(parents=True, exist_ok=True)
    (root / wheel.name).write_bytes(wheel.read_bytes())
    (page / "index.html").write_text(f'<html><body><a href="../../{wheel.name}">{wheel.name}</a></body></html>\n')
    (root / "simple" / "index.html").write_text(f'<html><body><a href="{name}/">{name}</a></body></html>\n')
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()
