"""Measurements of an MCP stdio server (ipyfence or ipybox) with the SDK's real client."""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from config import Config
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from procs import RssSampler, children_of_self, kill_procs
from stats import Row, summarize
from systems import System, ipybox_uninstall, server_env

BIG_CELL = "print(('x' * 99 + '\\n') * 10_000, end='')"  # 1,000,000 characters
BIG_CHARS = 1_000_000
BIG_LIMIT = 2_000_000  # max_output_chars: no truncation on either system
EVERYTHING = {"command": "mcp-server-everything", "args": []}
TOOL_CELL = """\
import time
from mcptools.everything.echo import Params, run
_t = time.perf_counter()
for _i in range({n}):
    run(Params(message="hi"))
print(f"PERCALL {{(time.perf_counter() - _t) / {n} * 1000:.4f}}")
"""


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def text_of(result: Any) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


@dataclass
class Server:
    client: Client
    pid: int
    sampler: RssSampler

    async def cell(self, code: str, timeout: float = 120, max_output_chars: int = 5000) -> str:
        args = {"code": code, "timeout": timeout, "max_output_chars": max_output_chars}
        result = await self.client.call_tool("execute_ipython_cell", args)
        text = text_of(result)
        if result.is_error:
            raise RuntimeError(f"cell failed: {text[-500:]}")
        return text

    async def tool(self, name: str, args: dict[str, Any]) -> str:
        result = await self.client.call_tool(name, args)
        text = text_of(result)
        if result.is_error:
            raise RuntimeError(f"{name} failed: {text[-500:]}")
        return text


class Runner:
    """Starts servers of one system in fresh workspaces and cleans up after them."""

    def __init__(self, system: System, cfg: Config, pip_env: dict[str, str], tmp: Path) -> None:
        self.system = system
        self.cfg = cfg
        self.pip_env = pip_env
        self.tmp = tmp / system.key
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.state_root = self.tmp / "state"
        self.errlog = self.tmp / "server-stderr.log"
        self._n = 0

    def fresh_workspace(self, tag: str) -> Path:
        self._n += 1
        ws = self.tmp / f"ws-{tag}-{self._n}"
        ws.mkdir()
        return ws

    @asynccontextmanager
    async def open(self, ws: Path, extra_args: tuple[str, ...] = ()) -> AsyncIterator[Server]:
        """Spawn + initialize. Server stderr goes to a log file (exec keeps the pid)."""
        argv = [*self.system.command(ws), *extra_args]
        env = server_env(self.pip_env, self.state_root, self.errlog, self.system.extra_env)
        params = StdioServerParameters(
            command="/bin/sh", args=["-c", 'exec "$0" "$@" 2>>"$BENCH_ERRLOG"', *argv], env=env, cwd=str(ws)
        )
        before = children_of_self()
        sampler: RssSampler | None = None
        try:
            async with Client(params, read_timeout_seconds=600) as client:
                new = children_of_self() - before
                pid = max(new) if new else -1
                sampler = RssSampler(pid)
                sampler.__enter__()
                yield Server(client, pid, sampler)
        finally:
            if sampler is not None:
                sampler.stop()
                leftovers = [p for p in sampler.seen.values() if p.is_running()]
                if leftovers:
                    # The SDK closes stdin and then terminates the server; anything still alive
                    # (e.g. a kernel gateway's kernel) was started by this bench: end it by pid.
                    await asyncio.to_thread(kill_procs, leftovers)


async def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    await fn()
    return (time.perf_counter() - t0) * 1000


