"""Warm interpreters: `python -m MODULE ARGS…` forked from a process that has imported the libraries.

A fresh Python process on the lab's machine spends about 8 s of CPU importing torch, transformers'
model classes, trl, peft and bitsandbytes before it computes anything, and building the book starts
dozens of them: a pipeline process and a kernel per chapter, a process per lab model. `serve` imports
those libraries once and forks a child per request. `python -m bookbuild.warm MODULE ARGS…` asks it:
the child runs the module with the asker's arguments, working directory, environment and standard
streams; the asker passes signals on, exits with the child's status, and takes the child down if
its own parent dies. Where no server answers (LAB_WARM unset, or the server gone), it runs the
module itself, as `python -m` would.

Forking is only safe from a process with one thread and no CUDA driver state, so the server refuses
to serve off Linux, where torch sees a GPU, or where an import left a thread running; and it imports
none of the lab's chapter code (only the package's light `__init__`). A child is not a fresh interpreter in every
respect: it shares the server's hash seed and the global random states the imports left (the
chapters seed their own generators), its memory counts the preloaded libraries' pages, and the objects the
imports made are frozen out of the garbage collector (`gc.freeze`: never collected, not in `gc.get_objects()`).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOCKET = "LAB_WARM"  # the environment variable naming the server's socket
LIBRARIES = ("torch", "transformers:Qwen2ForCausalLM,MixtralForCausalLM,AutoModelForCausalLM,AutoTokenizer",
             "trl:GRPOConfig,GRPOTrainer", "peft:LoraConfig,get_peft_model", "bitsandbytes", "accelerate",
             "pandas", "scipy.stats", "papermill", "jupytext", "nbformat")
# Not matplotlib: it reads MPLBACKEND when imported, and a kernel sets that only once it starts. Not
# ipykernel: its kernel reads JPY_PARENT_PID when imported, and each kernel's parent is another.
FORK_SAFE_THREAD = "jemalloc_bg_thd"  # pyarrow's allocator (trl imports datasets): jemalloc handles fork
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    payload = json.dumps(message).encode()
    header = struct.pack("!I", len(payload))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _receive(sock: socket.socket, fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None at end of stream) and the file descriptors that came with it."""
    header, received, _, _ = socket.recv_fds(sock, 4, fds) if fds else (sock.recv(4), [], 0, None)
    while header and len(header) < 4:
        more = sock.recv(4 - len(header))
        if not more:
            break
        header += more
    if len(header) < 4:
        return None, received
    size, payload = struct.unpack("!I", header)[0], b""
    while len(payload) < size:
        chunk = sock.recv(size - len(payload))
        if not chunk:
            return None, received
        payload += chunk
    return json.loads(payload), received


# --- the server ------------------------------------------------------------------------------------

def _preload(libraries) -> list[str]:
    """Import `libraries` ("module" or "module:name,name"); returns why forking would be unsafe, if it is."""
    import importlib

    for spec in libraries:
        module, _, names = spec.partition(":")
        try:
            loaded = importlib.import_module(module)
            for name in filter(None, names.split(",")):
                getattr(loaded, name)
        except Exception:  # an optional library missing or broken: its users import it themselves
            continue
    problems = [] if sys.platform == "linux" else [f"on {sys.platform} the system libraries' fork safety is not checked"]
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        problems.append("torch sees a CUDA GPU: a forked child could not use it")
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []
    others = [name for name in (Path(f"/proc/self/task/{t}/comm").read_text().strip()
                                for t in tasks if int(t) != os.getpid()) if name != FORK_SAFE_THREAD]
    if others:
        problems.append(f"the imports left threads running: {', '.join(others)}")
    if "matplotlib" in sys.modules:
        problems.append("matplotlib was imported, before a kernel could choose its backend")
    return problems


