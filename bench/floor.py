"""The floor: jupyter_client talking straight to a bare ipykernel (tcp loopback), no MCP, no sandbox."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import anyio
from config import Config
from jupyter_client.manager import AsyncKernelManager
from mcp_bench import BIG_CELL, log
from procs import RssSampler
from stats import Row, summarize


async def run_cell(kc: Any, code: str) -> str:
    """Execute and collect output until the kernel reports idle for this request (as ipyfence does)."""
    msg_id = kc.execute(code)
    out: list[str] = []
    while True:
        msg = await kc.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind in ("execute_result", "display_data"):
            out.append(content["data"].get("text/plain", ""))
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while (await kc.get_shell_msg(timeout=120))["parent_header"].get("msg_id") != msg_id:
        pass
    return "".join(out)


async def _start(km: AsyncKernelManager) -> Any:
    await km.start_kernel(stderr=subprocess.DEVNULL)  # no TCP-encryption warning on our stderr
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    return kc


async def measure(cfg: Config) -> dict[str, Row]:
    rows: dict[str, Row] = {}
    cold: list[float] = []
    for i in range(cfg.cold_reps):
        km = AsyncKernelManager(kernel_name="python3")
        t0 = time.perf_counter()
        kc = await _start(km)
        await run_cell(kc, "1+1")
        cold.append((time.perf_counter() - t0) * 1000)
        if i == 0:
            with RssSampler(km.provisioner.process.pid) as sampler:
                await _session(km, kc, cfg, rows)
            rows["rss"] = Row(samples=[sampler.peak / 2**20], unit="MB", note="kernel only")
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
    rows["cold_start"] = summarize(cold)
    log(f"floor: cold start {rows['cold_start'].median:.0f} ms")
    return rows


async def _session(km: AsyncKernelManager, kc: Any, cfg: Config, rows: dict[str, Row]) -> None:
    for _ in range(20):
        await run_cell(kc, "1+1")
    per_rep = []
    for _ in range(cfg.rt_reps):
        batch = []
        for _ in range(cfg.rt_calls):
            t0 = time.perf_counter()
            await run_cell(kc, "1+1")
            batch.append((time.perf_counter() - t0) * 1000)
        per_rep.append(batch)
    rows["round_trip"] = summarize([], per_rep=per_rep, note=" ")
    log(f"floor: round trip median {rows['round_trip'].median:.2f} ms")
    big = []
    for _ in range(cfg.reps):
        t0 = time.perf_counter()
        out = await run_cell(kc, BIG_CELL)
        big.append((time.perf_counter() - t0) * 1000)
    rows["big_output"] = summarize(big, note=f"{len(out):,} chars returned")
    resets = []
    for _ in range(cfg.reps):
        await anyio.sleep(0.2)
        t0 = time.perf_counter()
        await km.restart_kernel(now=True)
        await kc.wait_for_ready(timeout=60)
        await run_cell(kc, "1+1")
        resets.append((time.perf_counter() - t0) * 1000)
    rows["reset"] = summarize(resets, note="restart_kernel: a fresh kernel, no standby")
