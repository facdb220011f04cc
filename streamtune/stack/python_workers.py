"""Warm Python workers for the local cluster's TaskManagers: a fork server.

A Python function of a Flink job runs in a worker process that the TaskManager starts when
the task deploys (`pyflink-udf-runner.sh` runs `python -m pyflink.fn_execution.beam.beam_boot`).
A fresh interpreter spends seconds importing Beam's harness, torch and transformers before
the trainer's `open()` can load its base model; `bench/submit.py` counts them in a submit's
"start" phase. The stack instead starts one server process that has imported them once, and
sets the cluster's `python.executable` to a launcher that asks the server for a worker: the
server forks, and the child runs `beam_boot` with the launcher's arguments, environment,
working directory and standard streams, exactly as the interpreter would have.

Only third-party modules are imported ahead (never streamtune's own: a worker must run the
code installed when its job starts). The server starts no Python thread (a fork would copy
their locks in whatever state they are); the native threads its imports start (torch's, the
allocator's) wait idle, and a forked worker's torch runs and trains as a fresh one does
(tests/test_python_workers.py). The launcher runs a fresh interpreter instead whenever the
server is not there or the command is anything but a worker's boot, so the cluster works
without it.

    python streamtune/stack/python_workers.py SOCKET     # the server (`streamtune stack up`)

The server runs as a script, not `-m`: importing the streamtune package would put streamtune's
modules, as they were when the server started, in every worker.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path

BOOT_MODULE = "pyflink.fn_execution.beam.beam_boot"
# What a worker imports before its first record, in the order a worker imports them.
PRELOAD = ("grpc", "pyflink.fn_execution.beam.beam_sdk_worker_main",
           "pyflink.datastream", "pyflink.table", "cloudpickle", "pydantic", "torch", "safetensors.torch",
           "transformers", "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama",
           "peft")
HEADER = struct.Struct("!I")

# The launcher: the cluster's python.executable. Standard library only, and no site packages
# (-S): it starts in tens of milliseconds. {python} and {socket} are filled in by write_launcher.
LAUNCHER = '''#!{python} -S
"""python.executable of the streamtune stack's TaskManagers (streamtune/stack/python_workers.py)."""
import json, os, signal, socket, struct, sys

PYTHON, SOCKET, BOOT = {python!r}, {socket!r}, {boot!r}
args = sys.argv[1:]
if args[:2] != ["-m", BOOT]:
    os.execv(PYTHON, [PYTHON, *args])
try:
    server = socket.socket(socket.AF_UNIX)
    server.connect(SOCKET)
    request = json.dumps({{"argv": args[2:], "env": dict(os.environ), "cwd": os.getcwd()}}).encode()
    socket.send_fds(server, [struct.pack("!I", len(request)) + request], [0, 1, 2])
    reply = server.makefile("r")
    pid = int(reply.readline())
except (OSError, ValueError):  # no server, or it could not fork: a cold interpreter
    os.execv(PYTHON, [PYTHON, *args])

def forward(sig, _frame):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, forward)
line = reply.readline()
code = int(line) if line.strip() else 1
if code < 0:  # the worker died of a signal: so does its launcher
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''


def write_launcher(path: Path, socket_path: Path, python: str = sys.executable) -> Path:
    """The launcher script, executable, for the cluster's `python.executable`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(LAUNCHER.format(python=python, socket=str(socket_path), boot=BOOT_MODULE))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def preload(modules: tuple[str, ...] = PRELOAD) -> dict[str, float]:
    """Import the modules; seconds each (a missing optional one is skipped)."""
    took = {}
    for name in modules:
        began = time.monotonic()
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"python-workers: not preloaded: {name} ({e})", flush=True)
            continue
        took[name] = round(time.monotonic() - began, 2)
    return took


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 3)
    if len(data) < HEADER.size:
        raise ValueError("short request")
    (size,) = HEADER.unpack_from(data)
    body = bytearray(data[HEADER.size:])
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("request cut short")
        body += chunk
    return json.loads(body), fds


def _run_worker(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m beam_boot ARGS` as the launcher was started."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # As the interpreter builds sys.path for `-m`: the working directory, then PYTHONPATH.
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *sys.path[1:]]
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [BOOT_MODULE, *request["argv"]]
    import runpy

    code = 0
    try:
        runpy.run_module(BOOT_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)  # as the interpreter prints sys.exit("message")
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def serve(socket_path: Path) -> None:
    """Preload, then fork a worker for each launcher that connects, until SIGTERM."""
    took = preload()
    if threading.active_count() > 1:  # a fork would copy their locks in whatever state they are
        raise SystemExit(f"python-workers: preloading started threads {threading.enumerate()}; not serving")
    print(f"python-workers: preloaded in {sum(took.values()):.2f} s {took}", flush=True)
    socket_path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX)
    old = os.umask(0o077)  # the socket forks this user's processes: this user only
    try:
        listener.bind(str(socket_path))
    finally:
        os.umask(old)
    listener.listen(64)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}   # worker pid -> its launcher's connection
    by_conn: dict[socket.socket, int] = {}
    while not stopping:
        for key, _ in sel.select(timeout=0.1):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _read_request(conn)
                except (OSError, ValueError) as e:
                    print(f"python-workers: bad request: {e}", flush=True)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    for c in (conn, *by_conn):
                        c.close()
                    _run_worker(request, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                print(f"python-workers: worker {pid}: {' '.join(request['argv'])}", flush=True)
                children[pid], by_conn[conn] = conn, pid
                sel.register(conn, selectors.EVENT_READ)
            else:  # a launcher went away (killed): its worker goes with it, as a cold one would
                conn = key.fileobj
                try:
                    gone = not conn.recv(1)
                except OSError:
                    gone = True
                if gone and conn in by_conn:
                    try:
                        os.kill(by_conn[conn], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    sel.unregister(conn)
        while children:  # reap: each launcher learns its worker's exit status
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            by_conn.pop(conn, None)
            print(f"python-workers: worker {pid} exited ({os.waitstatus_to_exitcode(status)})", flush=True)
            try:
                sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()
    listener.close()
    socket_path.unlink(missing_ok=True)


SERVER = Path(__file__).resolve()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python {SERVER} SOCKET")
    serve(Path(sys.argv[1]))
