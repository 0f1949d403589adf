"""install_package's only way out of pip's network namespace: a proxy that reaches the index only.

Under bwrap, pip runs with ``--unshare-net`` like the kernel: its namespace has nothing but
its own loopback. Two pieces connect it to the package index and to nothing else:

- inside the sandbox, ``FORWARDER`` (stdlib only, run with ``python -I``) listens on
  ``127.0.0.1:FORWARD_PORT`` of the private loopback, starts pip, and copies each TCP
  connection to a unix socket in pip's private host-only directory (bind-mounted in);
- on the host, ``IndexProxy`` (asyncio streams) listens on that socket and speaks HTTP
  proxy: ``CONNECT host:port`` for https, absolute-URI requests for http. It forwards only
  to the ``host:port`` pairs of pip's own configuration (index-url, extra-index-url,
  find-links from ``PIP_*`` and pip.conf; pypi.org and files.pythonhosted.org when no
  index-url is set) and of a URL spec being installed. The name is resolved here and the
  connection goes to that address, so DNS cannot swap it; a destination that resolves to a
  loopback, private or link-local address is refused unless pip's configuration names it
  (a mirror on loopback or the LAN). Heads and connection counts are bounded.

When the host itself goes out through a proxy (HTTPS_PROXY / HTTP_PROXY, minus NO_PROXY),
allowed requests are chained to it; it then resolves the names, so the private-address
check is its business.

A unix socket crosses the namespace boundary without giving the sandbox any host network:
it reaches exactly one listener, ours. Hand-written on asyncio rather than a library
because the filter is the whole point and fits in a page; srt's proxy is used when the
srt backend is (it runs its own).
"""

from __future__ import annotations

import asyncio
import base64
import configparser
import contextlib
import ipaddress
import logging
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from packaging.requirements import InvalidRequirement, Requirement

from ipyfence.packages.pipenv import user_config_files
from ipyfence.packages.spec import PackageSpec

log = logging.getLogger(__name__)

