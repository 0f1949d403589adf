"""Which limit a cell hit, from error names and cgroup counters (pure)."""

from __future__ import annotations

from ipyfence.limitnotes import cell_notes, death_cause, death_note, describe_exit
from ipyfence.policy import LimitsPolicy
from ipyfence.sandbox import bwrap
from ipyfence.sandbox.cgroups import Events, KernelGroups

LIMITS = LimitsPolicy(
    memory_mb=1024, max_processes=64, cpu_seconds=30, max_file_size_mb=8, open_files=256, tmp_size_mb=16
)
NONE = Events()


def test_memory_error() -> None:
    (note,) = cell_notes(LIMITS, "MemoryError", "", NONE, NONE)
    assert "ran out of memory (memoryMb=1024" in note and "variables are kept" in note


def test_pids_counter_rising_names_max_processes() -> None:
    (note,) = cell_notes(LIMITS, None, None, Events(pids_max=2), Events(pids_max=9))
    assert "maxProcesses=64" in note


def test_oom_kill_of_a_child_while_the_kernel_lives() -> None:
    (note,) = cell_notes(LIMITS, None, None, NONE, Events(oom_kills=1))
    assert "killed by the memory limit" in note


def test_errno_mapping() -> None:
    assert "tmpSizeMb=16" in cell_notes(LIMITS, "OSError", "[Errno 28] No space left on device", NONE, NONE)[0]
    assert "maxFileSizeMb=8" in cell_notes(LIMITS, "OSError", "[Errno 27] File too large", NONE, NONE)[0]
    assert "openFiles=256" in cell_notes(LIMITS, "OSError", "[Errno 24] Too many open files", NONE, NONE)[0]
    assert cell_notes(LIMITS, "ValueError", "[Errno 280] not an errno we map", NONE, NONE) == []


def test_input_gets_a_note() -> None:
    (note,) = cell_notes(LIMITS, "StdinNotImplementedError", "raw_input was called", NONE, NONE)
    assert "input() is not available" in note


def test_exit_descriptions() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(128 + 11) == "killed by SIGSEGV"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(None) == "exit status unknown"


def test_death_causes() -> None:
    assert "memory limit (memoryMb=1024" in death_cause(LIMITS, 137, NONE, Events(oom_kills=1))
    assert "CPU time limit (cpuSeconds=30)" in death_cause(LIMITS, 128 + 24, NONE, NONE)
    assert death_cause(LIMITS, 137, NONE, NONE) == "killed by SIGKILL, likely out of memory"
    note = death_note("exit code 3")
    assert "kernel died (exit code 3)" in note and "State lost" in note and "new kernel is ready" in note


def test_cpu_soft_limit_is_below_the_hard_one() -> None:
    """soft == hard would make Linux send SIGKILL, not the SIGXCPU that names the cause."""
    prefix = bwrap.limits_prefix(LIMITS)
    assert f"--cpu=30:{30 + bwrap.CPU_GRACE}" in prefix


def test_wrapper_joins_groups_before_exec(tmp_path: object) -> None:
    groups = KernelGroups.__new__(KernelGroups)
    from pathlib import Path

    groups.dirs = {"pids": Path("/cg/pids/k1"), "memory": Path("/cg/memory/k1")}
    argv = groups.wrap(["bwrap", "--", "python"])
    assert argv[:2] == ["/bin/sh", "-c"]
    assert argv[3:] == [
        "ipyfence-cgroup",
        "/cg/memory/k1/cgroup.procs",
        "/cg/pids/k1/cgroup.procs",
        "--",
        "bwrap",
        "--",
        "python",
    ]