async def measure(system: System, cfg: Config, pip_env: dict[str, str], tmp: Path, wheel: str) -> dict[str, Row]:
    """Every row for one MCP system. A failing row is recorded as an error; the others go on."""
    runner = Runner(system, cfg, pip_env, tmp)
    rows: dict[str, Row] = {}
    full = system.key != "srt"  # srt: start-up, round trip, 1 MB, reset and RSS only

    def fail(key: str, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}".strip()[:300]
        log(f"{system.key}: {key} failed: {msg}")
        rows[key] = Row(error=msg)

    # --- the main session: cold start, round trip, 1 MB, reset, RSS, register, tool calls ---------
    cold: list[float] = []
    try:
        ws = runner.fresh_workspace("main")
        t0 = time.perf_counter()
        async with runner.open(ws) as srv:
            await srv.cell("1+1")
            cold.append((time.perf_counter() - t0) * 1000)
            log(f"{system.key}: cold start {cold[-1]:.0f} ms")
            await _session_rows(srv, system, cfg, rows, fail, full)
    except Exception as exc:
        fail("cold_start", exc)
        return rows

    # --- more cold starts, each in a fresh workspace ----------------------------------------------
    for _ in range(cfg.cold_reps - 1):
        try:
            ws = runner.fresh_workspace("cold")
            t0 = time.perf_counter()
            async with runner.open(ws) as srv:
                await srv.cell("1+1")
                cold.append((time.perf_counter() - t0) * 1000)
        except Exception as exc:
            fail("cold_start", exc)
            break
    if cold:
        rows["cold_start"] = summarize(cold)
        log(f"{system.key}: cold start median {rows['cold_start'].median:.0f} ms over {len(cold)}")

    if system.ipyfence and cfg.kernel_start_reps:
        try:
            rows["kernel_start"] = await _kernel_start(runner, cfg)
        except Exception as exc:
            fail("kernel_start", exc)
    if full and cfg.install_reps:
        try:
            rows["install"] = await _install(runner, system, cfg, wheel)
        except Exception as exc:
            fail("install", exc)
    return rows


async def _session_rows(
    srv: Server, system: System, cfg: Config, rows: dict[str, Row], fail: Callable[..., None], full: bool
) -> None:
    for _ in range(20):  # warm-up: imports, JIT-less caches, first-message paths
        await srv.cell("1+1")
    try:
        per_rep: list[list[float]] = []
        for _ in range(cfg.rt_reps):
            samples = []
            for _ in range(cfg.rt_calls):
                samples.append(await timed(lambda: srv.cell("1+1")))
            per_rep.append(samples)
        rows["round_trip"] = summarize([s for rep in per_rep for s in rep], per_rep=per_rep)
        log(f"{system.key}: round trip median {rows['round_trip'].median:.2f} ms, p95 {rows['round_trip'].p95:.2f}")
    except Exception as exc:
        fail("round_trip", exc)

    try:
        samples, got = [], 0
        for _ in range(cfg.reps):
            t0 = time.perf_counter()
            out = await srv.cell(BIG_CELL, max_output_chars=BIG_LIMIT)
            samples.append((time.perf_counter() - t0) * 1000)
            got = len(out)
        rows["big_output"] = summarize(samples, note=f"{got:,} chars returned")
        if got < BIG_CHARS * 0.99:
            rows["big_output"].note += " (TRUNCATED/LOST)"
        log(f"{system.key}: 1 MB cell {rows['big_output'].median:.0f} ms ({got:,} chars)")
    except Exception as exc:
        fail("big_output", exc)

    try:
        samples = []
        for _ in range(cfg.reps):
            # An agent thinks between calls: give the standby time to be ready, as it would be.
            await anyio.sleep(cfg.reset_pause)
            t0 = time.perf_counter()
            await srv.tool("reset", {})
            await srv.cell("1+1")
            samples.append((time.perf_counter() - t0) * 1000)
        rows["reset"] = summarize(samples)
        log(f"{system.key}: reset + first cell {rows['reset'].median:.0f} ms")
    except Exception as exc:
        fail("reset", exc)
    # Peak RSS of the server and its kernel(s), before any MCP server is registered.
    rows["rss"] = Row(samples=[srv.sampler.peak / 2**20], unit="MB")
    log(f"{system.key}: peak RSS {rows['rss'].median:.0f} MB")
    if not full:
        return

    try:
        samples = []
        for _ in range(cfg.reps):
            samples.append(await timed(lambda: srv.tool("register_mcp_server", _register_args())))
        rows["register"] = summarize(samples)
        log(f"{system.key}: register_mcp_server {rows['register'].median:.0f} ms")
    except Exception as exc:
        fail("register", exc)
        return

    try:
        await srv.cell(TOOL_CELL.format(n=1))  # starts (or connects) the server once
        samples = []
        for _ in range(cfg.reps):
            out = await srv.cell(TOOL_CELL.format(n=cfg.tool_calls))
            match = re.search(r"PERCALL ([0-9.]+)", out)
            if not match:
                raise RuntimeError(f"no timing in output: {out[-300:]!r}")
            samples.append(float(match.group(1)))
        rows["tool_call"] = summarize(samples, note=f"{cfg.tool_calls} calls/cell")
        log(f"{system.key}: tool call {rows['tool_call'].median:.3f} ms/call")
    except Exception as exc:
        fail("tool_call", exc)


