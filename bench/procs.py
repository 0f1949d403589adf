"""Process-tree helpers: peak RSS sampling and cleanup of what the bench started."""

from __future__ import annotations

import contextlib
import threading
import time

import psutil


def tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (bwrap's pid namespace is still visible from the host)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def tree_rss(pid: int) -> int:
    total = 0
    for proc in tree(pid):
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


class RssSampler:
    """Samples the summed RSS of a process tree in a thread and keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        # Every process of the tree, for cleanup: psutil checks the creation time before
        # signalling, so a reused pid is never hit.
        self.seen: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak

    def _run(self) -> None:
        while not self._stop.is_set():
            procs = tree(self.pid)
            for proc in procs:
                self.seen.setdefault(proc.pid, proc)
            total = 0
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    total += proc.memory_info().rss
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)


def children_of_self() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


def kill_procs(procs: list[psutil.Process], grace: float = 3.0) -> None:
    """Terminate, then kill, processes this bench started (by pid, never by name)."""
    procs = [p for p in procs if p.is_running()]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    if alive:
        time.sleep(0.1)
