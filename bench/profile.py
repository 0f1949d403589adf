"""Profile ipyfence's hot paths with py-spy (needs root or ptrace rights): not part of `make bench`.

python bench/profile.py cold|rt [--no-sandbox] [--calls N]
Runs the server under `py-spy record` (collapsed stacks) while the SDK client does a cold start
(spawn → initialize → first cell) or N round trips, then prints the heaviest frames.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from systems import IPYFENCE


def top(collapsed: Path, n: int = 25) -> str:
    """Inclusive and self sample counts per frame (function (file:line)) from py-spy's raw output."""
    inclusive: collections.Counter[str] = collections.Counter()
    self_: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        for frame in set(frames):
            inclusive[frame] += k
        self_[frames[-1]] += k
    out = [f"{total} samples"]
    out += ["-- inclusive"] + [f"{c * 100 / total:5.1f}%  {f}" for f, c in inclusive.most_common(n)]
    out += ["-- self"] + [f"{c * 100 / total:5.1f}%  {f}" for f, c in self_.most_common(n)]
    return "\n".join(out)


async def drive(mode: str, argv: list[str], calls: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_ENV_")}
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=env)
    t0 = time.perf_counter()
    async with Client(params, read_timeout_seconds=600) as client:
        await client.call_tool("execute_ipython_cell", {"code": "1+1"})
        print(f"cold start {time.perf_counter() - t0:.3f}s", file=sys.stderr)
        if mode == "rt":
            t1 = time.perf_counter()
            for _ in range(calls):
                await client.call_tool("execute_ipython_cell", {"code": "1+1"})
            print(f"round trip {(time.perf_counter() - t1) / calls * 1000:.2f} ms", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["cold", "rt"])
    parser.add_argument("--no-sandbox", action="store_true")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory(prefix="ipyfence-prof-") as tmp:
        ws = Path(tmp) / "ws"
        ws.mkdir()
        os.environ["IPYFENCE_STATE_DIR"] = str(Path(tmp) / "state")
        out = args.out or Path(tmp) / "stacks.txt"
        server = [IPYFENCE, "--log-level", "WARNING", "--workspace", str(ws)]
        if args.no_sandbox:
            server.append("--no-sandbox")
        # py-spy prints to stdout, which is the MCP transport: attach it by pid from a wrapper
        # shell that then execs the server (same pid), with py-spy's own output discarded.
        record = f"{pyspy} record -r 250 -f raw -o {out} --pid $$ >/dev/null 2>&1 &"
        argv = ["/bin/sh", "-c", record + ' exec "$0" "$@"', sys.executable, *server]
        anyio.run(drive, args.mode, argv, args.calls)
        time.sleep(2.0)  # py-spy writes its file after the server exits
        print(top(out))


if __name__ == "__main__":
    main()
