"""Tell the agent which resource limit a cell ran into, and whether its kernel state survived.

Pure: the inputs are what the kernel reported (error name/value, exit status) and the cgroup
counters read before and after the cell.
"""

from __future__ import annotations

import signal

from ipyfence.policy import LimitsPolicy
from ipyfence.sandbox.cgroups import Events

KEPT = "The kernel survived: variables are kept."


def _errno(value: str | None, number: int) -> bool:
    return value is not None and f"[Errno {number}]" in value


def cell_notes(
    limits: LimitsPolicy, error_name: str | None, error_value: str | None, before: Events, after: Events
) -> list[str]:
    """Notes for a cell that finished (the kernel is alive)."""
    notes: list[str] = []
    if error_name == "MemoryError":
        notes.append(f"the cell ran out of memory (memoryMb={limits.memory_mb} MiB address space per process)")
    if after.oom_kills > before.oom_kills:
        notes.append(
            f"a process started by the cell was killed by the memory limit (memoryMb={limits.memory_mb} MiB in total)"
        )
    if after.pids_max > before.pids_max:
        notes.append(
            f"the process limit was reached (maxProcesses={limits.max_processes} processes and threads); "
            "new processes or threads could not be started"
        )
    if _errno(error_value, 28):  # ENOSPC
        notes.append(
            f"a filesystem is full; the private /tmp holds at most tmpSizeMb={limits.tmp_size_mb} MiB "
            "(delete files there to free space)"
        )
    if _errno(error_value, 27):  # EFBIG: RLIMIT_FSIZE (Python ignores SIGXFSZ, so the write fails)
        notes.append(f"a file reached the size limit (maxFileSizeMb={limits.max_file_size_mb} MiB)")
    if _errno(error_value, 24):  # EMFILE
        notes.append(f"too many open files (openFiles={limits.open_files} per process)")
    found = [f"[ipyfence: limit hit: {n}. {KEPT}]" for n in notes]
    if error_name == "StdinNotImplementedError":
        found.append(
            "[ipyfence: input() is not available: cells cannot read from stdin (nobody is there to type). "
            "Put the value in the code instead. The kernel survived: variables are kept.]"
        )
    return found


def describe_exit(code: int | None) -> str:
    """bwrap reports a signal death of the kernel as 128+N; Popen as -N."""
    if code is None:
        return "exit status unknown"
    if code < 0 or code > 128:
        num = -code if code < 0 else code - 128
        try:
            name = signal.Signals(num).name
        except ValueError:
            name = f"signal {num}"
        return f"killed by {name}"
    return f"exit code {code}"


def death_cause(limits: LimitsPolicy, code: int | None, before: Events, after: Events) -> str:
    """Why the kernel died, e.g. ``killed by SIGKILL: the memory limit (memoryMb=512 MiB) was hit``."""
    how = describe_exit(code)
    if after.oom_kills > before.oom_kills:
        return f"{how}: the memory limit (memoryMb={limits.memory_mb} MiB in total) was hit"
    if how == "killed by SIGXCPU":
        return f"{how}: the CPU time limit (cpuSeconds={limits.cpu_seconds}) was hit"
    if after.pids_max > before.pids_max:
        return f"{how}, after the process limit (maxProcesses={limits.max_processes}) was hit"
    if how == "killed by SIGKILL":
        return f"{how}, likely out of memory"
    return how


def death_note(cause: str) -> str:
    return (
        f"[ipyfence: the kernel died ({cause}) while running this cell. State lost: all variables and imports "
        "are gone; a new kernel is ready.]"
    )