FORWARD_PORT = 3128  # on the sandbox's private loopback: no other listener can be there
MAX_HEAD = 16 * 1024  # bytes of request line plus headers
MAX_CONNECTIONS = 32  # at once; pip uses a handful
HEAD_TIMEOUT = 30.0  # seconds to send a request head
CONNECT_TIMEOUT = 30.0  # seconds to reach the index
DEFAULT_INDEX = ("https://pypi.org/simple", "https://files.pythonhosted.org/")
_CONFIG_KEYS = {"index-url": True, "extra-index-url": False, "find-links": False}
_DROP_HEADERS = {b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive"}

# Runs inside the sandbox: argv = sock, port, "--", command... Binds before starting the
# command (pip can connect at once) and exits with the command's status.
FORWARDER = r"""
import ctypes, os, signal, socket, sys, threading
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: build code cannot ptrace it or read its memory
path, port, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[4:]
lst = socket.socket()
lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lst.bind(("127.0.0.1", port))
lst.listen(64)
pid = os.fork()
if pid == 0:
    lst.close()
    os.execv(cmd[0], cmd)
def pump(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    try:
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
def serve(c):
    u = socket.socket(socket.AF_UNIX)
    try:
        u.connect(path)
    except OSError:
        c.close()
        return
    t = threading.Thread(target=pump, args=(u, c), daemon=True)
    t.start()
    pump(c, u)
    t.join()
    c.close()
    u.close()
def accept():
    while True:
        c, _ = lst.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
while True:
    try:
        _, status = os.waitpid(pid, 0)
        break
    except InterruptedError:
        continue
code = os.waitstatus_to_exitcode(status)
sys.exit(128 - code if code < 0 else code)
"""


@dataclass(frozen=True)
class Destination:
    """One host:port pip may reach; ``private_ok`` when pip's own configuration names it."""

    host: str
    port: int
    private_ok: bool


def _destination(url: str, private_ok: bool) -> Destination | None:
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower().rsplit("+", 1)[-1]  # git+https -> https
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        return None
    return Destination(parts.hostname.lower(), port, private_ok)


def _config_files(environ: Mapping[str, str]) -> list[Path]:
    """pip's config files, in the places pip reads them (global, user, site, PIP_CONFIG_FILE)."""
    dirs = (environ.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":")
    files = [Path(d) / "pip" / "pip.conf" for d in dirs if d] + [Path("/etc/pip.conf")]
    files += [src for src, _ in user_config_files(environ)]
    files.append(Path(sys.prefix) / "pip.conf")
    if environ.get("PIP_CONFIG_FILE") and environ["PIP_CONFIG_FILE"] != os.devnull:
        files.append(Path(environ["PIP_CONFIG_FILE"]))
    return files


def configured_urls(environ: Mapping[str, str]) -> tuple[list[str], bool]:
    """(index, extra index and find-links URLs from pip's configuration, whether an index-url is set)."""
    urls: list[str] = []
    has_index = False
    for path in _config_files(environ):
        parser = configparser.RawConfigParser()
        with contextlib.suppress(OSError, configparser.Error):
            parser.read(path)
        for section in ("global", "install", "download"):
            if not parser.has_section(section):
                continue
            for key, is_index in _CONFIG_KEYS.items():
                for spelling in (key, key.replace("-", "_")):
                    value = parser.get(section, spelling, fallback="")
                    urls += value.split()
                    has_index = has_index or (is_index and bool(value.strip()))
    for key, is_index in _CONFIG_KEYS.items():
        value = environ.get("PIP_" + key.upper().replace("-", "_"), "")
        urls += value.split()
        has_index = has_index or (is_index and bool(value.strip()))
    return urls, has_index


def allowed_destinations(spec: PackageSpec, environ: Mapping[str, str]) -> frozenset[Destination]:
    urls, has_index = configured_urls(environ)
    found = {d for u in urls if (d := _destination(u, private_ok=True))}
    if not has_index:
        found |= {d for u in DEFAULT_INDEX if (d := _destination(u, private_ok=False))}
    spec_url = spec.text if spec.kind == "url" else None
    if spec.name and "@" in spec.text:  # "name @ URL"
        with contextlib.suppress(InvalidRequirement):
            spec_url = Requirement(spec.text).url
    if spec_url and (d := _destination(spec_url, private_ok=False)):
        found.add(d)
    # One entry per host:port: a spec URL on a configured index keeps the index's private_ok
    # (two entries would leave the proxy's choice to set order, which hash seeds change).
    merged: dict[tuple[str, int], bool] = {}
    for d in found:
        merged[(d.host, d.port)] = merged.get((d.host, d.port), False) or d.private_ok
    return frozenset(Destination(host, port, ok) for (host, port), ok in merged.items())


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A global address, also when an IPv6 form embeds an IPv4 one (mapped, compatible, 6to4, NAT64).

    ``is_global`` alone calls ``::127.0.0.1``, ``2002:7f00:1::`` and ``64:ff9b::7f00:1`` global
    on Python 3.11; on a host that routes them they reach its loopback or LAN.
    """
    if not address.is_global:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        packed = address.packed
        embedded = [address.ipv4_mapped, address.sixtofour]
        if address in _NAT64 or packed[:12] == bytes(12):  # NAT64 and IPv4-compatible: last 32 bits
            embedded.append(ipaddress.IPv4Address(packed[12:]))
        if address.teredo:
            embedded.append(address.teredo[1])
        return all(v4.is_global for v4 in embedded if v4 is not None)
    return True


def upstream_proxies(environ: Mapping[str, str]) -> dict[str, str]:
    """The host's proxy settings (``{"http": url, "https": url, "no": hosts}``), as urllib reads them."""
    found: dict[str, str] = {}
    for key, value in environ.items():
        name = key.lower()
        if value and name in ("http_proxy", "https_proxy", "no_proxy"):
            found.setdefault(name[: -len("_proxy")], value)
    return found


def _bypassed(host: str, no_proxy: str) -> bool:
    """NO_PROXY as curl and requests read it: "*", exact names, and domain suffixes."""
    for entry in (e.strip().lower().lstrip(".") for e in no_proxy.split(",")):
        entry = entry.rsplit(":", 1)[0] if entry.count(":") == 1 else entry
        if entry == "*" or (entry and (host == entry or host.endswith("." + entry))):
            return True
    return False


def _split_host_port(authority: str) -> tuple[str, int]:
    host, sep, port = authority.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(authority)
    return host.strip("[]").lower(), int(port)


class _Refused(Exception):
    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status = status


class IndexProxy:
    """The host side: an HTTP proxy on a unix socket that forwards only to ``allowed``."""

    def __init__(
        self, socket_path: Path, allowed: frozenset[Destination], upstream: Mapping[str, str] | None = None
    ) -> None:
        self.socket_path = socket_path
        self.allowed: dict[tuple[str, int], Destination] = {}
        for d in allowed:  # a host:port listed twice is private_ok if either entry is
            seen = self.allowed.get((d.host, d.port))
            self.allowed[(d.host, d.port)] = d if seen is None or d.private_ok else seen
        self.upstream = dict(upstream or {})  # the host's own proxies ({"https": url, "no": ...})
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._tasks: set[asyncio.Task[None]] = set()
        self.refused: list[str] = []  # "host:port" pip (or its build code) was not let through to

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls, socket_path: Path, allowed: frozenset[Destination], upstream: Mapping[str, str] | None = None
    ) -> AsyncIterator[IndexProxy]:
        proxy = cls(socket_path, allowed, upstream)
        server = await asyncio.start_unix_server(proxy._accept, path=str(socket_path), limit=MAX_HEAD)
        try:
            yield proxy
        finally:
            server.close()
            for task in list(proxy._tasks):
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*proxy._tasks, return_exceptions=True)
            with contextlib.suppress(OSError):
                socket_path.unlink()

    def proxy_env(self) -> dict[str, str]:
        """pip's (and git's) proxy settings inside the sandbox: everything through the forwarder."""
        url = f"http://127.0.0.1:{FORWARD_PORT}"
        env = {k: url for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "PIP_PROXY")}
        env.update({k: "" for k in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy")})
        return env

    def forwarder_argv(self, argv: list[str]) -> list[str]:
        return [sys.executable, "-I", "-c", FORWARDER, str(self.socket_path), str(FORWARD_PORT), "--", *argv]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if self._slots.locked():
                await _reply(writer, "503 Service Unavailable", "too many connections")
                return
            async with self._slots:
                await self._handle(reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except (asyncio.LimitOverrunError, ValueError):
            await _reply(writer, "431 Request Header Fields Too Large", f"request head over {MAX_HEAD} bytes")
            return
        lines = head.split(b"\r\n")
        try:
            method, target, _version = lines[0].decode("ascii").split(" ")
            if method == "CONNECT":
                host, port = _split_host_port(target)
                rest = b""
            else:
                url = urlsplit(target)
                if url.scheme != "http" or not url.hostname:
                    raise ValueError(target)
                host, port = url.hostname.lower(), url.port or 80
                path = (url.path or "/") + (f"?{url.query}" if url.query else "")
                kept = [ln for ln in lines[1:] if ln and ln.split(b":", 1)[0].strip().lower() not in _DROP_HEADERS]
                rest = b"\r\n".join([f"{method} {path} HTTP/1.1".encode(), *kept, b"Connection: close", b"", b""])
        except (ValueError, UnicodeDecodeError):
            await _reply(writer, "400 Bad Request", "not an HTTP proxy request")
            return
        via = self._upstream_for("https" if method == "CONNECT" else "http", host)
        try:
            if via is None:
                up_reader, up_writer = await self._connect(host, port)
            else:
                up_reader, up_writer = await self._connect_via(via, host, port, method, target, rest, lines)
                rest = b""
        except _Refused as exc:
            self.refused.append(f"{host}:{port}")
            log.info("pip's proxy refused %s:%s: %s", host, port, exc)
            await _reply(writer, exc.status, str(exc))
            return
        try:
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            elif rest:
                up_writer.write(rest)
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            up_writer.close()

    def _upstream_for(self, scheme: str, host: str) -> str | None:
        """The host's proxy for this request (HTTPS_PROXY / HTTP_PROXY minus NO_PROXY), if any."""
        url = self.upstream.get(scheme)
        if not url or _bypassed(host, self.upstream.get("no", "")):
            return None
        return url

    async def _connect_via(
        self, via: str, host: str, port: int, method: str, target: str, rest: bytes, lines: list[bytes]
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Through the host's own proxy: the allow-list still applies; it resolves and reaches the host."""
        if (host, port) not in self.allowed:
            raise _Refused("403 Forbidden", f"ipyfence: {host}:{port} is not a package index pip is configured with")
        parts = urlsplit(via if "://" in via else f"http://{via}")
        auth = b""
        if parts.username:
            creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            auth = b"Proxy-Authorization: Basic " + base64.b64encode(creds) + b"\r\n"
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port or 80, limit=65536), CONNECT_TIMEOUT
            )
        except (OSError, TimeoutError) as exc:
            raise _Refused(
                "502 Bad Gateway", f"ipyfence: the host's proxy {parts.hostname} is unreachable: {exc}"
            ) from None
        if method != "CONNECT":  # absolute-URI request, as the client sent it, plus our credentials
            kept = [ln for ln in lines[1:] if ln and ln.split(b":", 1)[0].strip().lower() not in _DROP_HEADERS]
            head = b"\r\n".join([f"{method} {target} HTTP/1.1".encode(), *kept, b"Connection: close", b""])
            up_writer.write(head + auth + b"\r\n")
            return up_reader, up_writer
        up_writer.write(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n".encode() + auth + b"\r\n")
        try:
            answer = await asyncio.wait_for(up_reader.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            up_writer.close()
            raise _Refused("502 Bad Gateway", f"ipyfence: the host's proxy did not answer: {exc!r}") from None
        status = answer.split(b"\r\n", 1)[0].decode("latin-1")
        if status.split(" ")[1:2] != ["200"]:
            up_writer.close()
            raise _Refused("502 Bad Gateway", f"ipyfence: the host's proxy refused {host}:{port}: {status}")
        return up_reader, up_writer

    async def _connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        dest = self.allowed.get((host, port))
        if dest is None:
            raise _Refused("403 Forbidden", f"ipyfence: {host}:{port} is not a package index pip is configured with")
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=1), CONNECT_TIMEOUT)  # SOCK_STREAM
        except (OSError, TimeoutError) as exc:
            raise _Refused("502 Bad Gateway", f"ipyfence: cannot resolve {host}: {exc}") from None
        for _family, _type, _proto, _name, sockaddr in infos:
            address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if not dest.private_ok and not is_public(address):
                continue
            with contextlib.suppress(OSError, TimeoutError):
                # To the address checked, not the name again: a second lookup could answer differently.
                return await asyncio.wait_for(asyncio.open_connection(str(address), port, limit=65536), CONNECT_TIMEOUT)
        raise _Refused(
            "502 Bad Gateway", f"ipyfence: {host}:{port} has no reachable public address (private ones are refused)"
        )


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (OSError, RuntimeError):
        pass


async def _reply(writer: asyncio.StreamWriter, status: str, why: str) -> None:
    body = (why + "\n").encode()
    writer.write(
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(OSError):
        await writer.drain()
