"""Repetition counts: full by default, BENCH_QUICK=1 (or --quick) for a smoke run."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class Config:
    reps: int = 5  # repetitions of 1 MB cell, reset, register, tool-call cell, install
    cold_reps: int = 5  # cold starts, each a fresh server and workspace
    rt_reps: int = 3  # batches of round trips
    rt_calls: int = 200  # round trips per batch
    tool_calls: int = 200  # tool calls per cell
    kernel_start_reps: int = 3  # fresh-kernel starts (reset under --no-standby), ipyfence only
    install_reps: int = 3
    reset_pause: float = 2.0  # seconds between resets: the agent's think time

    @classmethod
    def from_env(cls, quick: bool = False) -> Config:
        quick = quick or os.environ.get("BENCH_QUICK", "") not in ("", "0")
        cfg = cls(reps=2, cold_reps=2, rt_reps=1, kernel_start_reps=1, install_reps=1) if quick else cls()
        if os.environ.get("BENCH_REPS"):
            n = max(1, int(os.environ["BENCH_REPS"]))
            cfg.reps = cfg.cold_reps = n
        if os.environ.get("BENCH_RT_CALLS"):
            cfg.rt_calls = max(1, int(os.environ["BENCH_RT_CALLS"]))
        return cfg
