"""Warm interpreters: `python -m MODULE ARGS…` forked from a process that has imported the libraries.

A fresh Python process on the lab's machine spends about 8 s of CPU importing torch, transformers'
model classes, trl, peft and bitsandbytes before it computes anything, and building the book starts
dozens of them: a pipeline process and a kernel per chapter, a process per lab model. `serve` imports
those libraries once and forks a child per request. `python -m labutils.warm MODULE ARGS…` asks it:
the child runs the module with the asker's arguments, working directory, environment and standard
streams; the asker passes signals on, and exits with the child's status. Where no server answers
(LAB_WARM unset, or the server gone), it runs the module itself, as `python -m` would.

Forking is only safe from a process with one thread and no CUDA driver state, so the server imports
nothing of the lab's own (whose modules read the environment) and refuses to serve where torch sees
a GPU or an import left a thread running. Like a spawned process, each child seeds Python's random
module afresh; torch's default generator starts from its usual fixed seed, as in a fresh process.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
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
    problems = []
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


def serve(path: str, libraries=LIBRARIES) -> None:
    """Import `libraries`, then fork a child per request on the Unix socket `path` until the parent exits."""
    problems = _preload(libraries)
    if problems:
        print(f"refused: {'; '.join(problems)}", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    parent, children, owners = os.getppid(), {}, {}  # child pid -> its asker's connection, and back
    print("ready", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe after this line
    import select

    while os.getppid() == parent:
        readable, _, _ = select.select([listener, *owners], [], [], 0.05)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                request, fds = _receive(conn, fds=3)
                if request is None or len(fds) != 3:
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in owners:
                        other.close()
                    _child(conn, request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                children[pid], owners[conn] = conn, pid
                _send(conn, {"pid": pid})
            elif not sock.recv(64):  # the asker is gone (killed): its child and the child's own go too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(owners[sock], signal.SIGKILL)
                del owners[sock]
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            if conn in owners:
                del owners[conn]
                with contextlib.suppress(OSError):
                    _send(conn, {"status": os.waitstatus_to_exitcode(status)})
            conn.close()


def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Become `python -m MODULE ARGS…` in the asker's directory, environment and streams, then exit."""
    import atexit
    import random
    import runpy
    import traceback

    code = 1
    try:
        conn.close()
        os.setsid()  # a process group of its own: signals and a kill reach what it starts too
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
        random.seed()
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


@contextlib.contextmanager
def server(env: dict, libraries=LIBRARIES):
    """A warm server for the duration of the block: yields its socket path, or None where it refused.

    `env` is the environment the server imports under; the children it forks should share it."""
    with tempfile.TemporaryDirectory(prefix="warm-") as folder:
        path = str(Path(folder) / "socket")
        process = subprocess.Popen([sys.executable, "-c", f"from labutils.warm import serve; serve({path!r}, {tuple(libraries)!r})"],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   start_new_session=True)
        try:
            first = process.stdout.readline().strip()
            yield path if first == "ready" else None
        finally:
            process.kill()
            process.wait()


# --- the asker ------------------------------------------------------------------------------------

def run(module: str, args: list[str]) -> int:
    """`python -m module args…` in a warm child where a server answers, else in this process."""
    path = os.environ.get(SOCKET)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not path:
            raise OSError
        sock.connect(path)
        _send(sock, {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}, [0, 1, 2])
        started, _ = _receive(sock)
    except OSError:
        started = None
    if started is None:  # no server: this process becomes the module
        sock.close()
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
    child = started["pid"]

    def forward(sig, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    done, _ = _receive(sock)
    if done is None:
        return 1
    return done["status"] if done["status"] >= 0 else 128 - done["status"]  # killed by a signal: as a shell says


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m labutils.warm MODULE [ARGS…]")
    sys.exit(run(sys.argv[1], sys.argv[2:]))