class _Become(BaseException):
    """Raised in a forked child once its module has run: unwinds the server's loop, then exits normally."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def serve(path: str, libraries=LIBRARIES) -> None:
    """Import `libraries`, then fork a child per request on the Unix socket `path` until the parent exits
    or SIGTERM arrives; the children still running then are killed."""
    try:
        _serve(path, libraries)
    except _Become as child:  # in a child: the interpreter's own exit (threads joined, atexit, flushing)
        sys.exit(child.code)


def _serve(path: str, libraries) -> None:
    import select

    problems = _preload(libraries)
    if problems:
        print(f"refused: {'; '.join(problems)}", flush=True)
        return
    # the imports' objects out of the collector's reach: a child's collections, and its interpreter's shutdown,
    # then do not walk (and copy, page by page) the whole shared heap; an exiting child took 2 s of CPU without
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    me, parent, children, owners = os.getpid(), os.getppid(), {}, {}  # child pid -> asker's connection, and back
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe after this line
    try:
        while os.getppid() == parent:
            readable, _, _ = select.select([listener, *owners], [], [], 0.05)
            for sock in readable:
                if sock is listener:
                    _start_child(listener, owners, children)
                    continue
                try:
                    gone = not sock.recv(64)
                except OSError:
                    gone = True
                if gone:  # the asker was killed: its child and whatever that started go too
                    _kill_group(owners.pop(sock))
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid)
                if owners.pop(conn, None) is not None:
                    with contextlib.suppress(OSError):
                        _send(conn, {"status": os.waitstatus_to_exitcode(status)})
                conn.close()
    finally:
        if os.getpid() == me:
            for pid in children:
                _kill_group(pid)


def _start_child(listener: socket.socket, owners: dict, children: dict) -> None:
    """Accept one request and fork its child; a request that breaks off costs nothing but itself."""
    try:
        conn, _ = listener.accept()
        request, fds = _receive(conn, fds=3)
    except (OSError, ValueError):
        return
    if request is None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in owners:
            other.close()
        _child(conn, request, fds)  # raises _Become
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    try:
        _send(conn, {"pid": pid})
        owners[conn] = pid
    except OSError:  # the asker is already gone
        _kill_group(pid)


def _kill_group(pid: int) -> None:
    """SIGKILL the process group a child leads (the child alone, if it has not made its group yet)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Become `python -m MODULE ARGS…` in the asker's directory, environment and streams."""
    import runpy
    import traceback

    code = 1
    try:
        conn.close()
        os.setsid()  # a process group of its own: signals and a kill reach what it starts too
        with contextlib.suppress(OSError):  # the asker's nice, as its own child had (lowering needs a privilege)
            os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (*FORWARDED, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]
        sys.argv = [request["module"], *request["args"]]
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
    raise _Become(code)


@contextlib.contextmanager
def server(env: dict, libraries=LIBRARIES, timeout: float = 300.0):
    """A warm server for the duration of the block: yields its socket path, or None where it refused
    (the reason goes to stderr) or did not start within `timeout` seconds.

    `env` is the environment the server imports under; the children it forks should share it."""
    import select

    with tempfile.TemporaryDirectory(prefix="warm-") as folder:
        path = str(Path(folder) / "socket")
        process = subprocess.Popen([sys.executable, "-c", f"from bookbuild.warm import serve; serve({path!r}, {tuple(libraries)!r})"],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   start_new_session=True)
        answer, deadline = "", time.monotonic() + timeout
        try:
            while answer not in ("ready",) and not answer.startswith("refused") and time.monotonic() < deadline:
                if select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    line = process.stdout.readline()
                    if not line:
                        break
                    answer = line.strip()
            if answer != "ready":
                print(f"no warm server ({answer or 'it did not start'}): fresh processes instead", file=sys.stderr)
            yield path if answer == "ready" else None
        finally:
            process.terminate()  # the server kills the children still running
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# --- the asker ------------------------------------------------------------------------------------

def run(module: str, args: list[str]) -> int:
    """`python -m module args…` in a warm child where a server answers, else in this process."""
    import select

    path = os.environ.get(SOCKET)
    if not path:
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
    child, pending, parent = [], [], os.getppid()

    def forward(sig, _frame):  # to the child once its pid is known; until then, kept for it
        if not child:
            pending.append(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            try:
                os.killpg(child[0], sig)
            except ProcessLookupError:  # the child has not made its own group yet
                os.kill(child[0], sig)

    before = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        _send(sock, {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ),
                     "nice": os.getpriority(os.PRIO_PROCESS, 0)}, [0, 1, 2])
        started, _ = _receive(sock)
    except (OSError, ValueError):
        started = None
    if started is None:  # no server: this process becomes the module, with the signals it has had
        sock.close()
        os.environ.pop(SOCKET)  # and neither it nor what it starts asks the missing server again
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for sig in pending:
            os.kill(os.getpid(), sig)
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
    child.append(started["pid"])
    for sig in pending:
        forward(sig, None)
    while not select.select([sock], [], [], 1.0)[0]:
        if os.getppid() != parent:  # whoever started this is gone (a kernel's chapter process killed)
            _kill_group(child[0])
            return 1
    done, _ = _receive(sock)
    if done is None:
        return 1
    return done["status"] if done["status"] >= 0 else 128 - done["status"]  # killed by a signal: as a shell says


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m bookbuild.warm MODULE [ARGS…]")
    sys.exit(run(sys.argv[1], sys.argv[2:]))
