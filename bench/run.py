"""`make bench`: ipyfence (bwrap, --no-sandbox, srt), ipybox 0.9.2 and a raw jupyter_client floor.

One table on stdout, progress on stderr, figures in bench/results.json. Never run in CI.
Usage: python bench/run.py [--quick] [--systems ipyfence,nosandbox,srt,ipybox,floor]
Environment: BENCH_QUICK=1 (smoke run), BENCH_REPS=N, BENCH_RT_CALLS=N.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import anyio
import floor
import mcp_bench
import report
from config import Config
from mcp_bench import log
from pyindex import fetch_wheel, serve_index
from stats import Row
from systems import BENCH_DIR, System, ensure_ipybox, ipyfence_systems

ALL = ["ipyfence", "nosandbox", "srt", "ipybox", "floor", "baseline"]
DEFAULT = [s for s in ALL if s != "baseline"]  # baseline only when asked for (BENCH_BASELINE_IPYFENCE)
PACKAGE = "tabulate"


async def _run(cfg: Config, wanted: list[str], tmp: Path) -> report.Results:
    results: report.Results = {}
    systems: list[System] = [s for s in ipyfence_systems() if s.key in wanted]
    if "ipybox" in wanted:
        systems.append(ensure_ipybox())
    if "srt" in wanted and not shutil.which("srt"):
        results["srt"] = {"_error": Row(error="srt is not installed (npm install -g @anthropic-ai/sandbox-runtime)")}
        systems = [s for s in systems if s.key != "srt"]
    if not shutil.which("mcp-server-everything"):
        log("mcp-server-everything is not on PATH: the register and tool-call rows will fail")

    wheel = fetch_wheel(PACKAGE)
    with serve_index(wheel, tmp / "index") as index_url:
        # Same pip settings for every system: only the loopback index, no machine config.
        pip_env = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index_url, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        for system in systems:
            if system.error:
                log(f"{system.key}: {system.error}")
                results[system.key] = {"_error": Row(error=system.error)}
                continue
            if system.key == "ipybox":
                system.extra_env["PIP_CACHE_DIR"] = str(tmp / "ipybox-pip-cache")
            log(f"--- {system.label}")
            started = time.monotonic()
            try:
                results[system.key] = await mcp_bench.measure(system, cfg, pip_env, tmp, PACKAGE)
            except Exception as exc:  # never let one system sink the run
                results[system.key] = {"_error": Row(error=f"{type(exc).__name__}: {exc}"[:300])}
                log(f"{system.key}: failed: {exc}")
            log(f"{system.key}: done in {time.monotonic() - started:.0f}s")
    if "floor" in wanted:
        log("--- floor: jupyter_client + bare ipykernel")
        try:
            results["floor"] = await floor.measure(cfg)
        except Exception as exc:
            results["floor"] = {"_error": Row(error=f"{type(exc).__name__}: {exc}"[:300])}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few repetitions (same as BENCH_QUICK=1)")
    parser.add_argument("--systems", default=",".join(DEFAULT), help="comma-separated subset of " + ",".join(ALL))
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results.json")
    args = parser.parse_args()
    cfg = Config.from_env(quick=args.quick)
    wanted = [s for s in args.systems.split(",") if s]
    unknown = set(wanted) - set(ALL)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ipyfence-bench-") as tmp:
        results = anyio.run(_run, cfg, wanted, Path(tmp))
    table, verdicts = report.render(results)
    elapsed = time.monotonic() - started
    print(table)
    payload = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
        },
        "config": vars(cfg),
        "elapsed_s": round(elapsed, 1),
        "results": {s: {k: r.to_json() for k, r in rows.items()} for s, rows in results.items()},
        "targets": verdicts,
        "table": table,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {args.out} ({elapsed:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
