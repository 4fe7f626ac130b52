"""bookbuild.warm: `python -m bookbuild.warm MODULE` behaves like `python -m MODULE`, forked from a warm server."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bookbuild import warm

# `fractions` is one module a fresh interpreter does not import at start: found at once, the child was forked
PROBE = """
import os, sys, time
print("preloaded" if "fractions" in sys.modules else "fresh", os.getcwd(), os.environ.get("ASKED"), sys.argv[1:])
if sys.argv[1:] == ["wait"]:
    try:
        open("started", "w").close()
        time.sleep(60)
    except KeyboardInterrupt:
        sys.exit(7)
sys.exit(3)
"""


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "warm_probe.py").write_text(PROBE)
    return tmp_path


def _ask(folder, *args, socket_path=None, **popen):
    env = {k: v for k, v in os.environ.items() if k != warm.SOCKET} | {"ASKED": "yes", "PYTHONPATH": str(folder)}
    if socket_path:
        env[warm.SOCKET] = socket_path
    return subprocess.Popen([sys.executable, "-m", "bookbuild.warm", "warm_probe", *args], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_a_warm_child_runs_the_module_as_the_asker_would(probe):
    with warm.server(dict(os.environ, OMP_NUM_THREADS="1"), libraries=("fractions",)) as path:
        assert path is not None
        out, err = _ask(probe, "a", "b", socket_path=path).communicate(timeout=60)
        asked = _ask(probe, "a", "b", socket_path=path)
        asked.wait(timeout=60)
    assert out.split() == ["preloaded", str(probe), "yes", "['a',", "'b']"], (out, err)
    assert asked.returncode == 3  # the child's exit status, passed on


def test_a_warm_child_runs_at_the_askers_nice(probe):
    (probe / "nice_probe.py").write_text("import os\nprint(os.getpriority(os.PRIO_PROCESS, 0))\n")
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
    with warm.server(dict(os.environ, OMP_NUM_THREADS="1"), libraries=("fractions",)) as path:
        assert path is not None
        env = dict(os.environ, PYTHONPATH=str(probe), **{warm.SOCKET: path})
        done = subprocess.run([sys.executable, "-m", "bookbuild.warm", "nice_probe"], cwd=probe, env=env,
                              capture_output=True, text=True, preexec_fn=lambda: os.nice(7), timeout=60)
    assert done.stdout.strip() == str(expected), done.stderr  # the asker's nice, not the server's


def test_without_a_server_the_asker_runs_the_module_itself(probe):
    asked = _ask(probe, "a", socket_path=str(probe / "no-such-socket"))
    out, _ = asked.communicate(timeout=60)
    assert out.split()[:3] == ["fresh", str(probe), "yes"] and asked.returncode == 3


def test_signals_reach_the_child_and_a_killed_asker_takes_it_down(probe):
    with warm.server(dict(os.environ, OMP_NUM_THREADS="1"), libraries=("fractions",)) as path:
        asked = _ask(probe, "wait", socket_path=path)
        _wait_for(probe / "started")
        asked.send_signal(signal.SIGINT)  # as jupyter_client interrupts a kernel
        assert asked.wait(timeout=30) == 7
        (probe / "started").unlink()
        asked = _ask(probe, "wait", socket_path=path)
        _wait_for(probe / "started")
        child = _child_of(path, probe)
        asked.kill()  # no chance to pass anything on: the server sees its connection close
        deadline = time.time() + 10
        while _alive(child) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(child)


def test_a_process_with_a_thread_running_is_not_forked():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        assert any("threads running" in p for p in warm._preload(()))
    finally:
        stop.set()
        worker.join()


def _wait_for(path, seconds=30):
    deadline = time.time() + seconds
    while not path.exists():
        assert time.time() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def _child_of(socket_path, folder) -> int:
    """The pid of the warm child running in `folder` (a process whose working directory it is)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(folder) and "warm_probe" not in open(
                    f"/proc/{pid}/cmdline").read():
                return int(pid)
        except OSError:
            continue
    raise AssertionError("no warm child found")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


def test_a_request_that_breaks_off_does_not_stop_the_server_and_its_end_takes_the_children(probe):
    import socket

    with warm.server(dict(os.environ, OMP_NUM_THREADS="1"), libraries=("fractions",)) as path:
        for _ in range(3):  # connect and hang up, with and without half a request
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.close()
        out, _ = _ask(probe, "a", socket_path=path).communicate(timeout=60)
        assert out.startswith("preloaded")
        asked = _ask(probe, "wait", socket_path=path)
        _wait_for(probe / "started")
        child = _child_of(path, probe)
    deadline = time.time() + 10  # the block has ended: the server went, and took its running child along
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    asked.wait(timeout=30)
