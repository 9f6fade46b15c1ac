"""The `with` block in which a `VllmUnit` starts vLLM's engine (`EngineStart`).

The engine's processes inherit the block's environment: they log their errors, and write their pids, to files it
names (`plugin._report_errors`, `plugin._report_pid`). The unit's drafter actor loads while the engine starts,
and the start blocks in vLLM; a thread waits for the actor meanwhile. When the actor fails first, the thread
kills the engine's processes (the engine core and its workers) as they record themselves. vLLM's start then
raises at once rather than after its whole model load, and the unit raises the drafter's error. Once the engine
start is over (`over`), a failing drafter no longer stops it: the unit's `_await_drafter` reports it.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time

from actors.engines.vllm.plugin import ERRORS_ENV, PIDS_ENV

KILL_POLL_S = 0.2  # how often a failed drafter's watch kills the engine's processes recorded so far


class EngineStart:
    def __init__(self, drafter_ready: list):
        """`drafter_ready`: the refs of the drafter actor loading beside the engine (none: nothing to watch)."""
        self.drafter_failure: BaseException | None = None  # the drafter's error, when it stopped the start
        self.killed_segments: set[str] = set()  # shared memory the killed processes mapped (for the unit to unlink)
        self._ready, self._saved = list(drafter_ready), {}
        self._lock, self._over = threading.Lock(), False

    def __enter__(self) -> EngineStart:
        self._dir = tempfile.TemporaryDirectory(prefix="specserve-vllm-")
        self.errors_path, self.pids_path = f"{self._dir.name}/errors.log", f"{self._dir.name}/pids"
        self.set_env({ERRORS_ENV: self.errors_path, PIDS_ENV: self.pids_path})
        if self._ready:
            threading.Thread(target=self._watch, name="specserve-drafter-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.over()
        for key, value in self._saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})
        self._dir.cleanup()

    def set_env(self, values: dict[str, str]) -> None:
        """Set environment variables for the block (restored after it)."""
        for key, value in values.items():
            self._saved.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def errors(self) -> str:
        """What vLLM's processes logged as errors so far."""
        try:
            with open(self.errors_path) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def over(self) -> None:
        """The engine start returned or raised: a drafter failing from now on no longer stops it."""
        with self._lock:
            self._over = True

    def _watch(self) -> None:
        from actors.remote.drafter import wait_started

        try:
            wait_started(self._ready)
            return
        except Exception as err:  # noqa: BLE001 - any failure of the actor's start fails the unit
            failure = err
        while True:  # until the start is over: vLLM's processes record themselves once they have imported vLLM
            with self._lock:
                if self._over:
                    return
                self.drafter_failure = failure
                kill_recorded(self.pids_path, self.killed_segments)
            time.sleep(KILL_POLL_S)


def kill_recorded(pids_path: str, segments: set[str] | None = None) -> list[int]:
    """SIGKILL the processes whose pids the file lists, this process excepted; returns those signalled. They are
    stopped first and the shared-memory segments they map are added to `segments`, so the unit can unlink what a
    killed start left behind (no other process uses a segment of an engine that never started)."""
    try:
        with open(pids_path) as f:
            pids = {int(line) for line in f if line.strip().isdigit()}
    except FileNotFoundError:
        return []
    pids = sorted(pids - {os.getpid()})
    for pid in pids:  # all frozen first: none maps a new segment, or dies of its parent's death, before the read
        _signal(pid, signal.SIGSTOP)
    if segments is not None:
        for pid in pids:
            segments |= mapped_segments(pid)
    return [pid for pid in pids if _signal(pid, signal.SIGKILL)]


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def mapped_segments(pid: int) -> set[str]:
    """The names of the shared-memory segments (not semaphores) process `pid` maps; empty once it is gone."""
    from actors.engines.vllm import SHARED_MEMORY

    try:
        with open(f"/proc/{pid}/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if f" {SHARED_MEMORY}/" in line}
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return set()
    names = (os.path.basename(path) for path in paths if not path.endswith("(deleted)"))
    return {name for name in names if not name.startswith("sem.")}