def _register_args() -> dict[str, Any]:
    return {"server_name": "everything", "server_params": EVERYTHING}


async def _kernel_start(runner: Runner, cfg: Config) -> Row:
    """A fresh kernel's start-up, without the standby: reset() + first cell under --no-standby."""
    samples = []
    async with runner.open(runner.fresh_workspace("kstart"), ("--no-standby",)) as srv:
        await srv.cell("1+1")
        for _ in range(cfg.kernel_start_reps):
            t0 = time.perf_counter()
            await srv.tool("reset", {})
            await srv.cell("1+1")
            samples.append((time.perf_counter() - t0) * 1000)
    log(f"{runner.system.key}: kernel start (no standby) {sorted(samples)[len(samples) // 2]:.0f} ms")
    return summarize(samples)


async def _install(runner: Runner, system: System, cfg: Config, wheel: str) -> Row:
    """install_package of a wheel already in the system's pip cache (served from a loopback index).

    The first install fills the cache and is not counted. ipybox pip-installs into its own venv,
    so the package is uninstalled between repetitions; ipyfence gets a fresh workspace each
    time, whose state dir receives a copy of the warmed pip cache before the timed call.
    """
    samples: list[float] = []
    if not system.ipyfence:
        async with runner.open(runner.fresh_workspace("install")) as srv:
            await srv.cell("1+1")
            for i in range(cfg.install_reps + 1):
                await asyncio.to_thread(ipybox_uninstall, wheel)
                t0 = time.perf_counter()
                out = await srv.tool("install_package", {"package_name": wheel})
                if i:
                    samples.append((time.perf_counter() - t0) * 1000)
                if "Successfully installed" not in out:
                    raise RuntimeError(f"pip did not install: {out[-300:]}")
        await asyncio.to_thread(ipybox_uninstall, wheel)
        log(f"{system.key}: install_package {sorted(samples)[len(samples) // 2]:.0f} ms")
        return summarize(samples)

    warm_cache: Path | None = None
    for _ in range(cfg.install_reps + 1):
        ws = runner.fresh_workspace("install")
        async with runner.open(ws) as srv:
            await srv.cell("1+1")  # the kernel is up and the state dir exists
            state = _state_dir(runner.state_root, ws)
            if warm_cache is not None:
                shutil.copytree(warm_cache, state / "pip-cache", dirs_exist_ok=True)
            t0 = time.perf_counter()
            await srv.tool("install_package", {"package_name": wheel})
            elapsed = (time.perf_counter() - t0) * 1000
            out = await srv.cell(f"import {wheel.split('=')[0]}; print('ok')")
            if "ok" not in out:
                raise RuntimeError(f"installed package does not import: {out[-300:]}")
            if warm_cache is None:
                warm_cache = Path(tempfile.mkdtemp(dir=runner.tmp)) / "pip-cache"
                shutil.copytree(state / "pip-cache", warm_cache)
            else:
                samples.append(elapsed)
    log(f"{system.key}: install_package {sorted(samples)[len(samples) // 2]:.0f} ms")
    return summarize(samples)


def _state_dir(state_root: Path, ws: Path) -> Path:
    found = list((state_root / "workspaces").glob(f"{ws.name}-*"))
    if len(found) != 1:
        raise RuntimeError(f"cannot find the state dir of {ws} under {state_root}")
    return found[0]
